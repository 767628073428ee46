# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Metadata exchanged between the two halves of the offloading connector.

Job ids are assigned by the scheduler side (one counter shared by loads and stores, increasing
monotonically) and are the only handle the two halves share for a transfer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from typing_extensions import Self, override

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_offload.worker.worker import TransferSpec, TransferType

ReqId = str
JobId = int

__all__ = [
    "JobId",
    "OffloadingConnectorMetadata",
    "OffloadingWorkerMetadata",
    "ReqId",
    "TransferJob",
    "TransferSpec",
    "TransferStats",
    "TransferType",
]


@dataclass(frozen=True)
class TransferJob:
    """One transfer the workers must run.

    Attributes:
        req_id: the request on whose behalf the job runs.
        transfer_spec: ``(src_spec, dst_spec)``. For a store ``src`` is a ``GPULoadStoreSpec`` and
            ``dst`` the manager's spec; for a load the reverse. Blocks pair up in order within
            each KV-cache group.
    """

    req_id: ReqId
    transfer_spec: TransferSpec


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker metadata of one step.

    Attributes:
        load_jobs: loads to start this step (before the forward pass), by job id.
        store_jobs: stores of blocks this step completes; workers submit them at the start of the
            next step so they never delay this step's sampling.
        jobs_to_flush: jobs the workers must finish before this step's forward pass, because
            GPU blocks they read are about to be overwritten (preemption, block reuse) or the
            CPU rows they touch are about to be reused (reset).
    """

    load_jobs: dict[JobId, TransferJob] = field(default_factory=dict)
    store_jobs: dict[JobId, TransferJob] = field(default_factory=dict)
    jobs_to_flush: set[JobId] = field(default_factory=set)


@dataclass(frozen=True)
class TransferStats:
    """Totals of the transfers of one direction: finished jobs, bytes moved, seconds spent."""

    num_jobs: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def __add__(self, other: TransferStats) -> TransferStats:
        return TransferStats(
            self.num_jobs + other.num_jobs,
            self.num_bytes + other.num_bytes,
            self.seconds + other.seconds,
        )


@dataclass
class OffloadingWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler metadata of one step.

    Each rank reports a count of 1 per job it finished; ``aggregate`` sums the counts over ranks,
    so a job is finished once ``completed + failed == num_workers``, and succeeded only if no rank
    failed it.

    Attributes:
        completed_jobs: job id -> number of ranks that finished it successfully.
        failed_jobs: job id -> number of ranks on which it failed.
        transfer_stats: per ``(src medium, dst medium)``, totals of the transfers finished.
    """

    completed_jobs: dict[JobId, int] = field(default_factory=dict)
    failed_jobs: dict[JobId, int] = field(default_factory=dict)
    transfer_stats: dict[TransferType, TransferStats] = field(default_factory=dict)

    def mark_finished(self, job_id: JobId, success: bool) -> None:
        """Record that this rank finished ``job_id`` (once per job per rank)."""
        counts = self.completed_jobs if success else self.failed_jobs
        assert job_id not in self.completed_jobs and job_id not in self.failed_jobs, (
            f"job {job_id} reported twice by one worker"
        )
        counts[job_id] = 1

    def record_transfer(
        self, transfer_type: TransferType, num_bytes: int | None, seconds: float | None
    ) -> None:
        """Add one finished transfer to the per-direction totals."""
        stats = self.transfer_stats.get(transfer_type, TransferStats())
        self.transfer_stats[transfer_type] = stats + TransferStats(
            1, num_bytes or 0, seconds or 0.0
        )

    @override
    def bytes_moved(self) -> dict[str, int]:
        """Bytes of the transfers in ``transfer_stats``, per ``"SRC_to_DST"``."""
        return {f"{src}_to_{dst}": t.num_bytes for (src, dst), t in self.transfer_stats.items()}

    @override
    def aggregate(self, other: Self) -> Self:
        completed = Counter(self.completed_jobs)
        completed.update(other.completed_jobs)
        failed = Counter(self.failed_jobs)
        failed.update(other.failed_jobs)
        stats = dict(self.transfer_stats)
        for transfer_type, value in other.transfer_stats.items():
            stats[transfer_type] = stats.get(transfer_type, TransferStats()) + value
        return type(self)(dict(completed), dict(failed), stats)
