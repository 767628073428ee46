# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``TransferJobTable``: the scheduler-side connector's transfer jobs in flight.

The table owns every transfer job from its creation until every worker has reported it, and the
indexes derived from the jobs in flight: the keys being loaded, the keys being stored, the fence
index over GPU blocks, and the accounting of jobs issued before a ``reset_cache``. The scheduler
(``OffloadingConnectorScheduler``) decides *what* to transfer and talks to the manager; this
module only keeps the books, and never calls the manager.

Invariants:

* **Every job is reported exactly once.** ``account_reports`` hands a job back (and forgets it)
  in the call that brings in its last worker report, and never again; the scheduler completes it
  with the manager right then, with exactly ``job.keys``. Reports of unknown jobs are errors.
* **Nothing in flight is evicted.** The manager pins a job's offloaded rows from
  ``prepare_load`` / ``prepare_store`` until ``complete_load`` / ``complete_store``; since a job
  leaves the table only once every worker reported it, no row is unpinned while a worker may
  still read or write it. ``any_being_loaded`` and ``is_being_stored`` answer for exactly the
  keys of the jobs in the table.
* **GPU blocks a pending store reads are fenced.** The engine frees a finished request's GPU
  blocks at once. ``fence`` enters the GPU blocks of the request's store jobs into the fence
  index; ``take_flushes`` returns every job that reads a GPU block the step reallocated, so the
  workers wait for it before the forward pass overwrites the block. A job leaves the fence index
  when it leaves the table. Loads are never fenced: the engine keeps a loading request's GPU
  blocks until the load is reported, even if the request is aborted.
* **Jobs issued before a reset are flushed and then ignored.** After ``reset``, every job then in
  flight is returned by the next ``take_flushes``, its reports only count down (they are stale),
  and ``awaiting_pre_reset_reports`` holds until every worker reported every such job.

Job ids come from one counter shared by loads and stores and increase monotonically (see
``common``); the table assigns them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import JobId, ReqId
from vllm.v1.kv_offload.base import OffloadKey

GPUBlockRef = tuple[int, int]
"""``(group_idx, gpu_block_id)``: a GPU block, unique across KV-cache groups."""


@dataclass(eq=False, slots=True)
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

    @property
    def success(self) -> bool:
        """Whether no worker failed the job (final once ``pending_count`` is 0)."""
        return self.num_failed == 0


@dataclass(frozen=True, slots=True)
class ReportedJobs:
    """What one batch of worker reports finished.

    Attributes:
        finished: the jobs every worker has now reported, in job id order; each is returned
            exactly once and is no longer in the table.
        num_stale: reported job ids issued before the last reset (ignored).
    """

    finished: list[TransferJobStatus]
    num_stale: int


