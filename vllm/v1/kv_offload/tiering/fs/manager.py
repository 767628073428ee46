# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``FileSystemSecondaryTier``: a crash-safe, capacity-bounded secondary tier on a filesystem.

Registered as tier type ``"fs"``. Blocks are whole primary rows (every worker's slice), one file
per block, under a directory derived from the run's identity (see ``file_mapper``), so the cache
survives restarts and is shared by every instance that mounts the same root with the same run
fields.

Components (one module per concern): ``transfers`` (the read/write path: a job's stores and
loads, in chunks, and the lookup probe), ``capacity`` (the capacity index and the removal of
files through it), ``slots`` (the bound of a directory shared by several instances), ``scan``
(the start-up scan and the walk every reconcile pass does), ``reconcile`` (the thread that runs
them), ``writers`` (which instances write the directory), ``lookup`` (lookups from the index,
else a background probe), ``io_pool`` (the I/O threads), ``run_dir`` (directories at start).

Threads:
    * the scheduler thread calls the ``SecondaryTierManager`` methods; they only queue work and
      do O(keys) bookkeeping (no system call); lookups answer from the index when it can tell;
    * ``n_read_threads`` + ``n_write_threads`` I/O threads (``DualQueueThreadPool``) copy between
      primary rows and files, a chunk of a job at a time;
    * the async-lookup thread ``stat`` s the files of lookups the index cannot answer;
    * the scan thread rebuilds the capacity index at start and removes crash leftovers, then
      lists the other writers and, while there is something to learn, keeps reconciling the
      index with the directory (files other instances wrote or deleted), a bounded number of
      entries per interval (``reconcile``).

Guarantees:
    * A block file is published atomically (tmp file, fsync, rename; one directory fsync per
      job); a reader never sees a partial file, and a crash leaves only temporary files, which
      are never served and are removed by the next start-up scan.
    * Every load is verified (header, key, run digest, size, checksum of the payload). A corrupt,
      truncated or foreign file fails the job and is deleted; a file of the wrong size is deleted
      wherever the tier meets it and never indexed. A transient error (any ``OSError``: EACCES,
      EIO, ELOOP, EMFILE, ...) fails the job and keeps the file; after ``max_read_failures``
      failed reads in a row the file is no longer served and the next store replaces it. A
      failed load job may have written part of its rows; the tiering manager frees them, so
      they are never served.
    * ``max_bytes`` is enforced by LRU eviction that never removes a block being loaded. It
      bounds the directory as a whole, however many instances share it: every block file holds
      one of ``max_bytes // file size`` capacity slots from before its first byte is written
      (``slots``). The accounting stays exact under concurrency and converges to the directory
      within a bounded interval when others change it (a vanished file is a miss).
    * Events (medium ``"STORAGE"``) are recorded only for files this tier really wrote or
      removed.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    TierStats,
)
from vllm.v1.kv_offload.tiering.base import JobMetadata, JobResult
from vllm.v1.kv_offload.tiering.block_format import file_size
from vllm.v1.kv_offload.tiering.fs.block_io import (
    FileModes,
    register_writer,
    unregister_writer,
)
from vllm.v1.kv_offload.tiering.fs.capacity import CapacityIndex, FileRemover, RankFiles
from vllm.v1.kv_offload.tiering.fs.config import FsTierConfig
from vllm.v1.kv_offload.tiering.fs.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.io_pool import DualQueueThreadPool
from vllm.v1.kv_offload.tiering.fs.lookup import FsLookups
from vllm.v1.kv_offload.tiering.fs.meters import Counters, FreeSpaceGuard
from vllm.v1.kv_offload.tiering.fs.native_io import load_native_io
from vllm.v1.kv_offload.tiering.fs.reconcile import Reconciler
from vllm.v1.kv_offload.tiering.fs.run_dir import RunDirectory
from vllm.v1.kv_offload.tiering.fs.scan import RankDirWalker, ScanStats, leaf_bucket
from vllm.v1.kv_offload.tiering.fs.slots import CapacitySlots
from vllm.v1.kv_offload.tiering.fs.transfers import BlockTransfers, JobRecord, job_tasks
from vllm.v1.kv_offload.tiering.fs.writers import WriterRegistry
from vllm.v1.kv_offload.tiering.run_identity import run_fields_from_spec
from vllm.v1.kv_offload.tiering.tier_plumbing import (
    AsyncLookupTier,
    check_job_rows,
    primary_view_rows,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import OffloadingSpec

logger = init_logger(__name__)

STORAGE_MEDIUM = "STORAGE"
"""Medium name of the filesystem tier in ``OffloadingEvent.medium``."""
FS_LOCALITY = "LOCAL"
"""``OffloadingEvent.locality`` of the filesystem tier: only this instance reads its directory."""


class FileSystemSecondaryTier(AsyncLookupTier):
    """A secondary tier that keeps each block in a file under ``root_dir``.

    Ownership: the tier borrows the primary view until ``shutdown()``; it reads a row only while
    a store job naming it is in flight (the manager pins the row) and writes a row only while a
    load job naming it is in flight (the manager keeps the row unreadable). Files of the run's
    rank directory are shared with every instance of the same run; this tier deletes only files
    it evicts or finds corrupt, and its own temporary files (and dead writers' leftovers).

    Protection: keys of a submitted load are pinned in the capacity index until their task ends,
    so eviction never removes a block being read.

    Tier kwargs (the ``secondary_tiers`` entry of type ``"fs"``; see ``FsTierConfig``):
        root_dir: required; created if missing. Unusable -> ``OSError`` naming it.
        n_read_threads, n_write_threads: I/O threads (default: the host's CPUs, from 2 to 8,
            each).
        max_bytes: LRU bound on this run's block files (bytes or e.g. ``"64GiB"``); default none.
        min_free_bytes: free space to leave on the filesystem (default min(1 GiB, 5 %)).
        o_direct: ``"auto"`` (default), true or false.
        enable_events: record ``OffloadingEvent`` s, medium ``"STORAGE"`` (default false).
        stale_tmp_age_s: age after which a possibly live writer's temporary file is removed by
            the start-up scan (default 600).
        reconcile_interval_s: seconds between two steps of the background reconcile (default 1).
        reconcile_batch: directory entries examined per reconcile step (default 1024).
        max_read_failures: consecutive failed reads after which a block file is no longer
            served and the next store replaces it (default 3).
        permissions: ``"private"`` (default: directories 0700, files 0600, whatever the umask)
            or ``"group"`` (2770 and 0660: a cache shared by the root's group).
        integrity_key_env, integrity_key_file: where the fleet secret is (an environment
            variable name, or a file of raw bytes only its owner may read), at most one: every
            block file then carries an HMAC-SHA256, and one whose MAC does not verify is deleted
            and counted (``forged_removed``), never served; one written without the key (or
            with another) is a miss (``unauthenticated_misses``). Default: none, CRCs only.

    Raises (construction):
        ValueError: an unknown or invalid config key, a primary view of the wrong shape,
            ``max_bytes`` below one block file, or a ``config.json`` of another run in the run's
            directory.
        OSError: ``root_dir`` (named in the message) cannot be created, opened or written, or
            ``o_direct=True`` and O_DIRECT does not work there.
    """

    _THREAD_STOP_TIMEOUT_S: float = 10.0
    """How long ``shutdown()`` waits for the lookup thread, then for the start-up scan, when one
    is blocked in the filesystem (e.g. a hung NFS mount), before it goes on without it, leaving
    the directory descriptors open."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str | os.PathLike[str] | None = None,
        n_read_threads: int | None = None,
        n_write_threads: int | None = None,
        max_bytes: int | str | None = None,
        min_free_bytes: int | str | None = None,
        o_direct: bool | str = "auto",
        enable_events: bool = False,
        stale_tmp_age_s: float = 600.0,
        reconcile_interval_s: float = 1.0,
        reconcile_batch: int = 1024,
        max_read_failures: int = 3,
        permissions: str = "private",
        integrity_key_env: str | None = None,
        integrity_key_file: str | None = None,
        **tier_kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, **tier_kwargs)
        self._config = config = FsTierConfig.from_kwargs(
            root_dir=root_dir,
            n_read_threads=n_read_threads,
            n_write_threads=n_write_threads,
            max_bytes=max_bytes,
            min_free_bytes=min_free_bytes,
            o_direct=o_direct,
            enable_events=enable_events,
            stale_tmp_age_s=stale_tmp_age_s,
            reconcile_interval_s=reconcile_interval_s,
            reconcile_batch=reconcile_batch,
            max_read_failures=max_read_failures,
            permissions=permissions,
            integrity_key_env=integrity_key_env,
            integrity_key_file=integrity_key_file,
        )
        view = primary_kv_view
        self._num_rows, self._row_bytes = primary_view_rows(view, "fs")
        if config.max_bytes is not None and config.max_bytes < file_size(self._row_bytes):
            raise ValueError(
                f"fs tier: max_bytes={config.max_bytes} is smaller than one block file "
                f"({file_size(self._row_bytes)} bytes)"
            )
        self._mapper = FileMapper(
            config.root_dir, run_fields_from_spec(offloading_spec, self._row_bytes)
        )
        self._writer = register_writer()
        self._slots: CapacitySlots | None = None
        try:
            self._run_dir = RunDirectory.open(
                config.root_dir, self._mapper, self._writer, FileModes.of(config.permissions)
            )
            try:
                o_direct_on = self._run_dir.decide_o_direct(
                    config.o_direct, view, self._row_bytes, self._writer
                )
                min_free = self._run_dir.resolve_min_free_bytes(config.min_free_bytes)
                self._slots = self._open_slots()
                # Registered before the first block file is written (see writers.py).
                self._writers = WriterRegistry(
                    self._run_dir.rank_fd,
                    self._writer,
                    self._run_dir.modes,
                    config.stale_tmp_age_s,
                )
            except BaseException:
                if self._slots is not None:
                    self._slots.close()
                self._run_dir.close()
                raise
        except BaseException:
            unregister_writer(self._writer)
            raise
        self._o_direct = o_direct_on
        # Flat byte view of the primary rows; row b is [b * row_bytes, (b + 1) * row_bytes).
        self._flat: memoryview = view.cast("B")
        self._events: deque[tuple[OffloadKey, bool]] = deque()
        self._counters = Counters()
        self._index = CapacityIndex(
            config.max_bytes,
            on_change=self._record_event if config.enable_events else None,
            bucket_of=leaf_bucket,
        )
        rank_fd = self._run_dir.rank_fd
        files = RankFiles(
            rank_fd, self._mapper, self._index, self._counters, self._row_bytes, self._slots
        )
        self._remover = FileRemover(files)
        if self._slots is not None:
            self._slots.bind_remover(self._remover.evict)
        self._transfers = BlockTransfers(
            files,
            self._flat,
            remover=self._remover,
            o_direct=o_direct_on,
            modes=self._run_dir.modes,
            free_space=FreeSpaceGuard(rank_fd, min_free, files.file_size, config.root_dir),
            writer=self._writer,
            max_read_failures=config.max_read_failures,
            integrity=config.integrity,
            native=load_native_io(),
        )
        # Scheduler thread only.
        self._jobs: dict[int, JobRecord] = {}
        self._closed = False
        self._pool = DualQueueThreadPool(
            config.n_read_threads, config.n_write_threads, f"vllm_fs_tier_{tier_type}"
        )
        self._walker = RankDirWalker(files, self._remover, stale_tmp_age_s=config.stale_tmp_age_s)
        self._reconciler = Reconciler(
            self._walker,
            index=self._index,
            count_writers=self._writers.count_others,
            after_first=self._after_scan,
            # Without slots, this is how files others wrote get evicted; with them, the directory
            # is bounded already and a view that briefly counts a file twice must not evict.
            after_step=self._evict_to_fit if self._slots is None else None,
            interval_s=config.reconcile_interval_s,
            batch=config.reconcile_batch,
            name=f"vllm_fs_tier_{tier_type}_scan",
        )
        self._lookups = FsLookups(tier_type, self._index, self._transfers, self._reconciler)
        self._scan_started = time.monotonic()  # the scan starts with the thread
        self._reconciler.start()
        logger.info(
            "fs tier: %s (O_DIRECT %s, max_bytes=%s in %s slots, min_free_bytes=%d, %d+%d I/O "
            "threads, reconcile %d entries every %.3g s)",
            self._run_dir.rank_dir,
            "on" if o_direct_on else "off",
            config.max_bytes,
            "no" if self._slots is None else self._slots.capacity,
            min_free,
            config.n_read_threads,
            config.n_write_threads,
            config.reconcile_batch,
            config.reconcile_interval_s,
        )

    # -----------------------------------------------------------------------------------------
    # What an operator may ask
    # -----------------------------------------------------------------------------------------

    @property
    def config(self) -> FsTierConfig:
        """The validated configuration."""
        return self._config

    @property
    def rank_dir(self) -> str:
        """Absolute path of this run's block directory (layout: docs/fs_tier.md)."""
        return self._run_dir.rank_dir

    @property
    def uses_o_direct(self) -> bool:
        """Whether block I/O uses O_DIRECT (probed at start)."""
        return self._o_direct

    @property
    def block_file_size(self) -> int:
        """Bytes of one block file (header + one primary row)."""
        return self._transfers.file_size

    @property
    def sole_writer(self) -> bool:
        """Whether this instance is the only writer of its run directory and its index holds
        every block file in it: lookups then answer at once, absent keys included, and the
        reconcile only lists the writers (docs/fs_tier.md, "Who writes the directory")."""
        return self._reconciler.solo

    def wait_reconciled(self, timeout: float | None = None) -> bool:
        """Block until the reconcile finished a round that started after this call: a complete
        pass over the directory, or, when this instance is the only writer and nothing changed
        behind its back, a listing of the writers that found none. After it, ``get_stats``
        accounts every change made to the directory before the call. False if ``timeout``
        expired first."""
        return self._reconciler.wait_for_round(timeout)

    @override
    def get_stats(self) -> TierStats:
        """Blocks and bytes of the capacity index, the block file size, and the counters of
        docs/fs_tier.md ("Statistics"): per job and block, and per lookup."""
        usage = self._index.snapshot()
        return TierStats(
            tier_type=self.tier_type,
            num_blocks=usage.num_blocks,
            used_bytes=usage.used_bytes,
            block_bytes=self.block_file_size,
            counters=self._counters.snapshot() | self.lookup_counters(),
            capacity_bytes=usage.max_bytes,
        )

    @override
    def wait_until_ready(self, timeout_s: float | None = None) -> bool:
        """Wait for the start-up scan: the index then counts every block file already on
        disk."""
        return self._reconciler.wait_for_scan(timeout_s) is not None

    def __repr__(self) -> str:
        return f"FileSystemSecondaryTier({self._run_dir.rank_dir!r}, o_direct={self._o_direct})"

    # -----------------------------------------------------------------------------------------
    # SecondaryTierManager (scheduler thread)
    # -----------------------------------------------------------------------------------------

    @override
    def submit_store(self, job: JobMetadata) -> None:
        """Queue the job's writes (a few tasks of several blocks each); blocks already on disk
        are skipped by their task."""
        record = self._new_record(job)
        self._submit(job, record, is_load=False)

    @override
    def submit_load(self, job: JobMetadata) -> None:
        """Pin the keys against eviction and queue the job's verified reads (a few tasks of
        several blocks each)."""
        record = self._new_record(job)
        keys = list(job.keys)
        self._index.pin(keys)
        try:
            self._submit(job, record, is_load=True)
        except BaseException:
            self._index.unpin(keys)
            raise

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Every job finished since the last call; a failed load's keys become lookup misses."""
        results: list[JobResult] = []
        for job_id, success in self._pool.get_finished():
            record = self._jobs.pop(job_id, None)
            assert record is not None, f"fs tier: finished job {job_id} was never submitted"
            assert success == (not record.failed_keys), (
                f"fs tier: job {job_id} success={success} but failed keys "
                f"{[key.hex() for key in record.failed_keys]}"
            )
            kind = "load_jobs" if record.is_promotion else "store_jobs"
            self._counters.add({kind: 1, f"{kind}_failed": 0 if success else 1})
            if record.is_promotion and record.failed_keys:
                # Stop requests from retrying blocks this tier could not deliver.
                self._lookups.mark_miss(record.failed_keys)
            results.append(JobResult(job_id, success))
        return results

    @override
    def drain_jobs(self) -> None:
        """Block until every submitted job finished (results stay in ``get_finished_jobs``)."""
        self._pool.wait_idle()

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._index.touch(keys)

    @override
    def has_pending_work(self) -> bool:
        return self._pool.num_jobs_in_flight > 0

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call, in order, consecutive same-kind changes merged."""
        pending = self._events
        events: list[OffloadingEvent] = []
        keys: list[OffloadKey] = []
        present = True
        while pending:
            key, key_present = pending.popleft()
            if keys and key_present != present:
                events.append(
                    OffloadingEvent(keys, STORAGE_MEDIUM, removed=not present, locality=FS_LOCALITY)
                )
                keys = []
            present = key_present
            keys.append(key)
        if keys:
            events.append(
                OffloadingEvent(keys, STORAGE_MEDIUM, removed=not present, locality=FS_LOCALITY)
            )
        return events

    @override
    def shutdown(self) -> None:
        """Stop lookups and the scan, cancel queued I/O (reported as failed), join the threads,
        release the primary view and close the directories. Idempotent.

        A lookup or a start-up scan blocked in the filesystem for longer than
        ``_THREAD_STOP_TIMEOUT_S`` is left behind on its daemon thread (a stopped scan evicts
        nothing); the directories then stay open (see the warning logged). I/O tasks already
        running are waited for without a bound: they hold rows of the primary view.
        """
        if self._closed:
            return
        self._closed = True
        timeout = self._THREAD_STOP_TIMEOUT_S
        stuck: list[str] = []
        if not self._lookups.shutdown(timeout):
            stuck.append("a lookup")
        if not self._reconciler.stop(timeout):
            stuck.append("the start-up scan or reconcile")
        self._pool.shutdown()
        self._flat.release()
        self._writers.leave()  # after the last I/O: others stop counting this instance
        if not stuck:
            self._writers.close()
            if self._slots is not None:
                self._slots.close()
            self._run_dir.close()
        else:
            # A thread stuck in the filesystem still resolves paths relative to these
            # descriptors; closed, their numbers could be reused by any later open().
            logger.warning(
                "fs tier: %s still blocked in the filesystem under %s after %.0f s; the "
                "directory descriptors stay open",
                " and ".join(stuck),
                self._config.root_dir,
                timeout,
            )
        unregister_writer(self._writer)

    # -----------------------------------------------------------------------------------------
    # Internals
    # -----------------------------------------------------------------------------------------

    def _new_record(self, job: JobMetadata) -> JobRecord:
        assert job.job_id not in self._jobs, f"fs tier: job {job.job_id} submitted twice"
        check_job_rows(job, self._num_rows, "fs")
        return JobRecord(is_promotion=job.is_promotion)

    def _submit(self, job: JobMetadata, record: JobRecord, *, is_load: bool) -> None:
        threads = self._config.n_read_threads if is_load else self._config.n_write_threads
        tasks = job_tasks(job, record, self._transfers, threads)
        self._jobs[job.job_id] = record
        try:
            self._pool.submit(
                job.job_id, tasks, is_load=is_load, on_done=None if is_load else record.finish
            )
        except BaseException:
            del self._jobs[job.job_id]
            raise

    def _record_event(self, key: OffloadKey, present: bool) -> None:
        # Called under the index lock: events are in the order of the changes.
        self._events.append((key, present))

    def _open_slots(self) -> CapacitySlots | None:
        """The capacity slots of a bounded tier, if the filesystem has hard links."""
        max_bytes = self._config.max_bytes
        if max_bytes is None:
            return None
        if not self._run_dir.supports_hard_links(self._writer):
            logger.warning(
                "fs tier: no hard links under %s: max_bytes bounds this instance's view of the "
                "directory only; instances sharing it may exceed it together by what they "
                "write within one reconcile pass",
                self._config.root_dir,
            )
            return None
        return CapacitySlots(
            self._run_dir.rank_fd,
            max_bytes // file_size(self._row_bytes),
            self._writer,
            self._mapper,
            self._row_bytes,
            self._config.stale_tmp_age_s,
            self._run_dir.rank_dir,
            self._run_dir.modes,
        )

    def _after_scan(self, stats: ScanStats) -> None:
        """Scan thread: evict down to max_bytes once everything is known, then log."""
        if stats.completed:
            self._evict_to_fit()
        logger.info(
            "fs tier: start-up scan of %s %s in %.2f s: %d blocks (%d bytes), %d leftover "
            "temporary and "
            "%d invalid files removed, %d files given a slot and %d evicted for want of one, "
            "%d garbage slots freed, %d errors",
            self._run_dir.rank_dir,
            "done" if stats.completed else "stopped",
            time.monotonic() - self._scan_started,
            stats.blocks,
            stats.bytes,
            stats.tmp_removed,
            stats.invalid_removed,
            stats.adopted,
            stats.unslotted_removed,
            stats.slots.reclaimed,
            stats.errors,
        )

    def _evict_to_fit(self) -> None:
        """Scan thread: evict LRU blocks until the index is within max_bytes (files others wrote,
        newly found, may have pushed it over)."""
        victims = self._index.evict_to_fit()
        if victims:
            self._remover.remove_victims(victims)
