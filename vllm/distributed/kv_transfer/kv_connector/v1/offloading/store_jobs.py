# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What a step offers to ``prepare_store``, and the GPU blocks of what the manager accepts.

Helpers of ``OffloadingConnectorScheduler.build_connector_meta`` (its store-job building), kept
free of the scheduler's books so that they only compute:

* ``store_candidates``: the requests whose blocks may be offered this step: those scheduled in
  it, and running requests whose latest ``prepare_store`` found no room;
* ``offloadable_end``: the end (in offloaded blocks) of what a request may store now;
* ``store_gpu_indices``: per group, the GPU block indices of the keys ``prepare_store`` accepted.

Block geometry (offloaded blocks, their keys, their GPU blocks) is described in ``request_state``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import ReqId
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.request_state import (
    RequestOffloadState,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_offload.base import OffloadKey


def store_candidates(
    scheduler_output: SchedulerOutput,
    deferred: set[ReqId],
    req_status: Mapping[ReqId, RequestOffloadState],
    gpu_block_sizes: Sequence[int],
) -> list[tuple[ReqId, int]]:
    """``(req_id, num_computed_tokens)`` of every request whose blocks may be offered now.

    The step's scheduled requests, then the ``deferred`` ones (their latest ``prepare_store``
    found no room) that were not scheduled but still run and hold blocks: under async
    scheduling a request's last step is scheduled before the completions that free the room
    arrive, so it is offered again even when not scheduled. Such a request's computed tokens
    (the engine's ``Request.num_computed_tokens``, checked by nothing this step) count only as
    far as its recorded GPU blocks hold them.
    """
    scheduled: list[tuple[ReqId, int]] = [
        (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
    ]
    cached = scheduler_output.scheduled_cached_reqs
    scheduled.extend(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for req_id in deferred - scheduler_output.num_scheduled_tokens.keys():
        retry = req_status.get(req_id)
        if retry is not None and not retry.finished and any(retry.block_ids):
            in_blocks = min(
                len(ids) * size for ids, size in zip(retry.block_ids, gpu_block_sizes, strict=True)
            )
            scheduled.append((req_id, min(retry.req.num_computed_tokens, in_blocks)))
    return scheduled


def offloadable_end(
    state: RequestOffloadState,
    num_computed: int,
    num_scheduled: int,
    offloaded_block_size: int,
    hashes_per_block: int,
    prompt_only: bool,
) -> int:
    """The end (exclusive, in offloaded blocks) of the request's blocks that may be stored once
    this step's ``num_scheduled`` tokens are computed: full blocks with keys, of the prompt only
    if ``prompt_only``. Extends the request's keys as its block hashes grew."""
    req = state.req
    num_offloadable = min(num_computed + num_scheduled, req.num_tokens)
    if prompt_only:
        num_offloadable = min(num_offloadable, req.num_prompt_tokens)
    return min(num_offloadable // offloaded_block_size, state.extend_offload_keys(hashes_per_block))


def store_gpu_indices(
    req_id: ReqId,
    state: RequestOffloadState,
    keys_to_store: Sequence[OffloadKey],
    start: int,
    end: int,
    block_size_factors: Sequence[int],
) -> list[list[int]]:
    """Per group, the indices (into the request's GPU blocks) of ``keys_to_store``, which
    ``prepare_store`` picked among the request's keys of offloaded blocks ``[start, end)`` and
    returned in group order."""
    # Position of each requested key: (group, offloaded block index).
    position = {
        key: (g, i)
        for g, group_keys in enumerate(state.offload_keys)
        for i, key in enumerate(group_keys[start:end], start)
    }
    gpu_indices: list[list[int]] = [[] for _ in block_size_factors]
    last_group = 0
    for key in keys_to_store:
        g, i = position[key]
        assert g >= last_group, (
            f"request {req_id}: prepare_store returned keys out of group order "
            f"(key {key.hex()} of group {g} after group {last_group})"
        )
        last_group = g
        factor = block_size_factors[g]
        gpu_indices[g].extend(range(i * factor, (i + 1) * factor))
    return gpu_indices
