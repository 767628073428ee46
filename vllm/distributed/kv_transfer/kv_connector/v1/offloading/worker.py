# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingConnectorWorker``: the worker-side half of the offloading connector.

Per engine step, on every worker rank::

    handle_preemptions(meta)   submit every deferred store, then wait for ``jobs_to_flush``
    start_load_kv(meta)        submit the previous step's deferred stores, then this step's loads
    <model forward>
    wait_for_save(meta)        defer this step's stores to the start of the next step, so that
                               offloading never delays this step's sampling
    get_finished()             poll the handlers; report finished loads by request
    build_connector_worker_meta()   {job_id: 1} per finished job, and transfer totals
    get_kv_connector_stats()        per-job transfer stats since the last call (for monitoring)

A store job reads GPU blocks that the forward pass of the step that created it has just
written; deferring its submission to the next step keeps it off the critical path. Waiting for
``jobs_to_flush`` before the forward pass is what makes reusing those GPU blocks safe.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    JobId,
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    ReqId,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    record_worker_transfer,
)
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.spec import OffloadingSpec, WorkerHandlers
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingWorker

logger = init_logger(__name__)


class OffloadingConnectorWorker:
    """The worker-side half of the offloading connector (see the module docstring).

    The handlers come from the spec (``OffloadingSpec.get_handlers``), built when the rank's KV
    caches are registered; this half names no offload medium, it only routes each job to the
    handler registered for its ``(src, dst)`` media. It owns the handlers from then on: ``shutdown``
    shuts them down and then releases what they were built on (``WorkerHandlers.close``).

    Args:
        spec: the offloading spec (the same configuration as the scheduler side).
        rank: this worker's rank in ``[0, spec.run.world_size)``.
    """

    def __init__(
        self,
        spec: OffloadingSpec,
        rank: int = 0,
    ) -> None:
        if not 0 <= rank < spec.run.world_size:
            raise ValueError(f"rank={rank} is outside [0, {spec.run.world_size})")
        self.spec = spec
        self.rank = rank
        self.worker = OffloadingWorker()
        self._handlers: WorkerHandlers | None = None
        # Loads in flight: job id -> (request, GPU blocks it writes, per group).
        self._load_jobs: dict[JobId, tuple[ReqId, dict[int, list[int]]]] = {}
        # Stores of the previous step, submitted at the start of this one.
        self._unsubmitted_store_jobs: list[tuple[JobId, TransferJob]] = []
        self._worker_meta = OffloadingWorkerMetadata()
        self._load_errors: dict[int, set[int]] = {}
        # Per-job transfer stats, handed out by get_kv_connector_stats().
        self._stats = OffloadingConnectorStats()

    # -----------------------------------------------------------------------------------------
    # Registration
    # -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        """Build the transfer handlers over this rank's canonical KV caches (``spec.get_handlers``)
        and register them.

        Raises:
            ValueError: two registrations serve the same pair of media; every handler is then
                shut down and ``close``d before the error propagates.
            Whatever ``spec.get_handlers`` raises (it released its own resources).
        """
        assert self._handlers is None, "KV caches are already registered"
        handlers = self.spec.get_handlers(kv_caches, self.rank)
        try:
            for src_cls, dst_cls, handler in handlers.registrations:
                self.worker.register_handler(src_cls, dst_cls, handler)
        except BaseException:
            # No job was submitted yet: shut each handler down once, then release the rest.
            self.worker = OffloadingWorker()
            for handler in {id(h): h for _, _, h in handlers.registrations}.values():
                handler.shutdown()
            handlers.registrations.clear()
            handlers.close()
            raise
        self._handlers = handlers

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
                if result.success:
                    record_worker_transfer(
                        self._stats,
                        result.transfer_type,
                        result.transfer_size or 0,
                        result.transfer_time or 0.0,
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

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """The transfers finished since the last call (one histogram sample per job), or None;
        the engine puts them into ``KVConnectorOutput.kv_connector_stats``."""
        if self._stats.is_empty():
            return None
        return self._stats.clone_and_reset()

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
