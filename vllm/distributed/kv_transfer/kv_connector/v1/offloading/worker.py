"""``OffloadingConnectorWorker``: the worker-side half of the offloading connector.

Per engine step, on every worker rank::

    handle_preemptions(meta)   submit every deferred store, then wait for ``jobs_to_flush``
    start_load_kv(meta)        submit the previous step's deferred stores, then this step's loads
    <model forward>
    wait_for_save(meta)        defer this step's stores to the start of the next step, so that
                               offloading never delays this step's sampling
    get_finished()             poll the handlers; report finished loads by request
    build_connector_worker_meta()   {job_id: 1} per finished job, and transfer totals

A store job reads GPU blocks that the forward pass of the step that created it has just
written; deferring its submission to the next step keeps it off the critical path. Waiting for
``jobs_to_flush`` before the forward pass is what makes reusing those GPU blocks safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    JobId,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    ReqId,
    TransferJob,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CpuGpuOffloadingHandlers
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.spec import OffloadingSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, OffloadingWorker

logger = logging.getLogger(__name__)

HandlerRegistration = tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]
"""``(src spec class, dst spec class, handler)``: a handler for one direction."""


def _no_op() -> None:
    pass


@dataclass
class WorkerHandlers:
    """A rank's transfer handlers and how to release what they were built on.

    Attributes:
        registrations: the handlers, one per ``(src spec class, dst spec class)``.
        close: called once at shutdown, after every handler is shut down (e.g. to clean up the
            shared host region the handlers copied through).
    """

    registrations: list[HandlerRegistration]
    close: Callable[[], None] = field(default=_no_op)


HandlerFactory = Callable[[OffloadingSpec, CanonicalKVCaches, int], WorkerHandlers]
"""Builds a rank's handlers from the spec, its canonical KV caches and its rank."""


class OffloadingConnectorWorker:
    """The worker-side half of the offloading connector (see the module docstring).

    Args:
        spec: the offloading spec (the same configuration as the scheduler side).
        rank: this worker's rank in ``[0, spec.run.world_size)``.
        handler_factory: builds the handlers once the KV caches are registered. Default:
            ``default_cpu_handlers``, the CPU tier's GPU <-> CPU handlers over this rank's slice
            of the shared host region.
    """

    def __init__(
        self,
        spec: OffloadingSpec,
        rank: int = 0,
        handler_factory: HandlerFactory | None = None,
    ) -> None:
        if not 0 <= rank < spec.run.world_size:
            raise ValueError(f"rank={rank} is outside [0, {spec.run.world_size})")
        self.spec = spec
        self.rank = rank
        self._handler_factory = handler_factory or default_cpu_handlers
        self.worker = OffloadingWorker()
        self._handlers: WorkerHandlers | None = None
        # Loads in flight: job id -> (request, GPU blocks it writes, per group).
        self._load_jobs: dict[JobId, tuple[ReqId, dict[int, list[int]]]] = {}
        # Stores of the previous step, submitted at the start of this one.
        self._unsubmitted_store_jobs: list[tuple[JobId, TransferJob]] = []
        self._worker_meta = OffloadingWorkerMetadata()
        self._load_errors: dict[int, set[int]] = {}

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        """Build and register the transfer handlers over this rank's canonical KV caches."""
        assert self._handlers is None, "KV caches are already registered"
        handlers = self._handler_factory(self.spec, kv_caches, self.rank)
        self._handlers = handlers
        for src_cls, dst_cls, handler in handlers.registrations:
            self.worker.register_handler(src_cls, dst_cls, handler)

    # -----------------------------------------------------------------------------------------
    # Per-step hooks
    # -----------------------------------------------------------------------------------------

    def _submit(self, job_id: JobId, job: TransferJob) -> None:
        if not self.worker.transfer_async(job_id, job.transfer_spec):
            # Reported as failed by the next get_finished (OffloadingWorker queues it).
            logger.warning(
                "rank %d: job %d of request %s was not accepted", self.rank, job_id, job.req_id
            )

    def _submit_deferred_stores(self) -> None:
        jobs, self._unsubmitted_store_jobs = self._unsubmitted_store_jobs, []
        for job_id, job in jobs:
            self._submit(job_id, job)

    def handle_preemptions(self, metadata: OffloadingConnectorMetadata) -> None:
        """Before the forward pass: make the GPU blocks of ``jobs_to_flush`` safe to overwrite.

        Stores of this step that must be flushed are submitted now rather than deferred; then
        every deferred store is submitted and the flushed jobs are waited for.
        """
        flush = metadata.jobs_to_flush
        if not flush:
            return
        for job_id in sorted(flush & metadata.store_jobs.keys()):
            self._unsubmitted_store_jobs.append((job_id, metadata.store_jobs[job_id]))
        self._submit_deferred_stores()
        self.worker.wait(flush)

    def start_load_kv(self, metadata: OffloadingConnectorMetadata) -> None:
        """Submit the previous step's stores, then this step's loads."""
        self._submit_deferred_stores()
        for job_id, job in metadata.load_jobs.items():
            dst = job.transfer_spec[1]
            assert isinstance(dst, GPULoadStoreSpec), f"load job {job_id} does not write GPU blocks"
            self._load_jobs[job_id] = (job.req_id, _blocks_by_group(dst))
            self._submit(job_id, job)

    def wait_for_save(self, metadata: OffloadingConnectorMetadata) -> None:
        """Defer this step's stores to the start of the next step (after sampling)."""
        flushed = metadata.jobs_to_flush
        for job_id, job in metadata.store_jobs.items():
            if job_id not in flushed:
                self._unsubmitted_store_jobs.append((job_id, job))

    def get_finished(self, finished_req_ids: Iterable[ReqId] = ()) -> tuple[set[ReqId], set[ReqId]]:
        """Poll the handlers.

        Returns:
            ``(finished_sending, finished_recving)``: stores never delay block freeing, so the
            first set is always empty; the second holds the requests whose load job finished on
            this rank (successfully or not; see ``get_block_ids_with_load_errors``).
        """
        finished_recving: set[ReqId] = set()
        for result in self.worker.get_finished():
            self._worker_meta.mark_finished(result.job_id, result.success)
            if result.transfer_type is not None:
                self._worker_meta.record_transfer(
                    result.transfer_type,
                    result.transfer_size if result.success else 0,
                    result.transfer_time if result.success else 0.0,
                )
            load = self._load_jobs.pop(result.job_id, None)
            if load is None:
                continue
            req_id, blocks = load
            finished_recving.add(req_id)
            if not result.success:
                logger.warning(
                    "rank %d: load job %d of request %s failed", self.rank, result.job_id, req_id
                )
                for group, ids in blocks.items():
                    self._load_errors.setdefault(group, set()).update(ids)
        return set(), finished_recving

    def get_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """GPU block ids (per group) of loads that failed since the last call; they must be
        recomputed. Draining."""
        errors, self._load_errors = self._load_errors, {}
        return errors

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        """This step's report (job completions, transfer totals), or None if nothing finished."""
        meta = self._worker_meta
        if not (meta.completed_jobs or meta.failed_jobs or meta.transfer_stats):
            return None
        self._worker_meta = OffloadingWorkerMetadata()
        return meta

    def has_jobs_in_flight(self) -> bool:
        """Whether jobs were submitted or deferred and not reported yet."""
        return bool(self._unsubmitted_store_jobs or self._load_jobs)

    def shutdown(self) -> None:
        """Shut the handlers down (they wait for transfers in flight), then release their
        resources; idempotent."""
        self.worker.shutdown()
        # Drop every reference to the handlers (and the host views they hold) before close()
        # releases the memory they copy through.
        self.worker = OffloadingWorker()
        handlers, self._handlers = self._handlers, None
        if handlers is not None:
            handlers.registrations.clear()
            handlers.close()


