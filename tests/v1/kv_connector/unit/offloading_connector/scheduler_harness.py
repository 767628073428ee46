# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A scheduler-side connector without an engine: scripted specs, requests, a counting manager.

Shared by the scheduler half's tests (``test_scheduler``, ``test_engine_checks`` and its fuzz).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from tests.v1.kv_offload.cpu.manager_state import load_pins
from tests.v1.kv_offload.utils import make_run_info
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.request_state import (
    RequestOffloadState,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.transfer_jobs import TransferJobTable
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.kv_offload.base import OffloadingManager, OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.spec import OffloadingSpec, WorkerHandlers
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.request import Request


class ScriptedSpec(OffloadingSpec):
    """A spec that only hands the given manager to the scheduler half (no worker side)."""

    def __init__(
        self, manager: OffloadingManager, block_sizes: tuple[int, ...], block_size: int | None
    ) -> None:
        run = make_run_info(4096, gpu_block_sizes=block_sizes)
        super().__init__(OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=block_size), run)
        self.manager = manager

    @override
    def get_manager(self) -> OffloadingManager:
        return self.manager

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        raise NotImplementedError("scheduler-side tests only")


def make_request(num_tokens: int, hash_block_size: int = 16) -> Request:
    """A request of tokens ``0..num_tokens-1``, id ``r<num_tokens>``."""
    return Request(
        f"r{num_tokens}",
        list(range(num_tokens)),
        1,
        block_hasher=get_request_block_hasher(hash_block_size),
    )


class CountingManager(CPUOffloadingManager):
    """The real CPU manager, counting the step ends and finished requests it is told of."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.schedule_ends = 0
        self.finished: list[str] = []

    def on_schedule_end(self) -> None:
        self.schedule_ends += 1

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished.append(req_context.req_id)


def setup_scheduler() -> tuple[OffloadingConnectorScheduler, CountingManager]:
    """A scheduler half over a real CPU manager of 32 blocks (GPU blocks of 16 tokens)."""
    manager = CountingManager(32)
    return OffloadingConnectorScheduler(ScriptedSpec(manager, (16,), None)), manager


def offload_keys(request: Request) -> list[OffloadKey]:
    """Group-0 keys of the request's hashed blocks."""
    return [make_offload_key(h, 0) for h in request.block_hashes]


def offload_all(manager: CountingManager, keys: list[OffloadKey]) -> None:
    """Store ``keys`` in the manager, as another request would have."""
    ctx = ReqContext("writer")
    output = manager.prepare_store(keys, ctx)
    assert output is not None
    manager.complete_store(output.keys_to_store, ctx)


def request_states(sched: OffloadingConnectorScheduler) -> dict[str, RequestOffloadState]:
    """The connector's state of each request it tracks, by request id."""
    # private: the connector's books; the engine asks only tracks_request(req_id).
    return sched._request_states


def job_table(sched: OffloadingConnectorScheduler) -> TransferJobTable:
    """The connector's table of the transfer jobs in flight."""
    # private: the job table is the connector's; callers see only get_stats()'s counts.
    return sched._jobs


def snapshot(sched: OffloadingConnectorScheduler, manager: CountingManager) -> Any:
    """The connector's books and the manager's state.

    A refused call must leave the books exactly as they were, and no public API shows them
    whole: this is the one place these tests read the scheduler's private fields.
    """
    states = {
        req_id: (
            [list(ids) for ids in s.block_ids],
            s.expect_fresh_alloc,
            s.finished,
            sorted(s.transfer_jobs),
            s.next_stored_block_idx,
            s.num_locally_computed_tokens,
        )
        for req_id, s in request_states(sched).items()
    }
    # private: the step's books (its load jobs and allocated blocks) have no public view.
    return (
        states,
        sorted(sched._current_batch_load_jobs),
        list(sched._current_batch_allocated_blocks),
        len(job_table(sched)),
        sorted((k, b.block_id, b.ref_cnt) for k, b in manager.policy.items()),
        {r: load_pins(manager, r) for r in request_states(sched)},
        manager.schedule_ends,
        list(manager.finished),
    )
