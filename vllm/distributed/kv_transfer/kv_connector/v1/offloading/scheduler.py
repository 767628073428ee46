# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingConnectorScheduler``: the scheduler-side half of the offloading connector.

It turns the scheduler's decisions into transfer jobs and drives the ``OffloadingManager``:

* lookups (``get_num_new_matched_tokens``) decide how many tokens a waiting request can load;
* ``update_state_after_alloc`` pins the hit blocks (``prepare_load``) and creates the load job;
* ``build_connector_meta`` creates store jobs for newly full blocks (``prepare_store``), flushes
  jobs whose GPU blocks are about to be overwritten, and ends the manager's step with exactly one
  ``manager.on_schedule_end()``, its last manager call;
* ``update_connector_output`` completes a job once every worker reported it (``complete_store`` /
  ``complete_load`` with exactly that job's keys).

Nothing else drives the manager's step lifecycle: ``take_events()`` only drains events.

Block geometry (offloaded blocks, their keys, their GPU blocks) is described in
``request_state``, whose ``RequestOffloadState`` holds what is tracked per request; what lookups,
loads, stores and fences need of full-attention and sliding-window groups, in ``groups``.

Protection of GPU blocks (fencing): ``request_finished`` always returns ``(False, None)``, so the
engine frees a finished request's GPU blocks at once, even while a store job still reads them.
When the request finishes, the GPU blocks of its pending store jobs are fenced; a fenced block
reallocated later puts the jobs reading it into ``jobs_to_flush``, and the workers wait for them
before the forward pass that overwrites the block. Preempted requests' store jobs are flushed
directly. Loads are never fenced: the engine keeps a loading request's blocks until the load is
reported, even if the request is aborted.

The books of the jobs in flight (ids, worker reports, the fence index, the jobs issued before a
``reset_cache``) are kept by a ``transfer_jobs.TransferJobTable``, the statistics by a
``metrics.OffloadingSchedulerMetrics``, what is known of each request (its keys, GPU blocks,
what it may store) by its ``request_state.RequestOffloadState``. Engine calls that contradict the
books raise before any change: each public method runs its check from ``engine_checks`` first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import LoadResult
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    JobId,
    OffloadingConnectorMetadata,
    ReqId,
    TransferJob,
    TransferSpec,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.engine_checks import (
    EngineCallChecks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import to_kv_events
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.groups import (
    GroupLayout,
    LookupFn,
    PrefixLookupFn,
    lookup_hit_end,
    promoting_hit_end,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.load_guard import (
    CPU_TIER,
    LoadGuard,
    PendingWait,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadingSchedulerMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.request_state import (
    RequestOffloadState,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.stats_collector import (
    SchedulerStatsCollector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.transfer_jobs import (
    GPUBlockRef,
    TransferJobStatus,
    TransferJobTable,
)
from vllm.logger import init_logger
from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
from vllm.v1.kv_offload.base import (
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
)
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

__all__ = [
    "GPUBlockRef",
    "LoadResult",
    "OffloadingConnectorScheduler",
    "RequestOffloadState",
    "TransferJobStatus",
]

logger = init_logger(__name__)


class OffloadingConnectorScheduler(EngineCallChecks):
    """The scheduler-side half of the offloading connector (see the module docstring).

    Runs on the scheduler thread; no method blocks. Every call costs O(keys and blocks of the
    requests it concerns), never O(cache size). The checks of the engine's calls are the
    ``EngineCallChecks`` methods, run once at the top of each public method.

    Args:
        spec: the offloading spec; ``spec.get_manager()`` is the manager this half drives.
        hash_block_size: tokens per hashed block of ``Request.block_hashes``; defaults to the gcd
            of the GPU block sizes. Must divide the offloaded block size.
    """

    def __init__(
        self,
        spec: OffloadingSpec,
        *,
        hash_block_size: int | None = None,
    ) -> None:
        self.spec = spec
        self.manager: OffloadingManager = spec.get_manager()
        self.gpu_block_sizes: tuple[int, ...] = tuple(spec.gpu_block_size)
        self.num_groups = len(self.gpu_block_sizes)
        self.offloaded_block_size: int = spec.offloaded_block_size
        self.hash_block_size = hash_block_size or math.gcd(*self.gpu_block_sizes)
        if self.offloaded_block_size % self.hash_block_size:
            raise ValueError(
                f"hash_block_size={self.hash_block_size} must divide the offloaded block size "
                f"{self.offloaded_block_size}"
            )
        self.hashes_per_block = self.offloaded_block_size // self.hash_block_size
        # Full-attention and sliding-window groups: what lookups, loads and stores need of each.
        self.layout = GroupLayout(
            self.gpu_block_sizes, self.offloaded_block_size, spec.run.sliding_windows
        )
        self.num_workers: int = spec.run.world_size
        # Blocks holding generated tokens are stored too unless the config says otherwise.
        self.offload_prompt_only: bool = spec.config.offload_prompt_only

        self._jobs = TransferJobTable(self.num_workers)
        self._metrics = OffloadingSchedulerMetrics()
        # Loads only when they beat recompute (None: the config turned the guard off).
        self.load_guard: LoadGuard | None = LoadGuard() if spec.config.load_guard else None
        # Turns the counters above, the manager's, the tiers' and the guard's into per-step stats.
        self.stats_collector = SchedulerStatsCollector(
            spec, self.manager, self._metrics, self.load_guard
        )
        self._request_states: dict[ReqId, RequestOffloadState] = {}
        # Running requests whose latest prepare_store found no room: offered again at the next
        # step even when not scheduled in it (under async scheduling a request's last step is
        # scheduled before the completions that free the room arrive).
        self._deferred_store_reqs: set[ReqId] = set()

        # Per-step buffers, consumed by build_connector_meta.
        self._current_batch_load_jobs: dict[JobId, TransferJob] = {}
        self._current_batch_allocated_blocks: list[GPUBlockRef] = []

        # Results of update_connector_output, drained by take_load_results().
        self._load_results: list[LoadResult] = []
        # Keys this connector stored from the GPU, when tracked (None: not tracked; it grows
        # with every block stored, so only reports that need it turn it on, e.g. a fleet run
        # telling cross-instance reuse from an instance's own).
        self.stored_keys: set[OffloadKey] | None = None
        # The guard's measurement of each load job in flight (CPU -> GPU), by job id.
        self._load_waits: dict[JobId, PendingWait] = {}
        # The guard's measurement of each promotion a request waits for since the guard let
        # it, with its keys: it ends when no key is being promoted any more (the tier reported
        # it), whether or not the request was looked up again (it may wait for a slot).
        self._promotion_waits: list[tuple[PendingWait, tuple[OffloadKey, ...]]] = []

    # -----------------------------------------------------------------------------------------
    # Helpers
    # -----------------------------------------------------------------------------------------

    def _get_or_create_state(self, request: Request) -> RequestOffloadState:
        state = self._request_states.get(request.request_id)
        if state is None:
            ctx = ReqContext(
                req_id=request.request_id, kv_transfer_params=request.kv_transfer_params
            )
            state = RequestOffloadState(
                req=request,
                layout=self.layout,
                hashes_per_block=self.hashes_per_block,
                req_context=ctx,
                offloading_context=self.manager.on_new_request(ctx),
            )
            self._request_states[request.request_id] = state
        return state

    # -----------------------------------------------------------------------------------------
    # Lookups
    # -----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` the request can load.

        Args:
            request: a waiting request, at a (re)start (no GPU block allocated yet).
            num_computed_tokens: tokens served by the GPU prefix cache (a multiple of every
                group's GPU block size).

        Returns:
            ``(n, True)``: ``n`` tokens are loadable, asynchronously. ``(0, False)``: nothing to
            load. ``(None, False)``: ask again next step (a block is not readable yet, or is
            being loaded for another request). With the load guard, ``n`` may be less than the
            hit: the part the guard found slower to load than to compute is left out.
        """
        state = self._get_or_create_state(request)
        result = self._match(state, num_computed_tokens)
        if result[0] is not None and state.guard_decided:
            state.guard_decided.clear()  # the wait is over: the next one is decided anew
        return result

    def _match(
        self, state: RequestOffloadState, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` for the request of ``state``."""
        state.num_locally_computed_tokens = num_computed_tokens
        state.next_stored_block_idx = 0
        state.expect_fresh_alloc = True
        self._deferred_store_reqs.discard(state.req.request_id)  # a restart offers all anew
        block_size = self.offloaded_block_size
        num_blocks = state.extend_offload_keys()
        if num_blocks * block_size - num_computed_tokens < block_size:
            return 0, False
        if self._jobs.awaiting_pre_reset_reports:
            # Workers may still touch rows the reset freed: a lookup could reserve such a row for
            # a promotion that a secondary tier starts writing at once. Compute instead.
            self._metrics.lookups_skipped_after_reset += 1
            return 0, False

        # Blocks served from the GPU prefix cache are used too: keep them warm in every tier (an
        # SWA group only the window's).
        layout = self.layout
        touched = [
            key
            for g, keys in enumerate(state.offload_keys)
            for key in keys[layout.touch_start(g, num_blocks) : num_blocks]
        ]
        self.manager.touch(touched, state.req_context)

        start = num_computed_tokens // block_size
        lookup = state.lookup_fn(self.manager, self._jobs.is_being_stored)
        lookup_prefix = state.lookup_prefix_fn(self.manager, self._jobs.is_being_stored)
        # With sliding-window groups the scans ask for more keys than the hit loads: probe
        # first and promote only what is loaded (groups.promoting_hit_end).
        probe = state.probe_fn(self.manager) if layout.has_sliding_window else None
        results: dict[OffloadKey, bool | None] | None = None
        if self.load_guard is not None:
            results = {}
            lookup = _recording(lookup, results)
            lookup_prefix = _recording_prefix(lookup_prefix, results)
            probe = None if probe is None else _recording(probe, results)
        if probe is None:
            end, deferred = lookup_hit_end(
                layout, lookup, lookup_prefix, state.offload_keys, start, num_blocks
            )
        else:
            end, deferred = promoting_hit_end(
                layout, probe, lookup, state.offload_keys, start, num_blocks
            )
        if results is not None and end > start:
            end, deferred = self._guard_hit(state, results, start, end, deferred)
        limit = end - start
        if deferred:
            self._count_deferral(state, state.waiting_on_lookup)
            return None, False
        if limit == 0:
            return 0, False
        num_hit_tokens = (start + limit) * block_size - num_computed_tokens
        if num_hit_tokens < block_size:
            return 0, False
        if self._jobs.any_being_loaded(self.layout.load_keys(state.offload_keys, start, end)):
            # A second request hitting keys being loaded waits for that load to finish.
            self._count_deferral(state, on_lookup=False)
            return None, False
        return num_hit_tokens, True

    def _count_deferral(self, state: RequestOffloadState, on_lookup: bool) -> None:
        """A lookup of ``state``'s request answers "ask again next step": count the lookup,
        and the request the first time for each reason: a tier could not answer yet
        (``on_lookup``), or the blocks were being moved (a promotion, a store or another
        request's load: part of loading them). With sliding-window groups a probe's "not yet"
        cannot tell the two apart (a slower tier holding a block answers so too); such a pass
        counts as waiting for a transfer unless one of its lookups met an unanswered tier."""
        m = self._metrics
        m.deferred_lookups += 1
        if on_lookup and not state.lookup_deferred:
            state.lookup_deferred = True
            m.deferred_lookup_requests += 1
        elif not on_lookup and not state.transfer_waited:
            state.transfer_waited = True
            m.transfer_wait_requests += 1

    def _hit_runs(
        self,
        state: RequestOffloadState,
        results: dict[OffloadKey, bool | None],
        start: int,
        end: int,
    ) -> list[tuple[str | None, int, int]]:
        """The hit ``[start, end)`` as runs ``(tier, first, end)`` of offloaded blocks by where
        they are: ``CPU_TIER`` (readable), a secondary tier's type (being promoted from it), or
        None (not readable, no tier known: a tier's answer on its way, or a store of ours)."""
        runs: list[tuple[str | None, int, int]] = []
        promoted = state.promoted_keys
        for i in range(start, end):
            where: str | None = CPU_TIER
            for keys in state.offload_keys:
                key = keys[i]
                if key in results and results[key] is None:
                    where = promoted.get(key)
                    break
            if runs and runs[-1][0] == where:
                runs[-1] = (where, runs[-1][1], i + 1)
            else:
                runs.append((where, i, i + 1))
        return runs

    def _guard_hit(
        self,
        state: RequestOffloadState,
        results: dict[OffloadKey, bool | None],
        start: int,
        end: int,
        deferred: bool,
    ) -> tuple[int, bool]:
        """The part of the hit ``[start, end)`` the load guard lets the request load, and
        whether that part must still be waited for.

        Each tier's part is decided once per wait (``state.guard_decided``), in order: the
        first part refused ends the hit there (a hit is a prefix: what follows it is computed
        too). A part whose tier is not known yet is not decided: the lookup waits for the
        tier's answer, as without the guard.
        """
        guard = self.load_guard
        assert guard is not None
        block_size = self.offloaded_block_size
        num_computed = state.num_locally_computed_tokens
        runs = self._hit_runs(state, results, start, end)
        cut = end
        for where, first, last in runs:
            if where is None:
                break
            if where in state.guard_decided:
                continue
            run_keys = tuple(self.layout.load_keys(state.offload_keys, first, last))
            num_tokens = last * block_size - max(first * block_size, num_computed)
            legs = (CPU_TIER,) if where == CPU_TIER else (where, CPU_TIER)
            if not guard.admit(where, legs, len(run_keys), num_tokens):
                cut = first
                break
            # A secondary tier's part includes its CPU -> GPU leg: decided with it.
            state.guard_decided.update(legs)
            if where != CPU_TIER:
                wait = guard.start_wait(where, len(run_keys), time.perf_counter())
                self._promotion_waits.append((wait, run_keys))
        if cut == end:
            return end, deferred
        # The refused part is computed: its promotions (queued by the lookup) still bring the
        # blocks to the CPU tier for later requests, but this one does not wait for them.
        for keys in state.offload_keys:
            for key in keys[cut:end]:
                state.promoted_keys.pop(key, None)
        still_deferred = any(where != CPU_TIER for where, first, _ in runs if first < cut)
        return cut, still_deferred

    # -----------------------------------------------------------------------------------------
    # Allocation
    # -----------------------------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: GroupBlockIds, num_external_tokens: int
    ) -> None:
        """Record the request's GPU blocks; create its load job if it loads.

        Args:
            request: the request just allocated.
            blocks: every GPU block the request holds now, per group.
            num_external_tokens: tokens to load, as returned by ``get_num_new_matched_tokens``
                (0 for none).

        Raises:
            ValueError: the call contradicts the connector's books (``_check_alloc``), or the
                manager refused the load (its ``prepare_load`` raised): nothing changed.
        """
        state = self._check_alloc(request.request_id, blocks, num_external_tokens)
        num_local = state.num_locally_computed_tokens
        block_size = self.offloaded_block_size
        end_tokens = num_local + num_external_tokens
        start, end = num_local // block_size, end_tokens // block_size
        old_block_ids, fresh = state.block_ids, state.expect_fresh_alloc
        num_allocated_before = len(self._current_batch_allocated_blocks)
        state.block_ids = []
        for g, group_blocks in enumerate(blocks):
            # After a restart the blocks past the local prefix are new; otherwise those past the
            # ones recorded (the engine may have freed SWA blocks: NULL_BLOCK_ID in their place).
            first_new = num_local // self.gpu_block_sizes[g] if fresh else len(old_block_ids[g])
            self._current_batch_allocated_blocks.extend((g, b) for b in group_blocks[first_new:])
            state.block_ids.append(list(group_blocks))
        state.expect_fresh_alloc = False
        if num_external_tokens == 0:
            return
        keys = self.layout.load_keys(state.offload_keys, start, end)
        gpu_indices = self.layout.load_gpu_indices(num_local, end_tokens)
        try:
            dst_spec, gpu_refs = state.gpu_spec(gpu_indices)
            src_spec = self.manager.prepare_load(keys, state.req_context)
        except Exception:
            # Refused (e.g. more tokens than the lookup found): undo the allocation's books.
            state.block_ids, state.expect_fresh_alloc = old_block_ids, fresh
            del self._current_batch_allocated_blocks[num_allocated_before:]
            raise

        job_id = self._jobs.add_load(request.request_id, keys, gpu_refs, (num_local, end_tokens))
        self._current_batch_load_jobs[job_id] = TransferJob(
            req_id=request.request_id, transfer_spec=TransferSpec(src_spec, dst_spec)
        )
        state.transfer_jobs.add(job_id)
        self._metrics.load_jobs += 1
        self._metrics.load_blocks += len(keys)
        if self.load_guard is not None:
            self._load_waits[job_id] = self.load_guard.start_wait(
                CPU_TIER, len(keys), time.perf_counter()
            )

        policy = state.offloading_context.policy
        remote_decode = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        if policy is OffloadPolicy.BLOCK_LEVEL and not remote_decode:
            # Loaded blocks are offloaded already: do not offer them to prepare_store again.
            state.next_stored_block_idx = end

    # -----------------------------------------------------------------------------------------
    # The step's metadata
    # -----------------------------------------------------------------------------------------

    def _update_req_states(self, scheduler_output: SchedulerOutput) -> set[JobId]:
        """Apply the step's block allocations and preemptions; return the preempted requests'
        jobs, to flush."""
        jobs_to_flush: set[JobId] = set()
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self._request_states[req_id]
            if self.layout.has_sliding_window:
                self.layout.skip_freed_blocks(state.block_ids, num_computed)
            if new_block_ids is None:
                continue
            for g, ids in enumerate(new_block_ids):
                state.block_ids[g].extend(ids)
                self._current_batch_allocated_blocks.extend((g, b) for b in ids)
        for req_id in scheduler_output.preempted_req_ids:
            preempted = self._request_states.get(req_id)
            if preempted is None:
                continue
            preempted.block_ids = [[] for _ in range(self.num_groups)]
            # Its GPU blocks are free already and may be rewritten in this very step.
            jobs_to_flush.update(preempted.transfer_jobs)
        return jobs_to_flush

    def _store_candidates(self, scheduler_output: SchedulerOutput) -> list[tuple[ReqId, int]]:
        """``(req_id, num_computed_tokens)`` of every request whose blocks may be offered now.

        The step's scheduled requests, then the deferred ones (their latest ``prepare_store``
        found no room) that were not scheduled but still run and hold blocks: under async
        scheduling a request's last step is scheduled before the completions that free the room
        arrive, so it is offered again even when not scheduled. Such a request's computed tokens
        (the engine's ``Request.num_computed_tokens``, checked by nothing this step) count only
        as far as its recorded GPU blocks hold them.
        """
        candidates: list[tuple[ReqId, int]] = [
            (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        candidates.extend(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id in self._deferred_store_reqs - scheduler_output.num_scheduled_tokens.keys():
            retry = self._request_states.get(req_id)
            if retry is not None and not retry.finished and any(retry.block_ids):
                num_computed = min(retry.req.num_computed_tokens, retry.num_tokens_in_blocks())
                candidates.append((req_id, num_computed))
        self._deferred_store_reqs.clear()
        return candidates

    def _build_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[JobId, TransferJob]:
        """Offer the step's requests' newly full blocks to ``prepare_store``; a store job per
        request with keys to store."""
        store_jobs: dict[JobId, TransferJob] = {}
        for req_id, num_computed in self._store_candidates(scheduler_output):
            state = self._request_states[req_id]
            start = state.next_stored_block_idx
            end = state.offloadable_end(
                num_computed,
                scheduler_output.num_scheduled_tokens.get(req_id, 0),
                self.offload_prompt_only,
            )
            if end <= start:
                continue
            keys = self.layout.store_keys(state.offload_keys, state.block_ids, start, end)
            output = self.manager.prepare_store(keys, state.req_context)
            if output is None:
                # Not enough evictable room now; these blocks are offered again next step.
                self._metrics.deferred_stores += 1
                self._deferred_store_reqs.add(req_id)
                continue
            state.next_stored_block_idx = end
            keys_to_store = output.keys_to_store
            if not keys_to_store:
                continue
            # _check_step refused scheduled requests with a load in flight; a deferred one is
            # undeferred by the lookup that precedes any load.
            assert all(self._jobs[j].is_store for j in state.transfer_jobs), f"{req_id}: a load"
            gpu_indices = state.store_gpu_indices(keys_to_store, start, end)
            src_spec, gpu_refs = state.gpu_spec(gpu_indices)
            job_id = self._jobs.add_store(req_id, keys_to_store, gpu_refs)
            if self.layout.has_sliding_window and any(
                gpu_indices[g] for g in self.layout.swa_groups
            ):
                # The engine frees SWA blocks while the request runs: fence them from the start
                # (the job's full-attention blocks cannot be reallocated before the request
                # finishes, so fencing them early costs nothing).
                self._jobs.fence([job_id])
            state.transfer_jobs.add(job_id)
            store_jobs[job_id] = TransferJob(
                req_id=req_id, transfer_spec=TransferSpec(src_spec, output.store_spec)
            )
            self._metrics.store_jobs += 1
            self._metrics.store_blocks += len(keys_to_store)
        return store_jobs

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadingConnectorMetadata:
        """Build the step's metadata and end the manager's step.

        Order: apply the step's allocations and preemptions, flush jobs of preempted requests,
        jobs left over by ``reset_cache`` and fenced jobs reading reallocated GPU blocks, build
        the store jobs (``prepare_store``), then ``manager.on_schedule_end()``, exactly once and
        as the last manager call.

        Raises:
            ValueError: the step's output contradicts the connector's books (``_check_step``);
                nothing changed.
        """
        self._check_step(scheduler_output)
        jobs_to_flush = self._update_req_states(scheduler_output)
        jobs_to_flush |= self._jobs.take_flushes(self._current_batch_allocated_blocks)
        self._metrics.flushed_jobs += len(jobs_to_flush)

        store_jobs = self._build_store_jobs(scheduler_output)
        metadata = OffloadingConnectorMetadata(
            load_jobs=self._current_batch_load_jobs,
            store_jobs=store_jobs,
            jobs_to_flush=jobs_to_flush,
        )
        self._current_batch_load_jobs = {}
        self._current_batch_allocated_blocks = []

        self._metrics.timed_schedule_end(self.manager.on_schedule_end)
        if self.load_guard is not None:
            now = time.perf_counter()
            if self._promotion_waits:
                self._end_promotion_waits(now)
            self.load_guard.on_step_start(now, scheduler_output.total_num_scheduled_tokens)
        return metadata

    def _end_promotion_waits(self, now: float) -> None:
        """End the guard's waits whose promotions the tiers reported (the step's poll of the
        tiers is done: ``on_schedule_end`` ran)."""
        guard = self.load_guard
        assert guard is not None
        source = self.manager.promotion_source
        pending = []
        for wait, keys in self._promotion_waits:
            if any(source(key) is not None for key in keys):
                pending.append((wait, keys))
            else:
                guard.end_wait(wait, now)
        self._promotion_waits = pending

    def on_step_end(self) -> None:
        """The engine step whose metadata was built last ended (the engine's ``observe_step``
        hook): the load guard's compute sample. Engines that never call it leave the guard
        without a compute estimate, so it loads every hit."""
        if self.load_guard is not None:
            self.load_guard.on_step_end(time.perf_counter())

    # -----------------------------------------------------------------------------------------
    # Completions
    # -----------------------------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Account the workers' reports; complete every job all workers have reported."""
        if connector_output.kv_connector_stats is not None:
            self.stats_collector.add_worker_stats(connector_output.kv_connector_stats)
        if connector_output.kv_connector_worker_meta is None:
            return
        meta = self._check_worker_meta(connector_output.kv_connector_worker_meta)
        self._metrics.record_transfers(meta.transfer_stats)
        reported = self._jobs.account_reports(meta.completed_jobs, meta.failed_jobs)
        self._metrics.stale_completions += reported.num_stale
        for job in reported.finished:
            self._finish_job(job)

    def _finish_job(self, job: TransferJobStatus) -> None:
        """Complete a job every worker reported (the table returns each exactly once): tell the
        manager with exactly the job's keys, count it, and keep a load's result."""
        state = self._request_states[job.req_id]
        metrics = self._metrics
        num_keys = len(job.keys)
        if job.is_store:
            self.manager.complete_store(job.keys, state.req_context, job.success)
            if not job.success:
                metrics.failed_store_jobs += 1
                metrics.failed_store_blocks += num_keys
            else:
                metrics.stored_blocks += num_keys
                if self.stored_keys is not None:
                    self.stored_keys.update(job.keys)
        else:
            self.manager.complete_load(job.keys, state.req_context)
            self._load_results.append(
                state.finish_load(job, self.stored_keys, self.spec.group_block_bytes)
            )
            wait = self._load_waits.pop(job.job_id, None)
            if wait is not None:
                assert self.load_guard is not None
                self.load_guard.end_wait(wait, time.perf_counter(), job.success)
            if not job.success:
                metrics.failed_load_jobs += 1
                metrics.failed_load_blocks += num_keys
            else:
                metrics.loaded_blocks += num_keys
        state.transfer_jobs.discard(job.job_id)
        if state.finished and not state.transfer_jobs:
            del self._request_states[job.req_id]

    def take_load_results(self) -> list[LoadResult]:
        """Return (and forget) the load jobs finished since the last call."""
        results, self._load_results = self._load_results, []
        return results

    # -----------------------------------------------------------------------------------------
    # Request end, events, reset
    # -----------------------------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: GroupBlockIds | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished (or was aborted); its GPU blocks are freed right after.

        Returns:
            ``(False, None)``: never delay freeing. The GPU blocks its store jobs still read are
            fenced instead (see the module docstring).

        Raises:
            ValueError: the request already finished (nothing changed).
        """
        state = self._check_finish(request.request_id)
        if state is None:
            # Finished before the connector saw it: open and close it for the manager.
            ctx = ReqContext(
                req_id=request.request_id, kv_transfer_params=request.kv_transfer_params
            )
            self.manager.on_new_request(ctx)
            self.manager.on_request_finished(ctx)
            return False, None
        state.finished = True
        self._jobs.fence(state.transfer_jobs)
        self.manager.on_request_finished(state.req_context)
        if not state.transfer_jobs:
            del self._request_states[request.request_id]
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Convert the manager's events to KV events. Only drains: no other effect."""
        return to_kv_events(self.manager.take_events(), self.offloaded_block_size)

    def reset_cache(self) -> None:
        """Drop everything offloaded; jobs in flight are flushed and their completions ignored.

        Must be called between steps. Every job in flight is flushed at the next step (before
        any new store can reuse the rows it touches), pre-reset job ids are ignored when they
        complete, active requests offer all their blocks again, and the manager is reset.

        Until every worker has reported every pre-reset job, ``get_num_new_matched_tokens``
        reports no hit without asking the manager: a lookup could start a promotion, and a
        secondary tier would write the promoted block into a row that a pre-reset GPU <-> CPU
        copy still reads or writes. Stores need no such gate: workers run a step's stores only
        after waiting for the flushed jobs.
        """
        self._check_reset()
        self._jobs.reset()
        for req_id in [r for r, s in self._request_states.items() if s.finished]:
            del self._request_states[req_id]
        self.manager.reset_cache()
        for state in self._request_states.values():
            state.next_stored_block_idx = 0
            state.transfer_jobs.clear()
            state.promoted_keys.clear()
            state.guard_decided.clear()
        self._load_waits.clear()
        self._promotion_waits.clear()
        if self.load_guard is not None:
            self.load_guard.reset()
        self._metrics.cache_resets += 1

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping: jobs in flight here (pre-reset ones included,
        so that their reports arrive) or in the manager."""
        return self._jobs.has_pending_work() or self.manager.has_pending_work()

    def get_stats(self) -> dict[str, int | float]:
        """Cumulative connector counters, transfer totals and the manager's stats (``manager.*``).

        Keys: the job/block counters (``load_jobs``, ``store_blocks``, ...; a block is one key,
        i.e. one offloaded block of one KV-cache group), ``jobs_in_flight``, ``schedule_ends``,
        and per transfer direction
        ``transfer.<SRC>_to_<DST>.{jobs,bytes,seconds}``, summed over worker ranks (a job run by
        two ranks counts twice; bytes are the total moved).
        """
        stats = self._metrics.as_dict(len(self._jobs), self.manager.get_stats())
        if self.load_guard is not None:
            stats.update(self.load_guard.summary())
        return stats

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """Stats since the last call, the workers' included (see ``stats_collector``)."""
        return self.stats_collector.collect(len(self._jobs))

    def shutdown(self) -> None:
        """Shut the manager down."""
        self.manager.shutdown()

    def tracks_request(self, req_id: ReqId) -> bool:
        """Whether a request with this id is tracked: live, or finished with jobs in flight.

        The engine refuses to reuse such an id: the new request's jobs would be confused with
        the old one's.
        """
        return req_id in self._request_states


def _recording(lookup: LookupFn, results: dict[OffloadKey, bool | None]) -> LookupFn:
    """``lookup``, keeping each key's answer in ``results`` (for the load guard)."""

    def lookup_key(key: OffloadKey) -> bool | None:
        result = results[key] = lookup(key)
        return result

    return lookup_key


def _recording_prefix(
    lookup_prefix: PrefixLookupFn, results: dict[OffloadKey, bool | None]
) -> PrefixLookupFn:
    """``lookup_prefix``, keeping each key's answer in ``results`` (for the load guard)."""

    def lookup_keys(keys: Sequence[OffloadKey]) -> list[bool | None]:
        answers = lookup_prefix(keys)
        results.update(zip(keys, answers, strict=False))
        return answers

    return lookup_keys