class TransferJobTable:
    """The jobs in flight and the indexes derived from them (see the module docstring).

    Runs on the scheduler thread. Every method but ``reset`` costs O(the jobs, keys and blocks
    it is given or returns), never O(jobs in flight).

    Args:
        num_workers: worker ranks; each reports every job once.
    """

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._jobs: dict[JobId, TransferJobStatus] = {}
        self._next_job_id: JobId = 0
        # Reports of ids below this were issued before the last reset: ignored.
        self._stale_job_threshold: JobId = 0
        # Jobs issued before a reset that workers still run: job id -> reports still due. Until
        # they are all in, their rows may still be read or written by a worker.
        self._unreported_pre_reset_jobs: dict[JobId, int] = {}
        # Jobs the next take_flushes returns whatever was allocated (reset puts them here).
        self._pending_flushes: set[JobId] = set()
        # GPU block -> pending store jobs reading it (only blocks of finished requests).
        self._fence: dict[GPUBlockRef, set[JobId]] = {}
        # Keys some load job is filling right now.
        self._keys_being_loaded: set[OffloadKey] = set()
        # Keys some store job is writing, with the number of such jobs.
        self._keys_being_stored: dict[OffloadKey, int] = {}

    def __len__(self) -> int:
        """Jobs created and not yet reported by every worker."""
        return len(self._jobs)

    def __getitem__(self, job_id: JobId) -> TransferJobStatus:
        """The job in flight with this id (``KeyError`` if it is not in flight)."""
        return self._jobs[job_id]

    # -----------------------------------------------------------------------------------------
    # Creation
    # -----------------------------------------------------------------------------------------

    def _register(
        self,
        req_id: ReqId,
        is_store: bool,
        keys: Sequence[OffloadKey],
        gpu_blocks: list[GPUBlockRef],
        token_range: tuple[int, int] = (0, 0),
    ) -> JobId:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = TransferJobStatus(
            job_id=job_id,
            req_id=req_id,
            is_store=is_store,
            keys=list(keys),
            gpu_blocks=gpu_blocks,
            pending_count=self.num_workers,
            token_range=token_range,
        )
        return job_id

    def add_load(
        self,
        req_id: ReqId,
        keys: Sequence[OffloadKey],
        gpu_blocks: list[GPUBlockRef],
        token_range: tuple[int, int],
    ) -> JobId:
        """Register a load of ``keys`` into ``gpu_blocks`` (tokens ``token_range``); its id.

        No key may be loaded by two jobs at once: callers check ``any_being_loaded`` first.
        """
        for key in keys:
            assert key not in self._keys_being_loaded, (
                f"key {key.hex()} is loaded twice at once (request {req_id})"
            )
        self._keys_being_loaded.update(keys)
        return self._register(req_id, False, keys, gpu_blocks, token_range)

    def add_store(
        self, req_id: ReqId, keys: Sequence[OffloadKey], gpu_blocks: list[GPUBlockRef]
    ) -> JobId:
        """Register a store of ``gpu_blocks`` into ``keys``; its id."""
        being_stored = self._keys_being_stored
        for key in keys:
            being_stored[key] = being_stored.get(key, 0) + 1
        return self._register(req_id, True, keys, gpu_blocks)

    # -----------------------------------------------------------------------------------------
    # Key indexes
    # -----------------------------------------------------------------------------------------

    def any_being_loaded(self, keys: Iterable[OffloadKey]) -> bool:
        """Whether a load job in flight fills any of ``keys``."""
        being_loaded = self._keys_being_loaded
        return bool(being_loaded) and any(key in being_loaded for key in keys)

    def is_being_stored(self, key: OffloadKey) -> bool:
        """Whether a store job in flight writes ``key``."""
        return key in self._keys_being_stored

    # -----------------------------------------------------------------------------------------
    # Fences and flushes
    # -----------------------------------------------------------------------------------------

    def fence(self, job_ids: Iterable[JobId]) -> None:
        """Fence the GPU blocks of the store jobs among ``job_ids`` (their request finished)."""
        fence = self._fence
        for job_id in job_ids:
            job = self._jobs[job_id]
            if job.is_store and not job.fenced:
                job.fenced = True
                for ref in job.gpu_blocks:
                    fence.setdefault(ref, set()).add(job_id)

    def take_flushes(self, allocated: Iterable[GPUBlockRef]) -> set[JobId]:
        """Jobs the workers must finish before the step's forward pass.

        Args:
            allocated: GPU blocks allocated this step.

        Returns:
            The jobs left to flush by ``reset`` (returned once), and every fenced job reading
            one of ``allocated``.
        """
        flushes, self._pending_flushes = self._pending_flushes, set()
        fence = self._fence
        if fence:
            for ref in allocated:
                pending = fence.get(ref)
                if pending:
                    flushes |= pending
        return flushes

    # -----------------------------------------------------------------------------------------
    # Worker reports
    # -----------------------------------------------------------------------------------------

    def account_reports(
        self, completed: Mapping[JobId, int], failed: Mapping[JobId, int]
    ) -> ReportedJobs:
        """Count the workers' reports down; return the jobs every worker has now reported.

        Args:
            completed: job id -> number of workers that finished it successfully.
            failed: job id -> number of workers on which it failed.

        Raises:
            ValueError: a report names a job that is not in flight (never issued, or already
                handed back), counts a job more often than workers still owe it, or counts a
                negative number. Every report of the call is checked before any is counted, so
                a refused call changes nothing. Reports come from the handlers a spec builds,
                which may be a third party's: hence exceptions, not assertions.
        """
        job_ids = sorted(completed.keys() | failed.keys())
        for job_id in job_ids:
            num_ok, num_failed = completed.get(job_id, 0), failed.get(job_id, 0)
            if num_ok < 0 or num_failed < 0:
                raise ValueError(
                    f"workers reported job {job_id} a negative number of times "
                    f"({num_ok} completed, {num_failed} failed)"
                )
            if job_id < self._stale_job_threshold:
                continue
            job = self._jobs.get(job_id)
            if job is None:
                raise ValueError(f"workers reported unknown job {job_id} (not in flight)")
            if num_ok + num_failed > job.pending_count:
                raise ValueError(
                    f"job {job_id} reported {num_ok + num_failed} more time(s), but only "
                    f"{job.pending_count} of its {self.num_workers} worker report(s) are due"
                )
        finished: list[TransferJobStatus] = []
        num_stale = 0
        for job_id in job_ids:
            num_reports = completed.get(job_id, 0) + failed.get(job_id, 0)
            if job_id < self._stale_job_threshold:
                num_stale += 1
                due = self._unreported_pre_reset_jobs.get(job_id)
                if due is not None:
                    if due > num_reports:
                        self._unreported_pre_reset_jobs[job_id] = due - num_reports
                    else:
                        del self._unreported_pre_reset_jobs[job_id]
                continue
            job = self._jobs[job_id]
            job.pending_count -= num_reports
            job.num_failed += failed.get(job_id, 0)
            if job.pending_count == 0:
                self._remove(job)
                finished.append(job)
        return ReportedJobs(finished, num_stale)

    def _remove(self, job: TransferJobStatus) -> None:
        """Forget a fully reported job and its entries in every index."""
        if job.is_store:
            being_stored = self._keys_being_stored
            for key in job.keys:
                count = being_stored[key] - 1
                if count:
                    being_stored[key] = count
                else:
                    del being_stored[key]
        else:
            self._keys_being_loaded.difference_update(job.keys)
        if job.fenced:
            fence = self._fence
            for ref in job.gpu_blocks:
                pending = fence.get(ref)
                if pending is not None:
                    pending.discard(job.job_id)
                    if not pending:
                        del fence[ref]
        del self._jobs[job.job_id]

    # -----------------------------------------------------------------------------------------
    # Reset
    # -----------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget every job in flight: flush each at the next step, and ignore its reports.

        The workers still run those jobs; ``awaiting_pre_reset_reports`` holds until each was
        reported by every worker. Jobs already awaiting reports from an earlier reset stay so.
        """
        self._pending_flushes.update(self._jobs)
        for job_id, job in self._jobs.items():
            self._unreported_pre_reset_jobs[job_id] = job.pending_count
        self._stale_job_threshold = self._next_job_id
        self._jobs.clear()
        self._fence.clear()
        self._keys_being_loaded.clear()
        self._keys_being_stored.clear()

    @property
    def awaiting_pre_reset_reports(self) -> bool:
        """Whether a job issued before the last reset still lacks a worker's report."""
        return bool(self._unreported_pre_reset_jobs)

    def has_pending_work(self) -> bool:
        """Whether a job is in flight, left to flush, or awaiting pre-reset reports."""
        return bool(self._jobs or self._pending_flushes or self._unreported_pre_reset_jobs)
