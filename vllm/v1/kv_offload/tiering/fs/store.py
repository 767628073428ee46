"""Per-block operations of the filesystem tier, callable from any thread.

``BlockStore`` combines the file format and system calls (``block_io``) with the capacity index
(``index``): every file it creates or removes is accounted, every file it finds is observed.

Failure classes, as the tier reports them:
    * permanent (``BlockFileCorrupt``: wrong size, bad header, other key or run, checksum
      mismatch): the load fails and the file is deleted, so later lookups miss it. A file of the
      wrong size is deleted as soon as the tier meets it (lookup probe, store, scan), never
      indexed: its size says nothing about the bytes the tier can serve;
    * vanished (``FileNotFoundError``): the load fails, the index forgets the file (a miss); a
      store that finds its file gone accounts it so before it writes it again;
    * transient (any other ``OSError``: EACCES, EIO, ELOOP, EMFILE, ENOSPC, ...): the operation
      fails and nothing is deleted; a failed write removes only its own temporary file. A file
      whose reads fail ``max_read_failures`` times in a row is given up (``ReadFailures``):
      lookups miss it, it becomes the first eviction victim, and the next store replaces it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.fs.block_file import MAX_KEY_BYTES, BlockFileCorrupt, file_size
from vllm.v1.kv_offload.tiering.fs.block_io import (
    HeaderBuffers,
    open_block_dir,
    read_block_file,
    regular_file_size,
    regular_file_stat,
    tmp_name,
    unlink_if_same,
    write_block_file,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath, FileMapper
from vllm.v1.kv_offload.tiering.fs.index import CapacityIndex, RemoveOutcome, ReserveStatus
from vllm.v1.kv_offload.tiering.fs.read_failures import ReadFailures, file_identity

logger = logging.getLogger(__name__)

_LOG_INTERVAL_S = 10.0


class RateLimitedLog:
    """Logs at most one message per kind every ``_LOG_INTERVAL_S``; counts the rest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[Any, float] = {}
        self._suppressed: Counter[Any] = Counter()

    def __call__(self, level: int, kind: Any, msg: str, *args: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < _LOG_INTERVAL_S:
                self._suppressed[kind] += 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += f" ({suppressed} similar message(s) suppressed)"
        logger.log(level, msg, *args)


class BusyClock:
    """Wall time during which at least one operation was running; overlaps count once.

    The fs tier's I/O threads run several blocks at once, so summing per-block durations would
    count the same second once per thread. Thread-safe; use as a context manager around each
    operation.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.monotonic()
            self._active += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            assert self._active >= 0, "BusyClock: more exits than entries"
            if self._active == 0:
                self._total += time.monotonic() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, the running stretch included."""
        with self._lock:
            running = time.monotonic() - self._since if self._active else 0.0
            return self._total + running


class BlockStore:
    """Stores, loads, probes and removes block files of one rank directory.

    Thread-safety: every public method may run concurrently on any thread (the index has its own
    lock; each thread uses its own header buffer). Borrowed: ``rank_fd`` and ``index`` (owned by
    the tier, which closes the descriptor only after every caller stopped).

    Args:
        rank_fd: descriptor of the rank directory.
        mapper: key -> path mapping and run digest.
        index: the capacity index.
        row_bytes: payload bytes of a block file (one primary row).
        o_direct: use O_DIRECT for block files.
        min_free_bytes: free filesystem bytes to leave; stores stop below it.
        writer: writer id for temporary file names.
        root_dir: for log messages.
        max_bytes: for log messages.
        max_read_failures: consecutive failed reads after which a file is given up.
    """

    def __init__(
        self,
        rank_fd: int,
        mapper: FileMapper,
        index: CapacityIndex,
        *,
        row_bytes: int,
        o_direct: bool,
        min_free_bytes: int,
        writer: str,
        root_dir: str,
        max_bytes: int | None,
        max_read_failures: int = 3,
    ) -> None:
        self._rank_fd = rank_fd
        self._mapper = mapper
        self._index = index
        self._row_bytes = row_bytes
        self.file_size = file_size(row_bytes)
        self._o_direct = o_direct
        self._min_free_bytes = min_free_bytes
        self._writer = writer
        self._root_dir = root_dir
        self._max_bytes = max_bytes
        self._buffers = HeaderBuffers()
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._log = RateLimitedLog()
        self._fs_low = False
        self._fs_low_lock = threading.Lock()
        self._store_clock = BusyClock()
        self._load_clock = BusyClock()
        self._read_failures = ReadFailures(max_read_failures)

    def counters(self) -> dict[str, int]:
        """Cumulative counts: ``blocks_written``, ``blocks_skipped`` (already present),
        ``blocks_loaded``, ``blocks_evicted``, ``corrupt_removed`` (invalid files deleted,
        wrong-size ones included), ``store_failures``, ``load_failures``, ``reads_given_up``
        (files no longer served after ``max_read_failures`` failed reads); and
        ``store_busy_us`` / ``load_busy_us``, the wall time (in microseconds) during which at
        least one store / load was running (see ``BusyClock``)."""
        with self._counters_lock:
            counters = dict(self._counters)
        counters["store_busy_us"] = round(self._store_clock.seconds() * 1e6)
        counters["load_busy_us"] = round(self._load_clock.seconds() * 1e6)
        return counters

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(self, key: OffloadKey, row: memoryview) -> bool:
        """Write ``row`` as ``key``'s file unless a complete file is already there.

        Layout: ``row`` is one primary row, a 1-D C-contiguous byte view of ``row_bytes`` bytes
        (page-aligned when O_DIRECT is on), read only. The file is ``HEADER_SIZE`` header bytes
        followed by ``row`` verbatim (``block_file``).

        Returns:
            True if the file exists afterwards (written, already present, or being written by
            another thread of this tier); False if the store failed (nothing partial remains).
        """
        with self._store_clock:
            return self._store(key, row)

    def _store(self, key: OffloadKey, row: memoryview) -> bool:
        if len(key) > MAX_KEY_BYTES:
            self._log(logging.ERROR, "longkey", "fs tier: key of %d bytes is too long", len(key))
            return self._failed("store_failures")
        path = self._mapper.block_path(key)
        ticket = self._index.ticket()
        try:
            leaf_fd = open_block_dir(self._rank_fd, path, create=True)
        except OSError as e:
            self._log_os_error("store", key, e)
            return self._failed("store_failures")
        try:
            return self._store_in(leaf_fd, path, key, row, ticket)
        finally:
            os.close(leaf_fd)

    def _store_in(
        self, leaf_fd: int, path: BlockPath, key: OffloadKey, row: memoryview, ticket: int
    ) -> bool:
        try:
            st = regular_file_stat(leaf_fd, path.name)
        except OSError as e:
            self._log_os_error("store", key, e)
            return self._failed("store_failures")
        if st is None:
            # Deleted behind the tier's back: if the store fails below, the index must not keep
            # counting the file.
            self._index.observe(key, None, ticket, hot=False)
        elif st.st_size != self.file_size:
            # Never indexed at its size; deleted (only that inode) before the new file is made.
            self._remove_wrong_size(leaf_fd, key, path, st)
        elif not self._read_failures.given_up(key, file_identity(st)):
            self._index.observe(key, st.st_size, ticket, hot=True)
            self._count("blocks_skipped")  # dedupe
            return True
        # else: a whole file this tier gave up reading; the rename below replaces it.
        if not self._has_room_on_fs():
            return self._failed("store_failures")
        reservation = self._index.reserve(key, self.file_size)
        if reservation.status is ReserveStatus.BUSY_WRITING:
            self._count("blocks_skipped")
            return True
        if reservation.status is not ReserveStatus.OK:
            if reservation.status is ReserveStatus.NO_ROOM:
                self._log(
                    logging.WARNING,
                    "noroom",
                    "fs tier: cannot make room under max_bytes=%s (blocks being loaded are never "
                    "evicted); the store of block %s fails",
                    self._max_bytes,
                    key.hex(),
                )
            return self._failed("store_failures")
        if reservation.victims:
            self.remove_victims(reservation.victims)
        try:
            write_block_file(
                leaf_fd,
                path,
                tmp_name(path.stem, self._writer),
                self._buffers.header,
                row,
                key=key,
                run_digest=self._mapper.run_digest,
                o_direct=self._o_direct,
            )
        except BaseException as e:
            self._index.abort(key)
            self._count("store_failures")
            if isinstance(e, OSError):
                self._log_os_error("store", key, e)
                return False
            raise
        self._index.commit(key, self.file_size)
        self._read_failures.clear(key)
        self._count("blocks_written")
        return True

    def _has_room_on_fs(self) -> bool:
        """False (logged once per episode) when a write would leave < ``min_free_bytes``."""
        try:
            st = os.statvfs(self._rank_fd)
        except OSError:
            return True  # cannot tell: the write itself will tell
        free = st.f_bavail * st.f_frsize
        low = free < self._min_free_bytes + self.file_size
        if low != self._fs_low:
            with self._fs_low_lock:
                if low and not self._fs_low:
                    logger.warning(
                        "fs tier: %d bytes free under %s (min_free_bytes=%d): stopped storing "
                        "blocks until space is freed",
                        free,
                        self._root_dir,
                        self._min_free_bytes,
                    )
                elif not low and self._fs_low:
                    logger.info("fs tier: space freed under %s: storing resumed", self._root_dir)
                self._fs_low = low
        return not low

    # -----------------------------------------------------------------------------------------
    # Load
    # -----------------------------------------------------------------------------------------

    def load(self, key: OffloadKey, row: memoryview) -> bool:
        """Read and verify ``key``'s file into ``row``.

        Layout: ``row`` is one primary row, a 1-D C-contiguous writable byte view of
        ``row_bytes`` bytes (page-aligned when O_DIRECT is on); it receives file bytes
        ``[HEADER_SIZE, HEADER_SIZE + row_bytes)`` verbatim.

        On False, ``row`` may hold part of the file; the caller must not mark it valid. A corrupt
        file has been deleted; a vanished one forgotten; on a transient error the file is kept.
        """
        with self._load_clock:
            return self._load(key, row)

    def _load(self, key: OffloadKey, row: memoryview) -> bool:
        path = self._mapper.block_path(key)
        ticket = self._index.ticket()
        try:
            leaf_fd = open_block_dir(self._rank_fd, path, create=False)
        except FileNotFoundError:
            self._index.observe(key, None, ticket, hot=False)
            return self._failed("load_failures")
        except OSError as e:
            self._log_os_error("load", key, e)
            return self._failed("load_failures")
        try:
            return self._load_in(leaf_fd, key, path, row, ticket)
        finally:
            os.close(leaf_fd)

    def _load_in(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, row: memoryview, ticket: int
    ) -> bool:
        try:
            read_block_file(
                leaf_fd,
                path.name,
                self._buffers.header,
                row,
                key=key,
                run_digest=self._mapper.run_digest,
                o_direct=self._o_direct,
            )
        except FileNotFoundError:
            self._read_failures.clear(key)
            self._index.observe(key, None, ticket, hot=False)
            return self._failed("load_failures")
        except BlockFileCorrupt as e:
            self._log(
                logging.WARNING,
                "corrupt",
                "fs tier: block file %s is invalid (%s); deleting it",
                path.rel,
                e.reason,
            )
            self._read_failures.clear(key)
            self._remove_corrupt(leaf_fd, key, path, e.file_id)
            return self._failed("load_failures")
        except OSError as e:
            self._log_os_error("load", key, e)
            self._count_read_failure(leaf_fd, key, path)
            return self._failed("load_failures")
        self._read_failures.clear(key)
        self._index.observe(key, self.file_size, ticket, hot=True)
        self._count("blocks_loaded")
        return True

    def _count_read_failure(self, leaf_fd: int, key: OffloadKey, path: BlockPath) -> None:
        """A transient error failed a read of ``key``'s file: count it, maybe give the file up."""
        try:
            st = regular_file_stat(leaf_fd, path.name)
        except OSError:
            st = None  # cannot tell which file: counted against the one that failed before
        if not self._read_failures.failed(key, None if st is None else file_identity(st)):
            return
        self._index.demote(key)
        self._count("reads_given_up")
        self._log(
            logging.WARNING,
            "given_up",
            "fs tier: block file %s failed %d reads in a row; no longer served (lookups miss, "
            "it is evicted first, the next store of the block replaces it)",
            path.rel,
            self._read_failures.limit,
        )

    # -----------------------------------------------------------------------------------------
    # Probe
    # -----------------------------------------------------------------------------------------

    def probe(self, key: OffloadKey) -> bool:
        """Whether ``key``'s file looks loadable: a regular file of the right size, below real
        directories. The file's contents are verified by the load."""
        path = self._mapper.block_path(key)
        ticket = self._index.ticket()
        rank_fd = self._rank_fd
        try:
            st = os.stat(path.rel, dir_fd=rank_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return False
            # The stat above resolved the two directory components: refuse symlinked ones
            # (a load, which opens them with O_NOFOLLOW, would fail anyway).
            for rel_dir in (path.dir1, f"{path.dir1}/{path.dir2}"):
                if not stat.S_ISDIR(
                    os.stat(rel_dir, dir_fd=rank_fd, follow_symlinks=False).st_mode
                ):
                    return False
        except (FileNotFoundError, NotADirectoryError):
            self._index.observe(key, None, ticket, hot=False)
            return False
        except OSError as e:
            self._log(logging.WARNING, "probe", "fs tier: cannot stat %s: %s", path.rel, e)
            return False
        if st.st_size != self.file_size:
            try:
                leaf_fd = open_block_dir(rank_fd, path, create=False)
            except OSError as e:
                self._log(logging.WARNING, "probe", "fs tier: cannot open %s: %s", path.rel, e)
                return False
            try:
                self._remove_wrong_size(leaf_fd, key, path, st)
            finally:
                os.close(leaf_fd)
            return False
        if self._read_failures.given_up(key, file_identity(st)):
            # Still accounted (it occupies the disk), left where it is in the LRU order.
            self._index.observe(key, st.st_size, ticket, hot=False)
            return False
        return self._index.observe(key, st.st_size, ticket, hot=True)

    # -----------------------------------------------------------------------------------------
    # Removal
    # -----------------------------------------------------------------------------------------

    def remove_victims(self, victims: Iterable[tuple[OffloadKey, int]]) -> None:
        """Unlink evicted blocks (already chosen and marked by the index) and settle each."""
        for key, size in victims:
            path = self._mapper.block_path(key)
            outcome: RemoveOutcome = RemoveOutcome.KEPT
            kept: int | None = size
            try:
                leaf_fd = open_block_dir(self._rank_fd, path, create=False)
            except FileNotFoundError:
                outcome, kept = RemoveOutcome.VANISHED, None
            except OSError as e:
                self._log(logging.WARNING, "unlink", "fs tier: cannot evict %s: %s", path.rel, e)
            else:
                try:
                    removed = unlink_if_same(leaf_fd, path.name, None)
                    outcome = RemoveOutcome.REMOVED if removed else RemoveOutcome.VANISHED
                    kept = None
                except OSError as e:
                    self._log(
                        logging.WARNING, "unlink", "fs tier: cannot evict %s: %s", path.rel, e
                    )
                finally:
                    os.close(leaf_fd)
            self._index.finish_remove(key, outcome, kept)
            if outcome is RemoveOutcome.REMOVED:
                self._count("blocks_evicted")

    def _remove_wrong_size(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, st: os.stat_result
    ) -> None:
        """Delete ``key``'s file of the wrong size (the inode ``st`` describes, only)."""
        self._log(
            logging.WARNING,
            "wrong_size",
            "fs tier: block file %s has %d bytes instead of %d; deleting it",
            path.rel,
            st.st_size,
            self.file_size,
        )
        self._read_failures.clear(key)
        self._remove_corrupt(leaf_fd, key, path, (st.st_dev, st.st_ino))

    def _remove_corrupt(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, file_id: tuple[int, int] | None
    ) -> None:
        if not self._index.begin_remove(key):
            return  # this tier is rewriting it (the rename replaces it) or already removing it
        outcome: RemoveOutcome = RemoveOutcome.KEPT
        kept: int | None = None
        try:
            if unlink_if_same(leaf_fd, path.name, file_id):
                outcome = RemoveOutcome.REMOVED
            else:
                # Gone, or replaced by another writer since we read it: leave the new file.
                kept = regular_file_size(leaf_fd, path.name)
                outcome = RemoveOutcome.VANISHED if kept is None else RemoveOutcome.KEPT
        except OSError as e:
            self._log(logging.WARNING, "unlink", "fs tier: cannot delete %s: %s", path.rel, e)
            with contextlib.suppress(OSError):
                kept = regular_file_size(leaf_fd, path.name)
        if kept is not None and kept != self.file_size:
            kept = None  # a file of the wrong size is never indexed (it is retried when met)
        self._index.finish_remove(key, outcome, kept)
        if outcome is RemoveOutcome.REMOVED:
            self._count("corrupt_removed")

    # -----------------------------------------------------------------------------------------
    # Helpers
    # -----------------------------------------------------------------------------------------

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (see ``counters``)."""
        if n:
            with self._counters_lock:
                self._counters[name] += n

    def _count(self, name: str) -> None:
        self.count(name)

    def _failed(self, counter: str) -> bool:
        self._count(counter)
        return False

    def _log_os_error(self, op: str, key: OffloadKey, e: OSError) -> None:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            self._log(
                logging.WARNING,
                ("nospace", op),
                "fs tier: %s of block %s failed, filesystem full or over quota (%s); the job "
                "fails, its temporary file is removed, the tier keeps working",
                op,
                key.hex(),
                e,
            )
        else:
            self._log(
                logging.WARNING,
                ("oserror", op, e.errno),
                "fs tier: %s of block %s failed (%s); the job fails, no file is deleted",
                op,
                key.hex(),
                e,
            )