def _blocks_by_group(spec: GPULoadStoreSpec) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    start = 0
    ids = spec.block_ids.tolist()
    for group, size in enumerate(spec.group_sizes):
        if size:
            out[group] = ids[start : start + size]
        start += size
    return out


def default_cpu_handlers(
    spec: OffloadingSpec, kv_caches: CanonicalKVCaches, rank: int
) -> WorkerHandlers:
    """The CPU tier's handlers over this rank's slice of the shared host region.

    The rank joins (or creates, if it comes first) the engine instance's region named after
    ``spec.run.instance_id``, takes one view per canonical tensor from its slot of every row, and
    serves ``GPU -> CPU`` (stores) and ``CPU -> GPU`` (loads). ``close`` cleans the region up
    after the handlers are shut down.
    """
    region = SharedOffloadRegion(
        instance_id=spec.run.instance_id,
        num_blocks=spec.num_primary_blocks,
        worker_page_bytes=spec.worker_page_bytes,
        num_workers=spec.run.world_size,
        rank=rank,
        directory=spec.config.shared_region_dir,
        join_timeout_s=spec.config.shared_region_join_timeout_s,
        expect_scheduler=spec.SCHEDULER_MAPS_REGION,
    )
    try:
        cpu_gpu = CpuGpuOffloadingHandlers(kv_caches, spec.block_size_factors, region=region)
    except BaseException:
        region.cleanup()
        raise

    registrations: list[HandlerRegistration] = [
        (GPULoadStoreSpec, CPULoadStoreSpec, cpu_gpu.gpu_to_cpu_handler),
        (CPULoadStoreSpec, GPULoadStoreSpec, cpu_gpu.cpu_to_gpu_handler),
    ]
    owned = [cpu_gpu]

    def close() -> None:
        while owned:
            owned.pop().shutdown()
        region.cleanup()

    return WorkerHandlers(registrations=registrations, close=close)
