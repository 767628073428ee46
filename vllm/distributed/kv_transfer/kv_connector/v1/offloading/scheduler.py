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

Block geometry: an *offloaded block* holds ``B = spec.offloaded_block_size`` tokens, i.e.
``factor[g] = B // gpu_block_size[g]`` GPU blocks of KV-cache group ``g``. The key of offloaded
block ``i`` in group ``g`` is ``make_offload_key(block_hashes[(i + 1) * B // h - 1], g)``, where
``h`` is the request's hash block size: the hash of the last hashed block it covers, which covers
the whole token prefix.

Protection of GPU blocks (fencing): ``request_finished`` always returns ``(False, None)``, so the
engine frees a finished request's GPU blocks at once, even while a store job still reads them.
When the request finishes, the GPU blocks of its pending store jobs enter a fence index; a block
of that index reallocated later puts the jobs reading it into ``jobs_to_flush``, and the workers
wait for them before the forward pass that overwrites the block. Preempted requests' store jobs
are flushed directly. Loads never enter the fence index: the engine keeps a loading request's
blocks until the load is reported, even if the request is aborted.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from typing_extensions import ParamSpec

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    JobId,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    ReqId,
    TransferJob,
    TransferSpec,
    TransferStats,
    TransferType,
)
from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_P = ParamSpec("_P")
_T = TypeVar("_T")

GPUBlockRef = tuple[int, int]
"""``(group_idx, gpu_block_id)``: a GPU block, unique across KV-cache groups."""


@dataclass(eq=False)
class RequestOffloadState:
    """What the connector tracks for one request, from first sight until it is dropped.

    A request's state is dropped once the request finished and none of its jobs is in flight.

    Attributes:
        req: the engine's request (read-only here).
        req_context: the one ``ReqContext`` used for all of the request's manager calls.
        offloading_context: the manager's policy for the request.
        offload_keys: per group, the keys of the request's full offloaded blocks (extended
            lazily as the request's block hashes grow).
        block_ids: per group, the GPU block ids the request holds, in logical order.
        next_stored_block_idx: offloaded blocks below this index were already offered to
            ``prepare_store`` (or were loaded, under BLOCK_LEVEL).
        num_locally_computed_tokens: tokens served by the GPU prefix cache at the latest
            (re)start of the request.
        expect_fresh_alloc: set by a lookup; the next ``update_state_after_alloc`` is a (re)start
            whose block list replaces the previous one.
        promoted_keys: keys whose lookup said "not readable yet" while no store job of this
            connector was writing them: they were being promoted from a secondary tier.
        transfer_jobs: ids of the request's jobs in flight.
        finished: ``request_finished`` was called.
    """

    req: Request
    req_context: ReqContext
    offloading_context: RequestOffloadingContext
    offload_keys: list[list[OffloadKey]]
    block_ids: list[list[int]]
    next_stored_block_idx: int = 0
    num_locally_computed_tokens: int = 0
    expect_fresh_alloc: bool = False
    promoted_keys: set[OffloadKey] = field(default_factory=set)
    transfer_jobs: set[JobId] = field(default_factory=set)
    finished: bool = False


@dataclass(eq=False)
class TransferJobStatus:
    """A job in flight, from creation until every worker reported it.

    Attributes:
        job_id: the job's id.
        req_id: the request the job belongs to.
        is_store: True for GPU -> offload, False for offload -> GPU.
        keys: exactly the keys the job moves; completed with exactly these.
        gpu_blocks: the GPU blocks the job reads (store) or writes (load).
        pending_count: workers that have not reported the job yet.
        num_failed: workers that reported the job as failed.
        fenced: whether ``gpu_blocks`` were entered into the fence index.
        token_range: for a load, the tokens ``[start, end)`` it fills.
    """

    job_id: JobId
    req_id: ReqId
    is_store: bool
    keys: list[OffloadKey]
    gpu_blocks: list[GPUBlockRef]
    pending_count: int
    num_failed: int = 0
    fenced: bool = False
    token_range: tuple[int, int] = (0, 0)


@dataclass
class LoadResult:
    """Outcome of a finished load job, as reported by ``update_connector_output``.

    Attributes:
        req_id: the request that loaded.
        num_blocks: offloaded blocks loaded (per group: keys // groups).
        num_tokens: tokens loaded.
        num_promoted_tokens: of those, tokens of blocks this request's lookups found being
            promoted from a secondary tier (rather than being stored by this connector).
        success: every worker loaded every block.
    """

    req_id: ReqId
    num_blocks: int
    num_tokens: int
    num_promoted_tokens: int
    success: bool


class OffloadingConnectorScheduler:
    """The scheduler-side half of the offloading connector (see the module docstring).

    Runs on the scheduler thread; no method blocks. Every call costs O(keys and blocks of the
    requests it concerns), never O(cache size).

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
        self.block_size_factors: tuple[int, ...] = tuple(
            self.offloaded_block_size // b for b in self.gpu_block_sizes
        )
        self.hash_block_size = hash_block_size or math.gcd(*self.gpu_block_sizes)
        if self.offloaded_block_size % self.hash_block_size:
            raise ValueError(
                f"hash_block_size={self.hash_block_size} must divide the offloaded block size "
                f"{self.offloaded_block_size}"
            )
        self.hashes_per_block = self.offloaded_block_size // self.hash_block_size
        self.num_workers: int = spec.run.world_size
        # Blocks holding generated tokens are stored too unless the config says otherwise.
        self.offload_prompt_only: bool = spec.config.offload_prompt_only

        self._req_status: dict[ReqId, RequestOffloadState] = {}
        self._jobs: dict[JobId, TransferJobStatus] = {}
        self._job_counter: JobId = 0
        # Completions of ids below this were issued before the last reset_cache: ignored.
        self._stale_job_threshold: JobId = 0
        # Jobs issued before a reset_cache that workers still run: job id -> reports still due.
        # Until they are all in, their rows may still be read or written by a worker, so no
        # lookup may start a promotion into a freshly reset primary tier (see reset_cache).
        self._unreported_pre_reset_jobs: dict[JobId, int] = {}
        # GPU block -> pending store jobs reading it (only blocks of finished requests).
        self._block_id_to_pending_jobs: dict[GPUBlockRef, set[JobId]] = {}
        # Keys some load job is filling right now; a second request hitting them waits.
        self._blocks_being_loaded: set[OffloadKey] = set()
        # Keys some store job of this connector is writing (to tell promotions apart).
        self._keys_being_stored: dict[OffloadKey, int] = {}

        # Per-step buffers, consumed by build_connector_meta.
        self._current_batch_load_jobs: dict[JobId, TransferJob] = {}
        self._current_batch_allocated_blocks: list[GPUBlockRef] = []
        # Jobs to flush at the next build_connector_meta (reset_cache puts them here).
        self._pending_jobs_to_flush: set[JobId] = set()

        # Results of update_connector_output, drained by take_load_results().
        self._load_results: list[LoadResult] = []

        # Statistics (cumulative).
        self._manager_seconds = 0.0
        self._num_schedule_ends = 0
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "load_jobs",
                "load_blocks",
                "failed_load_jobs",
                "failed_load_blocks",
                "store_jobs",
                "store_blocks",
                "failed_store_jobs",
                "failed_store_blocks",
                "flushed_jobs",
                "deferred_lookups",
                "deferred_stores",
                "stale_completions",
                "cache_resets",
                "lookups_skipped_after_reset",
            ),
            0,
        )
        self._transfer_stats: dict[TransferType, TransferStats] = {}

    # -----------------------------------------------------------------------------------------
    # Helpers
    # -----------------------------------------------------------------------------------------

    def _timed(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Call a manager method, adding its duration to the manager-time statistic."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self._manager_seconds += time.perf_counter() - start

    def _new_job_id(self) -> JobId:
        job_id = self._job_counter
        self._job_counter += 1
        return job_id

    def _get_or_create_state(self, request: Request) -> RequestOffloadState:
        state = self._req_status.get(request.request_id)
        if state is None:
            ctx = ReqContext(
                req_id=request.request_id, kv_transfer_params=request.kv_transfer_params
            )
            offloading_context = self._timed(self.manager.on_new_request, ctx)
            state = RequestOffloadState(
                req=request,
                req_context=ctx,
                offloading_context=offloading_context,
                offload_keys=[[] for _ in range(self.num_groups)],
                block_ids=[[] for _ in range(self.num_groups)],
            )
            self._req_status[request.request_id] = state
        return state

    def _update_offload_keys(self, state: RequestOffloadState) -> int:
        """Extend the request's keys to every full offloaded block; return their count."""
        hashes = state.req.block_hashes
        num_blocks = len(hashes) // self.hashes_per_block
        keys0 = state.offload_keys[0]
        if len(keys0) < num_blocks:
            step = self.hashes_per_block
            new_hashes = [hashes[(i + 1) * step - 1] for i in range(len(keys0), num_blocks)]
            for g, keys in enumerate(state.offload_keys):
                keys.extend(make_offload_key(h, g) for h in new_hashes)
        return num_blocks

    def _keys_of(self, state: RequestOffloadState, start: int, end: int) -> list[OffloadKey]:
        """Keys of offloaded blocks ``[start, end)`` of every group, group-major."""
        return [key for keys in state.offload_keys for key in keys[start:end]]

    def _gpu_spec(
        self, state: RequestOffloadState, blocks_per_group: Sequence[Sequence[int]]
    ) -> tuple[GPULoadStoreSpec, list[GPUBlockRef]]:
        """GPU spec for logical GPU block indices ``blocks_per_group[g]`` of each group.

        Within a group the indices must be increasing; ``block_indices[g]`` is the first one.
        """
        flat: list[int] = []
        refs: list[GPUBlockRef] = []
        sizes: list[int] = []
        firsts: list[int] = []
        for g, indices in enumerate(blocks_per_group):
            table = state.block_ids[g]
            assert not indices or indices[-1] < len(table), (
                f"request {state.req.request_id}: group {g} block index {indices[-1]} beyond its "
                f"{len(table)} GPU blocks"
            )
            ids = [table[i] for i in indices]
            flat.extend(ids)
            refs.extend((g, b) for b in ids)
            sizes.append(len(ids))
            firsts.append(indices[0] if indices else 0)
        return GPULoadStoreSpec(flat, sizes, firsts), refs

    def _flush(self, job_ids: Iterable[JobId], jobs_to_flush: set[JobId]) -> None:
        for job_id in job_ids:
            if job_id not in jobs_to_flush:
                jobs_to_flush.add(job_id)
                self._stats["flushed_jobs"] += 1

    # -----------------------------------------------------------------------------------------
    # Lookups
    # -----------------------------------------------------------------------------------------

    def _prefix_scan(
        self, state: RequestOffloadState, keys: Sequence[OffloadKey]
    ) -> tuple[int, bool]:
        """Look keys up in order until the first miss.

        Returns:
            ``(n, deferred)``: ``n`` keys before the first miss answered True or None, and whether
            any of them answered None (not readable yet). Scanning goes on past a None so that
            the manager starts promotions and probes for every key that could hit.
        """
        ctx = state.req_context
        lookup = self.manager.lookup
        deferred = False
        n = 0
        start = time.perf_counter()
        try:
            for key in keys:
                result = lookup(key, ctx)
                if result is False:
                    break
                if result is None:
                    deferred = True
                    if key not in self._keys_being_stored:
                        state.promoted_keys.add(key)
                n += 1
        finally:
            self._manager_seconds += time.perf_counter() - start
        return n, deferred

    def _maximal_prefix_lookup(
        self, state: RequestOffloadState, keys: Sequence[OffloadKey]
    ) -> int | None:
        """Number of leading keys readable now; None if a key before the first miss is not."""
        n, deferred = self._prefix_scan(state, keys)
        return None if deferred else n

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
            being loaded for another request).
        """
        state = self._get_or_create_state(request)
        state.num_locally_computed_tokens = num_computed_tokens
        state.next_stored_block_idx = 0
        state.expect_fresh_alloc = True
        block_size = self.offloaded_block_size
        num_blocks = self._update_offload_keys(state)
        if num_blocks * block_size - num_computed_tokens < block_size:
            return 0, False
        if self._unreported_pre_reset_jobs:
            # Workers may still touch rows the reset freed: a lookup could reserve such a row for
            # a promotion that a secondary tier starts writing at once. Compute instead.
            self._stats["lookups_skipped_after_reset"] += 1
            return 0, False

        # Blocks served from the GPU prefix cache are used too: keep them warm in every tier.
        self._timed(self.manager.touch, self._keys_of(state, 0, num_blocks), state.req_context)

        start = num_computed_tokens // block_size
        limit = num_blocks - start
        deferred = False
        for g in range(self.num_groups):
            n, group_deferred = self._prefix_scan(
                state, state.offload_keys[g][start : start + limit]
            )
            deferred |= group_deferred
            limit = n
        if deferred:
            self._stats["deferred_lookups"] += 1
            return None, False
        if limit == 0:
            return 0, False
        num_hit_tokens = (start + limit) * block_size - num_computed_tokens
        if num_hit_tokens < block_size:
            return 0, False
        if self._blocks_being_loaded and any(
            key in self._blocks_being_loaded for key in self._keys_of(state, start, start + limit)
        ):
            self._stats["deferred_lookups"] += 1
            return None, False
        return num_hit_tokens, True

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
        """
        state = self._req_status.get(request.request_id)
        assert state is not None, (
            f"update_state_after_alloc: request {request.request_id} was never looked up"
        )
        assert len(blocks) == self.num_groups, (
            f"request {request.request_id}: {len(blocks)} block groups, expected {self.num_groups}"
        )
        num_local = state.num_locally_computed_tokens
        for g, group_blocks in enumerate(blocks):
            if state.expect_fresh_alloc:
                first_new = num_local // self.gpu_block_sizes[g]
            else:
                first_new = len(state.block_ids[g])
                assert group_blocks[:first_new] == state.block_ids[g], (
                    f"request {request.request_id}: group {g} blocks changed without a restart"
                )
            self._current_batch_allocated_blocks.extend((g, b) for b in group_blocks[first_new:])
            state.block_ids[g] = list(group_blocks)
        fresh = state.expect_fresh_alloc
        state.expect_fresh_alloc = False
        if num_external_tokens == 0:
            return
        assert fresh, f"request {request.request_id}: a load without a lookup"

        block_size = self.offloaded_block_size
        end_tokens = num_local + num_external_tokens
        assert end_tokens % block_size == 0, (
            f"request {request.request_id}: load ends at token {end_tokens}, not on an offloaded "
            f"block boundary ({block_size})"
        )
        start, end = num_local // block_size, end_tokens // block_size
        keys = self._keys_of(state, start, end)
        gpu_indices = [
            list(range(num_local // bs, end_tokens // bs)) for bs in self.gpu_block_sizes
        ]
        dst_spec, gpu_refs = self._gpu_spec(state, gpu_indices)
        src_spec = self._timed(self.manager.prepare_load, keys, state.req_context)

        job_id = self._new_job_id()
        self._jobs[job_id] = TransferJobStatus(
            job_id=job_id,
            req_id=request.request_id,
            is_store=False,
            keys=keys,
            gpu_blocks=gpu_refs,
            pending_count=self.num_workers,
            token_range=(num_local, end_tokens),
        )
        self._current_batch_load_jobs[job_id] = TransferJob(
            req_id=request.request_id, transfer_spec=TransferSpec(src_spec, dst_spec)
        )
        state.transfer_jobs.add(job_id)
        for key in keys:
            assert key not in self._blocks_being_loaded, (
                f"key {key.hex()} is loaded twice at once (request {request.request_id})"
            )
            self._blocks_being_loaded.add(key)
        self._stats["load_jobs"] += 1
        self._stats["load_blocks"] += len(keys)

        policy = state.offloading_context.policy
        remote_decode = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        if policy is OffloadPolicy.BLOCK_LEVEL and not remote_decode:
            # Loaded blocks are offloaded already: do not offer them to prepare_store again.
            state.next_stored_block_idx = end

    # -----------------------------------------------------------------------------------------
    # The step's metadata
    # -----------------------------------------------------------------------------------------

    def _update_req_states(self, scheduler_output: SchedulerOutput) -> set[JobId]:
        """Apply the step's block allocations and preemptions; return jobs to flush."""
        jobs_to_flush: set[JobId] = set()
        for new_req in scheduler_output.scheduled_new_reqs:
            state = self._req_status.get(new_req.req_id)
            assert state is not None, f"scheduled request {new_req.req_id} was never looked up"
            assert all(
                list(ids) == state.block_ids[g] for g, ids in enumerate(new_req.block_ids)
            ), f"request {new_req.req_id}: scheduled blocks differ from the allocated ones"
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_block_ids is None:
                continue
            state = self._req_status[req_id]
            for g, ids in enumerate(new_block_ids):
                state.block_ids[g].extend(ids)
                self._current_batch_allocated_blocks.extend((g, b) for b in ids)
        for req_id in scheduler_output.preempted_req_ids:
            preempted = self._req_status.get(req_id)
            if preempted is None:
                continue
            preempted.block_ids = [[] for _ in range(self.num_groups)]
            for job_id in preempted.transfer_jobs:
                assert self._jobs[job_id].is_store, (
                    f"preempted request {req_id} has load job {job_id} in flight"
                )
            # Its GPU blocks are free already and may be rewritten in this very step.
            self._flush(preempted.transfer_jobs, jobs_to_flush)
        return jobs_to_flush

    def _build_store_jobs(self, scheduler_output: SchedulerOutput) -> dict[JobId, TransferJob]:
        store_jobs: dict[JobId, TransferJob] = {}
        block_size = self.offloaded_block_size
        scheduled: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled.extend(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, num_computed in scheduled:
            state = self._req_status[req_id]
            req = state.req
            num_offloadable = min(
                num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0),
                req.num_tokens,
            )
            if self.offload_prompt_only:
                num_offloadable = min(num_offloadable, req.num_prompt_tokens)
            start = state.next_stored_block_idx
            end = min(num_offloadable // block_size, self._update_offload_keys(state))
            if end <= start:
                continue
            keys = self._keys_of(state, start, end)
            output = self._timed(self.manager.prepare_store, keys, state.req_context)
            if output is None:
                # Not enough evictable room now; these blocks are offered again next step.
                self._stats["deferred_stores"] += 1
                continue
            state.next_stored_block_idx = end
            keys_to_store = output.keys_to_store
            if not keys_to_store:
                continue
            for job_id in state.transfer_jobs:
                assert self._jobs[job_id].is_store, (
                    f"request {req_id}: a store can only be issued when no load is pending "
                    f"(load job {job_id})"
                )
            # Position of each requested key: (group, offloaded block index).
            position = {
                key: (g, i)
                for g, group_keys in enumerate(state.offload_keys)
                for i, key in enumerate(group_keys[start:end], start)
            }
            gpu_indices: list[list[int]] = [[] for _ in range(self.num_groups)]
            last_group = 0
            for key in keys_to_store:
                g, i = position[key]
                assert g >= last_group, (
                    f"request {req_id}: prepare_store returned keys out of group order "
                    f"(key {key.hex()} of group {g} after group {last_group})"
                )
                last_group = g
                factor = self.block_size_factors[g]
                gpu_indices[g].extend(range(i * factor, (i + 1) * factor))
            src_spec, gpu_refs = self._gpu_spec(state, gpu_indices)
            job_id = self._new_job_id()
            self._jobs[job_id] = TransferJobStatus(
                job_id=job_id,
                req_id=req_id,
                is_store=True,
                keys=list(keys_to_store),
                gpu_blocks=gpu_refs,
                pending_count=self.num_workers,
            )
            for key in keys_to_store:
                self._keys_being_stored[key] = self._keys_being_stored.get(key, 0) + 1
            state.transfer_jobs.add(job_id)
            store_jobs[job_id] = TransferJob(
                req_id=req_id, transfer_spec=TransferSpec(src_spec, output.store_spec)
            )
            self._stats["store_jobs"] += 1
            self._stats["store_blocks"] += len(keys_to_store)
        return store_jobs

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadingConnectorMetadata:
        """Build the step's metadata and end the manager's step.

        Order: apply the step's allocations and preemptions, flush jobs of preempted requests
        and jobs reading reallocated GPU blocks, build the store jobs (``prepare_store``), then
        ``manager.on_schedule_end()``, exactly once and as the last manager call.
        """
        jobs_to_flush = self._update_req_states(scheduler_output)
        self._flush(self._pending_jobs_to_flush, jobs_to_flush)
        self._pending_jobs_to_flush = set()

        fence = self._block_id_to_pending_jobs
        if fence:
            for ref in self._current_batch_allocated_blocks:
                pending = fence.get(ref)
                if pending:
                    self._flush(pending, jobs_to_flush)

        store_jobs = self._build_store_jobs(scheduler_output)
        metadata = OffloadingConnectorMetadata(
            load_jobs=self._current_batch_load_jobs,
            store_jobs=store_jobs,
            jobs_to_flush=jobs_to_flush,
        )
        self._current_batch_load_jobs = {}
        self._current_batch_allocated_blocks = []

        self._timed(self.manager.on_schedule_end)
        self._num_schedule_ends += 1
        return metadata

    # -----------------------------------------------------------------------------------------
    # Completions
    # -----------------------------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Account the workers' reports; complete every job all workers have reported."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        assert isinstance(meta, OffloadingWorkerMetadata), (
            f"unexpected worker metadata {type(meta).__name__}"
        )
        for transfer_type, stats in meta.transfer_stats.items():
            self._transfer_stats[transfer_type] = (
                self._transfer_stats.get(transfer_type, TransferStats()) + stats
            )
        for job_id in sorted(meta.completed_jobs.keys() | meta.failed_jobs.keys()):
            if job_id < self._stale_job_threshold:
                self._stats["stale_completions"] += 1
                due = self._unreported_pre_reset_jobs.get(job_id)
                if due is not None:
                    due -= meta.completed_jobs.get(job_id, 0) + meta.failed_jobs.get(job_id, 0)
                    if due > 0:
                        self._unreported_pre_reset_jobs[job_id] = due
                    else:
                        del self._unreported_pre_reset_jobs[job_id]
                continue
            job = self._jobs.get(job_id)
            assert job is not None, f"workers reported unknown job {job_id}"
            num_ok = meta.completed_jobs.get(job_id, 0)
            num_failed = meta.failed_jobs.get(job_id, 0)
            job.pending_count -= num_ok + num_failed
            job.num_failed += num_failed
            assert job.pending_count >= 0, (
                f"job {job_id} reported by more than {self.num_workers} workers"
            )
            if job.pending_count == 0:
                self._finish_job(job)

    def _finish_job(self, job: TransferJobStatus) -> None:
        state = self._req_status[job.req_id]
        success = job.num_failed == 0
        if job.is_store:
            self._timed(self.manager.complete_store, job.keys, state.req_context, success)
            being_stored = self._keys_being_stored
            for key in job.keys:
                count = being_stored[key] - 1
                if count:
                    being_stored[key] = count
                else:
                    del being_stored[key]
            if not success:
                self._stats["failed_store_jobs"] += 1
                self._stats["failed_store_blocks"] += len(job.keys)
        else:
            self._timed(self.manager.complete_load, job.keys, state.req_context)
            self._blocks_being_loaded.difference_update(job.keys)
            self._load_results.append(self._load_result(job, state, success))
            state.promoted_keys.clear()
            if not success:
                self._stats["failed_load_jobs"] += 1
                self._stats["failed_load_blocks"] += len(job.keys)
        if job.fenced:
            fence = self._block_id_to_pending_jobs
            for ref in job.gpu_blocks:
                pending = fence.get(ref)
                if pending is not None:
                    pending.discard(job.job_id)
                    if not pending:
                        del fence[ref]
        state.transfer_jobs.discard(job.job_id)
        del self._jobs[job.job_id]
        if state.finished and not state.transfer_jobs:
            del self._req_status[job.req_id]

    def _load_result(
        self, job: TransferJobStatus, state: RequestOffloadState, success: bool
    ) -> LoadResult:
        block_size = self.offloaded_block_size
        start_tok, end_tok = job.token_range
        first = start_tok // block_size
        num_blocks = len(job.keys) // self.num_groups
        promoted = state.promoted_keys
        promoted_tokens = 0
        for j in range(num_blocks):
            if any(job.keys[g * num_blocks + j] in promoted for g in range(self.num_groups)):
                i = first + j
                promoted_tokens += min((i + 1) * block_size, end_tok) - max(
                    i * block_size, start_tok
                )
        return LoadResult(job.req_id, num_blocks, end_tok - start_tok, promoted_tokens, success)

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
        """
        state = self._req_status.get(request.request_id)
        if state is None:
            # Finished before the connector saw it: open and close it for the manager.
            ctx = ReqContext(
                req_id=request.request_id, kv_transfer_params=request.kv_transfer_params
            )
            self._timed(self.manager.on_new_request, ctx)
            self._timed(self.manager.on_request_finished, ctx)
            return False, None
        assert not state.finished, f"request {request.request_id} finished twice"
        state.finished = True
        fence = self._block_id_to_pending_jobs
        for job_id in state.transfer_jobs:
            job = self._jobs[job_id]
            if job.is_store and not job.fenced:
                job.fenced = True
                for ref in job.gpu_blocks:
                    fence.setdefault(ref, set()).add(job_id)
        self._timed(self.manager.on_request_finished, state.req_context)
        if not state.transfer_jobs:
            del self._req_status[request.request_id]
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Convert the manager's events to KV events. Only drains: no other effect."""
        events: list[KVCacheEvent] = []
        for event in self.manager.take_events():
            by_group: dict[int, list[bytes]] = {}
            for key in event.keys:
                by_group.setdefault(get_offload_group_idx(key), []).append(
                    get_offload_block_hash(key)
                )
            for group_idx, hashes in by_group.items():
                if event.removed:
                    events.append(
                        BlockRemoved(block_hashes=hashes, medium=event.medium, group_idx=group_idx)
                    )
                else:
                    events.append(
                        BlockStored(
                            block_hashes=hashes,
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=self.offloaded_block_size,
                            lora_id=None,
                            medium=event.medium,
                            group_idx=group_idx,
                        )
                    )
        return events

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
        assert not self._current_batch_load_jobs and not self._current_batch_allocated_blocks, (
            "reset_cache called in the middle of a step"
        )
        self._pending_jobs_to_flush.update(self._jobs)
        for job_id, job in self._jobs.items():
            self._unreported_pre_reset_jobs[job_id] = job.pending_count
        for req_id in [r for r, s in self._req_status.items() if s.finished]:
            del self._req_status[req_id]
        self._timed(self.manager.reset_cache)
        for state in self._req_status.values():
            state.next_stored_block_idx = 0
            state.transfer_jobs.clear()
            state.promoted_keys.clear()
        self._stale_job_threshold = self._job_counter
        self._jobs.clear()
        self._block_id_to_pending_jobs.clear()
        self._blocks_being_loaded.clear()
        self._keys_being_stored.clear()
        self._stats["cache_resets"] += 1

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping: jobs in flight here (pre-reset ones included,
        so that their reports arrive) or in the manager."""
        return (
            bool(self._jobs or self._pending_jobs_to_flush or self._unreported_pre_reset_jobs)
            or self.manager.has_pending_work()
        )

    def get_stats(self) -> dict[str, int | float]:
        """Cumulative connector counters, transfer totals and the manager's stats (``manager.*``).

        Keys: the job/block counters (``load_jobs``, ``store_blocks``, ...; a block is one key,
        i.e. one offloaded block of one KV-cache group), ``jobs_in_flight``, ``schedule_ends``,
        ``manager_seconds`` (time spent inside manager calls), and per transfer direction
        ``transfer.<SRC>_to_<DST>.{jobs,bytes,seconds}``, summed over worker ranks (a job run by
        two ranks counts twice; bytes are the total moved).
        """
        stats: dict[str, int | float] = dict(self._stats)
        stats["jobs_in_flight"] = len(self._jobs)
        stats["schedule_ends"] = self._num_schedule_ends
        stats["manager_seconds"] = self._manager_seconds
        for (src, dst), t in self._transfer_stats.items():
            prefix = f"transfer.{src}_to_{dst}"
            stats[f"{prefix}.jobs"] = t.num_jobs
            stats[f"{prefix}.bytes"] = t.num_bytes
            stats[f"{prefix}.seconds"] = t.seconds
        manager_stats = self.manager.get_stats()
        if manager_stats:
            for key, value in manager_stats.items():
                stats[f"manager.{key}"] = value
        return stats

    def shutdown(self) -> None:
        """Shut the manager down."""
        self.manager.shutdown()

    # -----------------------------------------------------------------------------------------
    # Introspection (tests, CLI)
    # -----------------------------------------------------------------------------------------

    @property
    def manager_seconds(self) -> float:
        """Seconds spent inside manager calls so far (cumulative)."""
        return self._manager_seconds

    def num_jobs_in_flight(self) -> int:
        """Jobs created and not yet reported by every worker."""
        return len(self._jobs)

    def request_state(self, req_id: ReqId) -> RequestOffloadState | None:
        """The tracked state of a request, if any (read-only use)."""
        return self._req_status.get(req_id)

    def jobs_of(self, req_id: ReqId) -> Collection[JobId]:
        """Ids of the request's jobs in flight."""
        state = self._req_status.get(req_id)
        return frozenset(state.transfer_jobs) if state is not None else frozenset()
