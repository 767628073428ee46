# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
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
import functools
import logging
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Literal

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.block_format import MAX_KEY_BYTES, BlockFileCorrupt, file_size
from vllm.v1.kv_offload.tiering.fs.block_io import (
    HeaderBuffers,
    open_block_dir,
    read_block_file,
    regular_file_size,
    regular_file_stat,
    tmp_name,
    unlink_block,
    write_block_file,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath, FileMapper
from vllm.v1.kv_offload.tiering.fs.index import CapacityIndex, RemoveOutcome, ReserveStatus
from vllm.v1.kv_offload.tiering.fs.meters import BusyClock, FreeSpaceGuard, RateLimitedLog
from vllm.v1.kv_offload.tiering.fs.read_failures import ReadFailures, file_identity
from vllm.v1.kv_offload.tiering.fs.slots import CapacitySlots

__all__ = ["BlockStore", "BusyClock", "NoFreeSlot"]

logger = init_logger(__name__)

COUNTER_NAMES = (
    "store_jobs",
    "store_jobs_failed",
    "load_jobs",
    "load_jobs_failed",
    "blocks_written",
    "blocks_skipped",
    "blocks_loaded",
    "blocks_evicted",
    "corrupt_removed",
    "store_failures",
    "load_failures",
    "reads_given_up",
    "slots_lost",
    "claim_misses",
)
"""Every counter ``BlockStore.counters`` reports (0 until counted), besides the busy times."""

_MAX_EVICTIONS_PER_CLAIM = 8
"""Victims a store evicts, one at a time, to find a free capacity slot before it gives up (a
victim whose slot this instance does not know yet frees none until the reconcile finds it)."""


class NoFreeSlot(Exception):
    """No capacity slot could be freed for a new block file (only pinned blocks are left)."""


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
        slots: the capacity slots that bound the directory as a whole (None: ``max_bytes`` is
            only enforced on this instance's index, or there is no ``max_bytes``).
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
        slots: CapacitySlots | None = None,
    ) -> None:
        self._rank_fd = rank_fd
        self._mapper = mapper
        self._index = index
        self._row_bytes = row_bytes
        self.file_size = file_size(row_bytes)
        self._o_direct = o_direct
        self._writer = writer
        self._max_bytes = max_bytes
        self._buffers = HeaderBuffers()
        self._counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._log = RateLimitedLog(logger)
        self._free_space = FreeSpaceGuard(rank_fd, min_free_bytes, self.file_size, root_dir)
        self._store_clock = BusyClock()
        self._load_clock = BusyClock()
        self._read_failures = ReadFailures(max_read_failures)
        self._slots = slots

    def counters(self) -> dict[str, int]:
        """Cumulative counts: ``blocks_written``, ``blocks_skipped`` (already present),
        ``blocks_loaded``, ``blocks_evicted``, ``corrupt_removed`` (invalid files deleted,
        wrong-size ones included), ``store_failures``, ``load_failures``, ``reads_given_up``
        (files no longer served after ``max_read_failures`` failed reads), ``slots_lost``
        (published files found without their capacity slot, see ``_keep_slot``),
        ``claim_misses`` (random evictions that freed no slot); ``store_jobs`` /
        ``load_jobs`` and ``store_jobs_failed`` / ``load_jobs_failed``, the jobs reported (by
        the tier) and those of them that failed; and ``store_busy_us`` / ``load_busy_us``, the
        wall time (in microseconds) during which at least one store / load was running (see
        ``BusyClock``)."""
        with self._counters_lock:
            counters = dict.fromkeys(COUNTER_NAMES, 0) | self._counters
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
        followed by ``row`` verbatim (``tiering.block_format``).

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
        return self._in_leaf_dir("store", key, functools.partial(self._store_in, key, row))

    def _store_in(
        self, key: OffloadKey, row: memoryview, leaf_fd: int, path: BlockPath, ticket: int
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
        if not self._free_space.has_room():
            return self._failed("store_failures")
        reservation = self._index.reserve(key, self.file_size)
        if reservation.status is ReserveStatus.BUSY_WRITING:
            self._count("blocks_skipped")
            return True
        if reservation.status is not ReserveStatus.OK:
            if reservation.status is ReserveStatus.NO_ROOM:
                self._log_no_room(key)
            return self._failed("store_failures")
        if reservation.victims:
            self.remove_victims(reservation.victims)
        claim: list[tuple[int, int]] = []  # (slot, inode) once claimed
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
                on_created=(
                    None
                    if self._slots is None
                    else functools.partial(self._claim_slot, leaf_fd, claim)
                ),
            )
        except BaseException as e:
            self._index.abort(key)
            self._count("store_failures")
            if isinstance(e, NoFreeSlot):
                self._log_no_room(key)
                return False
            if isinstance(e, OSError):
                self._log_os_error("store", key, e)
                return False
            raise
        self._index.commit(key, self.file_size)
        self._read_failures.clear(key)
        self._count("blocks_written")
        if claim:
            self._keep_slot(leaf_fd, key, path, *claim[0])
        return True

    def _claim_slot(
        self, leaf_fd: int, claim: list[tuple[int, int]], tmp: str, fd: int
    ) -> Callable[[], None]:
        """``on_created`` of a store: link the new (still empty) file to a capacity slot,
        evicting least recently used blocks until one is free; ``(slot, inode)`` is appended to
        ``claim``. Returns the slot's release (for a file that is not published)."""
        ino = os.fstat(fd).st_ino
        n = self._claim(leaf_fd, tmp, ino)
        claim.append((n, ino))
        return functools.partial(self._unclaim, n, ino)

    def _keep_slot(self, leaf_fd: int, key: OffloadKey, path: BlockPath, n: int, ino: int) -> None:
        """After publishing: the file must still hold its slot. A releaser that grabbed it by
        mistake and could not put it back (the number was claimed again meanwhile) leaves it
        without one: claim another (evicting as usual), or evict the new file itself, so that a
        published file never stays outside the bound."""
        slots = self._slots
        assert slots is not None
        try:
            if slots.holds(n, ino):
                return
            self._count("slots_lost")
            m = self._claim(leaf_fd, path.name, ino)
            if slots.holds(n, ino):
                slots.release(m, ino)  # it was only being put back: keep one slot
        except (OSError, NoFreeSlot):
            file_id = (os.fstat(leaf_fd).st_dev, ino)
            self._remove(key, path, file_id, "blocks_evicted", leaf_fd=leaf_fd)

    def _claim(self, leaf_fd: int, name: str, ino: int) -> int:
        """Link file ``name`` (inode ``ino``) to a free capacity slot, evicting as needed.

        Raises:
            NoFreeSlot: none could be freed.
            OSError: from the system calls.
        """
        slots = self._slots
        assert slots is not None
        for _ in range(_MAX_EVICTIONS_PER_CLAIM + 1):
            n = slots.try_claim(leaf_fd, name, ino)
            if n is not None:
                return n
            victims = self._index.evict_lru(1)
            if victims:
                self.remove_victims(victims)
            elif not slots.evict_unknown(self.remove_block_file):
                # Nothing indexed is evictable (all pinned, or nothing known yet) and the
                # random slot tried held a block being written or removed.
                self._count("claim_misses")
        raise NoFreeSlot

    def remove_block_file(self, key: OffloadKey, file_id: tuple[int, int]) -> bool:
        """Evict ``key``'s block file for the capacity slots (``CapacitySlots.bind_remover``):
        if it is still inode ``file_id`` and this tier is neither writing nor reading it."""
        return self._remove(
            key, self._mapper.block_path(key), file_id, "blocks_evicted", unless_pinned=True
        )

    def _unclaim(self, n: int, ino: int) -> None:
        """The file claimed slot ``n`` but is not published: free the slot."""
        assert self._slots is not None
        self._slots.release(n, ino)

    def _log_no_room(self, key: OffloadKey) -> None:
        self._log(
            logging.WARNING,
            "noroom",
            "fs tier: cannot make room under max_bytes=%s (blocks being loaded are never "
            "evicted); the store of block %s fails",
            self._max_bytes,
            key.hex(),
        )

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
        return self._in_leaf_dir("load", key, functools.partial(self._load_in, key, row))

    def _load_in(
        self, key: OffloadKey, row: memoryview, leaf_fd: int, path: BlockPath, ticket: int
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
            self._remove(key, self._mapper.block_path(key), None, "blocks_evicted", begun=True,
                         size_if_unknown=size)  # fmt: skip

    def _remove_wrong_size(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, st: os.stat_result
    ) -> bool:
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
        return self._remove_corrupt(leaf_fd, key, path, (st.st_dev, st.st_ino))

    def _remove_corrupt(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, file_id: tuple[int, int] | None
    ) -> bool:
        """Delete ``key``'s invalid file (inode ``file_id``); returns whether this call did."""
        return self._remove(key, path, file_id, "corrupt_removed", leaf_fd=leaf_fd)

    def remove_unslotted(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, st: os.stat_result
    ) -> bool:
        """Evict ``key``'s file (the inode ``st`` describes): it holds no capacity slot and none
        is free (a file written without ``max_bytes``, or found at start beyond the bound).

        Returns:
            Whether this call removed it.
        """
        return self._remove(key, path, (st.st_dev, st.st_ino), "blocks_evicted", leaf_fd=leaf_fd)

    def remove_invalid(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, st: os.stat_result
    ) -> bool:
        """Delete ``key``'s file of the wrong size (the inode ``st`` describes), as corrupt.

        Returns:
            Whether this call removed it.
        """
        return self._remove_wrong_size(leaf_fd, key, path, st)

    def _remove(
        self,
        key: OffloadKey,
        path: BlockPath,
        file_id: tuple[int, int] | None,
        counter: str,
        *,
        leaf_fd: int | None = None,
        begun: bool = False,
        unless_pinned: bool = False,
        size_if_unknown: int | None = None,
    ) -> bool:
        """Remove ``key``'s block file if it is inode ``file_id`` (None: whatever file), through
        the index (``begin_remove`` unless ``begun``, then ``finish_remove`` with what really
        happened), free its capacity slot, and count ``counter`` if this call removed it.

        Args:
            leaf_fd: the block's directory if the caller has it open (else opened here).
            unless_pinned: do nothing if a load of ``key`` is in flight.
            size_if_unknown: what the index keeps counting if the directory cannot be opened.
        """
        if not begun and not self._index.begin_remove(key, unless_pinned=unless_pinned):
            return False  # this tier is rewriting it (the rename replaces it) or removing it
        outcome, kept = RemoveOutcome.KEPT, size_if_unknown
        fd = leaf_fd
        try:
            if fd is None:
                fd = open_block_dir(self._rank_fd, path, create=False)
        except FileNotFoundError:
            outcome, kept = RemoveOutcome.VANISHED, None
        except OSError as e:
            self._log(logging.WARNING, "unlink", "fs tier: cannot remove %s: %s", path.rel, e)
        else:
            try:
                removed = unlink_block(fd, path.name, file_id)
                if removed is not None:
                    outcome, kept = RemoveOutcome.REMOVED, None
                    self._release_slot(removed, path)
                else:
                    # Gone, or replaced by another writer since it was judged: leave the new one.
                    kept = regular_file_size(fd, path.name)
                    outcome = RemoveOutcome.VANISHED if kept is None else RemoveOutcome.KEPT
            except OSError as e:
                self._log(logging.WARNING, "unlink", "fs tier: cannot remove %s: %s", path.rel, e)
                with contextlib.suppress(OSError):
                    kept = regular_file_size(fd, path.name)
            finally:
                if leaf_fd is None:
                    os.close(fd)
        if kept is not None and kept != self.file_size:
            kept = None  # a file of the wrong size is never indexed (it is retried when met)
        self._index.finish_remove(key, outcome, kept)
        if outcome is RemoveOutcome.REMOVED:
            self._count(counter)
        return outcome is RemoveOutcome.REMOVED

    def _release_slot(self, st: os.stat_result, path: BlockPath) -> None:
        """The block name of inode ``st`` is gone: free its capacity slot (if known)."""
        if self._slots is None:
            return
        try:
            self._slots.release_inode(st.st_ino)
        except OSError as e:
            # The slot stays as garbage; the reconcile frees it.
            self._log(
                logging.WARNING, "slot", "fs tier: cannot free the slot of %s: %s", path.rel, e
            )

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

    def _in_leaf_dir(
        self,
        op: Literal["store", "load"],
        key: OffloadKey,
        body: Callable[[int, BlockPath, int], bool],
    ) -> bool:
        """Return ``body(leaf_fd, path, ticket)``: ``key``'s block path, an index ticket taken
        before any I/O, and ``path``'s leaf directory, opened (by a store also created) for it and
        closed after; False, counted as a failure of ``op``, if it cannot be opened. A load
        finding no directory observes the block as absent instead of logging."""
        path = self._mapper.block_path(key)
        ticket = self._index.ticket()
        try:
            leaf_fd = open_block_dir(self._rank_fd, path, create=op == "store")
        except OSError as e:
            if op == "load" and isinstance(e, FileNotFoundError):
                self._index.observe(key, None, ticket, hot=False)
            else:
                self._log_os_error(op, key, e)
            return self._failed(f"{op}_failures")
        try:
            return body(leaf_fd, path, ticket)
        finally:
            os.close(leaf_fd)

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
