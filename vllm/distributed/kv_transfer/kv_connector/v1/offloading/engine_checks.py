# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``EngineCallChecks``: the refusals of ``OffloadingConnectorScheduler``'s public methods.

The engine (vLLM's scheduler, or this repository's) is outside the connector: a call out of order,
or with arguments that contradict what the connector was told earlier, raises an exception naming
the request, never an ``assert`` (gone under ``python -O``, and no help to the caller), and
leaves the connector and its manager exactly as they were. Each public method of the scheduler
runs its check once, first, and then its algorithm, which never re-validates what the connector
produced itself; internal invariants stay ``assert`` s.

The checks read the scheduler's books, so they are methods of the scheduler: this mixin keeps
them in one place that a reader of the algorithm can skip.

Errors: ``ValueError`` for a call that contradicts the books, ``TypeError`` for an argument of the
wrong type, ``RuntimeError`` for a call at the wrong time.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    JobId,
    OffloadingWorkerMetadata,
    ReqId,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.groups import GroupLayout
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.request_state import (
    RequestOffloadState,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.transfer_jobs import (
    GPUBlockRef,
    TransferJobTable,
)
from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
from vllm.v1.kv_cache_interface import NULL_BLOCK_ID

__all__ = ["EngineCallChecks"]


class EngineCallChecks:
    """Checks of the engine's calls, mixed into ``OffloadingConnectorScheduler`` (whose books
    they read; see the module docstring). Each raises before anything changes."""

    layout: GroupLayout
    _request_states: dict[ReqId, RequestOffloadState]
    _jobs: TransferJobTable
    _current_batch_load_jobs: dict[JobId, TransferJob]
    _current_batch_allocated_blocks: list[GPUBlockRef]

    def _check_alloc(
        self, req_id: ReqId, blocks: GroupBlockIds, num_external_tokens: int
    ) -> RequestOffloadState:
        """Validate an ``update_state_after_alloc`` call; return the request's state.

        Raises:
            ValueError: the request was never looked up (``get_num_new_matched_tokens``),
                ``blocks`` has the wrong number of groups, a group's earlier blocks changed
                without a restart (only freed sliding-window blocks may become
                ``NULL_BLOCK_ID``), or a load (``num_external_tokens > 0``) is requested without
                a lookup since the last (re)start, does not end on an offloaded block boundary,
                goes beyond the blocks the request has keys for or beyond the GPU blocks
                allocated, or loads keys another request's load job is loading (its lookup was
                deferred).
        """
        method = "update_state_after_alloc"
        state = self._request_states.get(req_id)
        if state is None:
            raise ValueError(
                f"{method}: request {req_id!r} was never looked up (get_num_new_matched_tokens)"
            )
        num_groups = len(state.block_ids)
        if len(blocks) != num_groups:
            raise ValueError(
                f"{method}: request {req_id!r} has {len(blocks)} block groups, expected "
                f"{num_groups}"
            )
        if num_external_tokens < 0:
            raise ValueError(
                f"{method}: request {req_id!r}: num_external_tokens={num_external_tokens} < 0"
            )
        if not state.expect_fresh_alloc:
            for g, (group_blocks, old) in enumerate(zip(blocks, state.block_ids, strict=True)):
                kept = group_blocks[: len(old)]
                if len(kept) < len(old) or not all(
                    new in (was, NULL_BLOCK_ID) for new, was in zip(kept, old, strict=True)
                ):
                    raise ValueError(
                        f"{method}: request {req_id!r}: group {g} blocks changed without a "
                        f"restart (had {len(old)} blocks, now {len(group_blocks)})"
                    )
        if not num_external_tokens:
            return state
        if not state.expect_fresh_alloc:
            raise ValueError(
                f"{method}: request {req_id!r}: a load of {num_external_tokens} tokens without "
                "a lookup (get_num_new_matched_tokens) since its last allocation"
            )
        block_size = self.layout.offloaded_block_size
        num_local = state.num_locally_computed_tokens
        end_tokens = num_local + num_external_tokens
        if end_tokens % block_size:
            raise ValueError(
                f"{method}: request {req_id!r}: load ends at token {end_tokens}, not on an "
                f"offloaded block boundary ({block_size})"
            )
        num_known = min(len(keys) for keys in state.offload_keys)
        if end_tokens > num_known * block_size:
            raise ValueError(
                f"{method}: request {req_id!r}: load ends at token {end_tokens}, beyond its "
                f"{num_known} offloaded blocks with keys"
            )
        sizes = self.layout.gpu_block_sizes
        for g, (group_blocks, size) in enumerate(zip(blocks, sizes, strict=True)):
            if end_tokens > len(group_blocks) * size:
                raise ValueError(
                    f"{method}: request {req_id!r}: load ends at token {end_tokens}, beyond "
                    f"its {len(group_blocks)} GPU blocks of group {g}"
                )
        keys = self.layout.load_keys(
            state.offload_keys, num_local // block_size, end_tokens // block_size
        )
        if self._jobs.any_being_loaded(keys):
            raise ValueError(
                f"{method}: request {req_id!r} loads blocks that another request's load job is "
                "still loading (its lookup was deferred)"
            )
        return state

    def _check_step(self, scheduler_output: SchedulerOutput) -> None:
        """Validate the step's ``SchedulerOutput`` before ``build_connector_meta`` applies it.

        Raises:
            ValueError: a newly scheduled request was never looked up or its blocks differ from
                those ``update_state_after_alloc`` recorded; a running request is unknown, its
                new blocks have the wrong number of groups, or the running requests' lists
                differ in length; a scheduled request was not allocated
                (``update_state_after_alloc``) since its last lookup; a request is scheduled
                twice, or scheduled and preempted; a scheduled or preempted request has a load
                job in flight (the engine runs a request only once its load was reported); a
                scheduled request's GPU blocks do not cover the tokens it will have computed at
                the end of the step (the engine allocates them before it schedules the tokens,
                and the step's store jobs read them).
        """
        method = "build_connector_meta"
        states = self._request_states
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        scheduled: list[ReqId] = []
        # (request, GPU blocks per group after the step's allocations, tokens computed by its end)
        extents: list[tuple[ReqId, list[int], int]] = []
        for new_req in scheduler_output.scheduled_new_reqs:
            state = states.get(new_req.req_id)
            if state is None:
                raise ValueError(
                    f"{method}: scheduled request {new_req.req_id!r} was never looked up "
                    "(get_num_new_matched_tokens)"
                )
            if [list(ids) for ids in new_req.block_ids] != state.block_ids:
                raise ValueError(
                    f"{method}: request {new_req.req_id!r}: scheduled blocks differ from the ones "
                    "update_state_after_alloc recorded"
                )
            end_of_step = new_req.num_computed_tokens + num_scheduled_tokens.get(new_req.req_id, 0)
            extents.append((new_req.req_id, [len(ids) for ids in new_req.block_ids], end_of_step))
            scheduled.append(new_req.req_id)
        cached = scheduler_output.scheduled_cached_reqs
        if not len(cached.req_ids) == len(cached.new_block_ids) == len(cached.num_computed_tokens):
            raise ValueError(
                f"{method}: the running requests' lists differ in length ({len(cached.req_ids)} "
                f"ids, {len(cached.new_block_ids)} block lists, {len(cached.num_computed_tokens)} "
                "computed-token counts)"
            )
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            cached_state = states.get(req_id)
            if cached_state is None:
                raise ValueError(
                    f"{method}: running request {req_id!r} is unknown to the connector (never "
                    "looked up, or finished)"
                )
            num_blocks = [len(ids) for ids in cached_state.block_ids]
            if new_block_ids is not None:
                if len(new_block_ids) != len(num_blocks):
                    raise ValueError(
                        f"{method}: running request {req_id!r} has new blocks for "
                        f"{len(new_block_ids)} groups, expected {len(num_blocks)}"
                    )
                num_blocks = [
                    n + len(ids) for n, ids in zip(num_blocks, new_block_ids, strict=True)
                ]
            extents.append((req_id, num_blocks, num_computed + num_scheduled_tokens.get(req_id, 0)))
            scheduled.append(req_id)
        if len(set(scheduled)) != len(scheduled):
            raise ValueError(f"{method}: a request is scheduled twice in one step: {scheduled}")
        both = set(scheduled) & scheduler_output.preempted_req_ids
        if both:
            raise ValueError(f"{method}: requests {sorted(both)} are both scheduled and preempted")
        for req_id in scheduled:
            if states[req_id].expect_fresh_alloc:
                raise ValueError(
                    f"{method}: request {req_id!r} is scheduled without update_state_after_alloc "
                    "since its last lookup"
                )
        for what, req_ids in (
            ("scheduled", scheduled),
            ("preempted", scheduler_output.preempted_req_ids),
        ):
            for req_id in req_ids:
                state = states.get(req_id)
                if state is None:
                    continue  # a preempted request the connector never saw: nothing to flush
                for job_id in state.transfer_jobs:
                    if not self._jobs[job_id].is_store:
                        raise ValueError(
                            f"{method}: request {req_id!r} is {what} while its load job {job_id} "
                            "is in flight"
                        )
        sizes = self.layout.gpu_block_sizes
        for req_id, num_blocks, end_of_step in extents:
            # The engine allocates a request's blocks before it schedules their tokens; the
            # step's store jobs read the blocks of the tokens computed by its end.
            end = min(end_of_step, states[req_id].req.num_tokens)
            for g, (n, size) in enumerate(zip(num_blocks, sizes, strict=True)):
                if n * size < end:
                    raise ValueError(
                        f"{method}: request {req_id!r} is scheduled to compute up to token {end} "
                        f"but holds {n} GPU blocks of group {g} ({n * size} tokens)"
                    )

    def _check_worker_meta(self, meta: KVConnectorWorkerMetadata) -> OffloadingWorkerMetadata:
        """``meta`` as this connector's worker metadata.

        Raises:
            TypeError: it is another connector's.
        """
        if not isinstance(meta, OffloadingWorkerMetadata):
            raise TypeError(
                f"update_connector_output: worker metadata is {type(meta).__name__}, "
                "expected OffloadingWorkerMetadata"
            )
        return meta

    def _check_finish(self, req_id: ReqId) -> RequestOffloadState | None:
        """Validate a ``request_finished`` call; the request's state (None: never seen).

        Raises:
            ValueError: the request already finished.
        """
        state = self._request_states.get(req_id)
        if state is not None and state.finished:
            raise ValueError(f"request_finished: request {req_id!r} finished twice")
        return state

    def _check_reset(self) -> None:
        """Validate a ``reset_cache`` call.

        Raises:
            RuntimeError: it comes in the middle of a step (after ``update_state_after_alloc``,
                before ``build_connector_meta``).
        """
        if self._current_batch_load_jobs or self._current_batch_allocated_blocks:
            raise RuntimeError(
                "reset_cache: called in the middle of a step (after update_state_after_alloc, "
                "before build_connector_meta); nothing was reset"
            )
