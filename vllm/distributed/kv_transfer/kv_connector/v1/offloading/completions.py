# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Completing a transfer job every worker reported: the manager call and the counters.

Used by ``OffloadingConnectorScheduler.update_connector_output``; the table of jobs in flight
(``jobs.TransferJobTable``) returns each finished job exactly once.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import LoadResult
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.jobs import TransferJobStatus
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingSchedulerMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.request_state import (
    RequestOffloadState,
)
from vllm.v1.kv_offload.base import OffloadingManager, OffloadKey

__all__ = ["complete_job"]


def complete_job(
    job: TransferJobStatus,
    state: RequestOffloadState,
    manager: OffloadingManager,
    metrics: OffloadingSchedulerMetrics,
    offloaded_block_size: int,
    stored_keys: set[OffloadKey] | None,
) -> LoadResult | None:
    """Tell the manager a job finished and count it; return a load job's result.

    A successful store's keys are added to ``stored_keys`` when it is tracked (not None). The
    job is removed from ``state.transfer_jobs``.
    """
    success = job.success
    result: LoadResult | None = None
    if job.is_store:
        metrics.timed(manager.complete_store, job.keys, state.req_context, success)
        if success and stored_keys is not None:
            stored_keys.update(job.keys)
        if not success:
            metrics.failed_store_jobs += 1
            metrics.failed_store_blocks += len(job.keys)
        else:
            metrics.stored_blocks += len(job.keys)
    else:
        metrics.timed(manager.complete_load, job.keys, state.req_context)
        result = state.finish_load(job, offloaded_block_size, stored_keys)
        if not success:
            metrics.failed_load_jobs += 1
            metrics.failed_load_blocks += len(job.keys)
        else:
            metrics.loaded_blocks += len(job.keys)
    state.transfer_jobs.discard(job.job_id)
    return result
