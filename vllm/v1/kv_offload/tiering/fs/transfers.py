# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The read/write path of the filesystem tier: a job's stores and loads, and the lookup probe.

A job is split into a few chunks of blocks (``job_tasks``), each one task of the I/O pool; a
chunk's bookkeeping is done once for all its blocks: one ticket, one free-space check, one
reservation of the capacity index and one commit, one addition to the counters, one run of the
busy clock. A store job's block names are made durable by one directory ``fsync`` when its last
chunk ends (``JobRecord.finish``; the argument is in docs/fs_tier.md, "Crash safety"). Per block
there is one ``fsync`` of the file, before its rename.

Failure classes, as the tier reports them:
    * permanent (``BlockFileCorrupt``: wrong size, bad header, other key or run, checksum
      mismatch; ``BlockForged``: a MAC that does not verify): the load fails and the file is
      deleted, so later lookups miss it. A file of the wrong size is deleted as soon as the tier
      meets it (lookup probe, store, scan), never indexed: its size says nothing about the
      bytes the tier can serve;
    * not authenticated (``BlockNotAuthenticated``: written without the fleet's key, or under
      another): the load fails, the file is kept but given up at once;
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
import itertools
import logging
import os
import stat
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

from typing_extensions import override

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.block_format import (
    HEADER_SIZE,
    KEY_ID_BYTES,
    MAC_BYTES,
    MAX_KEY_BYTES,
    BlockFileCorrupt,
    BlockForged,
    BlockNotAuthenticated,
    IntegrityKey,
    verify_parts,
    write_block_header,
)
from vllm.v1.kv_offload.tiering.fs.block_io import (
    FileModes,
    HeaderBuffers,
    discard_unpublished,
    new_file_flags,
    open_block_dir,
    read_block_file,
    regular_file_stat,
    tmp_name,
    write_block_file,
)
from vllm.v1.kv_offload.tiering.fs.capacity import FileRemover, RankFiles, ReserveStatus
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath
from vllm.v1.kv_offload.tiering.fs.io_pool import IoTask
from vllm.v1.kv_offload.tiering.fs.meters import FreeSpaceGuard, RateLimitedLog

logger = init_logger(__name__)

_MAX_EVICTIONS_PER_CLAIM = 8
"""Victims a store evicts, one at a time, to find a free capacity slot before it gives up (a
victim whose slot this instance does not know yet frees none until the reconcile finds it)."""

MIN_BLOCKS_PER_TASK = 4
"""A job is split into at most one task per I/O thread of its kind, each of at least this many
blocks (a smaller job is one task): bookkeeping per task, parallelism for large jobs."""


class NoFreeSlot(Exception):
    """No capacity slot could be freed for a new block file (only pinned blocks are left)."""


# ---------------------------------------------------------------------------------------------
# Files that keep failing to read
# ---------------------------------------------------------------------------------------------

FileId = tuple[int, int, int]
"""``(st_dev, st_ino, st_mtime_ns)`` of a file (see ``file_identity``)."""


def file_identity(st: os.stat_result) -> FileId:
    """The identity of the file ``st`` describes: filesystems reuse a freed inode number at
    once, the modification time of a new file tells it apart."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


_MAX_TRACKED = 1 << 16
"""At most this many failing files are remembered (the oldest are forgotten first): a storm of
failures cannot grow memory without bound."""


class ReadFailures:
    """Consecutive failed reads per block file; thread-safe, O(1) per call.

    A transient read error (EACCES, EIO, ELOOP, ...) fails the load but keeps the file: one
    passing error must not become data loss. A file that fails every time, though, would be found
    by every lookup and fail every load, forever: once a file reaches ``limit`` failures in a row
    it is *given up*, no longer served, and the next store of the block replaces it. A count
    belongs to one file (``FileId``): a successful read, or the file being replaced, removed or
    rewritten by anyone, clears it.

    Args:
        limit: failed reads after which a file is given up (>= 1).
    """

    def __init__(self, limit: int) -> None:
        assert limit >= 1, f"limit={limit}"
        self.limit = limit
        self._lock = threading.Lock()
        # key -> (file, consecutive failures), least recently failed first.
        self._failures: OrderedDict[OffloadKey, tuple[FileId | None, int]] = OrderedDict()

    def failed(self, key: OffloadKey, file_id: FileId | None) -> bool:
        """Count a failed read of ``key``'s file ``file_id`` (None: could not tell which).

        Returns:
            True if this failure gives the file up (exactly once per file).
        """
        with self._lock:
            old_id, count = self._failures.pop(key, (file_id, 0))
            if file_id is not None and old_id is not None and old_id != file_id:
                count = 0  # another file now: its own count starts
            count += 1
            self._remember(key, file_id if file_id is not None else old_id, count)
            return count == self.limit

    def give_up(self, key: OffloadKey, file_id: FileId | None) -> bool:
        """Give ``key``'s file ``file_id`` up at once (it can never be served: e.g. it is not
        authenticated with the fleet's key). Returns True if it was not given up already."""
        with self._lock:
            old = self._failures.pop(key, None)
            already = old is not None and old[1] >= self.limit and old[0] == file_id
            self._remember(key, file_id, self.limit)
            return not already

    def given_up(self, key: OffloadKey, file_id: FileId | None = None) -> bool:
        """Whether ``key``'s file (``file_id`` when known) is given up.

        A ``file_id`` that differs from the failing file's clears the count: the file was
        replaced, so the new one gets its own tries. O(1), and without the lock for a key with
        no failure (every lookup asks).
        """
        if key not in self._failures:
            return False
        with self._lock:
            entry = self._failures.get(key)
            if entry is None:
                return False
            old_id, count = entry
            if file_id is not None and old_id is not None and old_id != file_id:
                del self._failures[key]
                return False
            return count >= self.limit

    def clear(self, keys: Iterable[OffloadKey]) -> None:
        """These keys' files were read, written, or are gone: forget their failures."""
        if not self._failures:
            return
        with self._lock:
            for key in keys:
                self._failures.pop(key, None)

    def _remember(self, key: OffloadKey, file_id: FileId | None, count: int) -> None:
        self._failures[key] = (file_id, count)
        while len(self._failures) > _MAX_TRACKED:
            self._failures.popitem(last=False)


# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class JobRecord:
    """A submitted job until reported. I/O threads append its failed keys and hand over the
    directory to ``fsync`` when it ends (``offer_sync``); the pool thread that finishes its last
    task calls ``finish``."""

    is_promotion: bool
    failed_keys: list[OffloadKey] = field(default_factory=list)
    _sync_fd: int = -1
    _sync_lock: threading.Lock = field(default_factory=threading.Lock)

    def offer_sync(self, fd: int) -> None:
        """``fd`` (a leaf directory this job renamed a block file into) is the directory to
        ``fsync`` when the job ends; a previously offered one is closed. Takes ``fd`` over."""
        with self._sync_lock:
            old, self._sync_fd = self._sync_fd, fd
        if old >= 0:
            os.close(old)

    def finish(self) -> None:
        """End of the job (its last task ran): ``fsync`` the directory offered last, so that
        the job's block names are durable when it is reported, and close it."""
        with self._sync_lock:
            fd, self._sync_fd = self._sync_fd, -1
        if fd < 0:
            return
        try:
            os.fsync(fd)
        except OSError as e:
            # The files are complete and in place; only the durability of their names is in
            # doubt (a power failure may forget them: misses, never wrong bytes).
            logger.warning("fs tier: fsync of a block directory failed: %s", e)
        finally:
            os.close(fd)


class JobChunk(IoTask):
    """Some consecutive blocks of a job, moved in one go by ``BlockTransfers``."""

    __slots__ = ("_blocks", "_record", "_transfers")

    def __init__(
        self, transfers: BlockTransfers, record: JobRecord, blocks: list[tuple[OffloadKey, int]]
    ) -> None:
        self._transfers = transfers
        self._record = record
        self._blocks = blocks

    @override
    def run(self) -> bool:
        record = self._record
        failed = [key for key, _ in self._blocks]  # until the transfer says otherwise
        try:
            if record.is_promotion:
                failed = self._transfers.load(self._blocks)
            else:
                failed = self._transfers.store(self._blocks, record)
        finally:
            if record.is_promotion:
                self._transfers.unpin(self._blocks)
            record.failed_keys.extend(failed)
        return not failed

    @override
    def cancel(self) -> None:
        if self._record.is_promotion:
            self._transfers.unpin(self._blocks)
        self._record.failed_keys.extend(key for key, _ in self._blocks)


def job_tasks(
    job: JobMetadata, record: JobRecord, transfers: BlockTransfers, max_tasks: int
) -> list[IoTask]:
    """``job``'s blocks as at most ``max_tasks`` chunks of at least ``MIN_BLOCKS_PER_TASK``
    blocks (consecutive, near-equal sizes)."""
    blocks = list(zip(job.keys, job.block_ids.tolist(), strict=True))
    n = len(blocks)
    if not n:
        return []
    chunks = max(1, min(max_tasks, n // MIN_BLOCKS_PER_TASK))
    bounds = [n * i // chunks for i in range(chunks + 1)]
    return [JobChunk(transfers, record, blocks[lo:hi]) for lo, hi in itertools.pairwise(bounds)]


# ---------------------------------------------------------------------------------------------
# Moving blocks
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Block:
    """One block of a store chunk: its primary row, path and open leaf directory."""

    key: OffloadKey
    block_id: int
    path: BlockPath
    leaf_fd: int
    write: bool = True
    """Needs writing (False: skipped as present, or failed before writing)."""
    absent: bool = False
    """The batched look found no entry of the file's name (its ``stat`` is not needed)."""


@dataclass(slots=True)
class _Pending:
    """A block of a batched store between the creation of its temporary file and its
    publication."""

    block: _Block
    tmp: str
    fd: int
    """Its open temporary file; negative once closed, or if it was never created."""
    claim: tuple[int, int] | None = None
    """Its capacity slot and inode, once claimed."""
    row: memoryview | None = None
    """Its primary row, held until published or abandoned."""

    def release_row(self) -> None:
        if self.row is not None:
            self.row.release()
            self.row = None


class BlockTransfers:
    """Moves blocks between primary rows and their files, and probes files; any thread.

    Thread-safety: every public method may run concurrently on any thread (the index, slots and
    counters have their own locks; each thread uses its own header buffer). Borrowed: the rank
    directory, the primary rows and everything passed in (the tier releases the rows and closes
    the directory only after every I/O thread stopped).

    Args:
        files: the rank directory, its index, slots and counters.
        rows: the primary rows as one flat byte view; row ``b`` is
            ``[b * row_bytes, (b + 1) * row_bytes)`` (every worker's slice of block ``b``;
            ``row_bytes`` is ``files.row_bytes``).
        remover: removes files through the index.
        o_direct: use O_DIRECT for block files.
        modes: of the directories and files it creates.
        free_space: the ``min_free_bytes`` guard.
        writer: writer id for temporary file names.
        max_read_failures: consecutive failed reads after which a file is given up.
        integrity: the fleet key: blocks are written with a MAC and loaded only if theirs
            verifies; None: CRCs only.
        native: the batched system calls (``native_io.load_native_io``): a chunk's directory
            opens and looks, file creations, writes and renames for a store, and its reads for
            a load, each in one call; None: every call from Python.
    """

    def __init__(
        self,
        files: RankFiles,
        rows: memoryview,
        *,
        remover: FileRemover,
        o_direct: bool,
        modes: FileModes,
        free_space: FreeSpaceGuard,
        writer: str,
        max_read_failures: int,
        integrity: IntegrityKey | None,
        native: ModuleType | None,
    ) -> None:
        self._files = files
        self._rows = rows
        self._remover = remover
        self._o_direct = o_direct
        self._modes = modes
        self._free_space = free_space
        self._writer = writer
        self._read_failures = ReadFailures(max_read_failures)
        self._integrity = integrity
        # A keyed header also holds the MAC trailer (kind, key id, MAC).
        self._max_key_bytes = MAX_KEY_BYTES - (
            0 if integrity is None else 4 + KEY_ID_BYTES + MAC_BYTES
        )
        self._buffers = HeaderBuffers()
        self._log = RateLimitedLog(logger)
        self._native = native

    @property
    def file_size(self) -> int:
        """Bytes of a block file of this run (``files.file_size``)."""
        return self._files.file_size

    @contextmanager
    def _row(self, block_id: int) -> Iterator[memoryview]:
        """Primary row ``block_id``, released on exit (so that ``shutdown()`` can release the
        view)."""
        start = block_id * self._files.row_bytes
        with self._rows[start : start + self._files.row_bytes] as row:
            yield row

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(
        self, blocks: Sequence[tuple[OffloadKey, int]], record: JobRecord
    ) -> list[OffloadKey]:
        """Write primary row ``block_id`` as ``key``'s file, for each ``(key, block_id)``, unless
        a complete file is already there (or another thread of this tier is writing it).

        Layout: a row is ``row_bytes`` bytes (page-aligned when O_DIRECT is on), read only; the
        file is ``HEADER_SIZE`` header bytes followed by the row verbatim
        (``tiering.block_format``). The directory of the last file written is handed to
        ``record`` for the job's ``fsync``.

        Returns:
            The keys whose store failed (nothing partial remains of them).
        """
        counts: Counter[str] = Counter()
        failed: list[OffloadKey] = []
        opened: list[_Block] = []
        with self._files.counters.store_clock:
            ticket = self._files.index.ticket()
            try:
                self._open_for_store(blocks, opened, failed)
                for block in opened:
                    if not self._needs_write(block, ticket, counts):
                        block.write = False
                        if block.leaf_fd < 0:
                            failed.append(block.key)
                written = self._write_blocks([b for b in opened if b.write], counts, failed)
                if written:
                    self._files.index.commit_many((b.key for b, _ in written), self.file_size)
                    self._read_failures.clear(b.key for b, _ in written)
                    counts["blocks_written"] += len(written)
                    for block, claim in written:
                        if claim is not None:
                            self._keep_slot(block, *claim)
                    last = written[-1][0]
                    record.offer_sync(last.leaf_fd)
                    last.leaf_fd = -1  # the record closes it
            finally:
                for block in opened:
                    if block.leaf_fd >= 0:
                        os.close(block.leaf_fd)
        counts["store_failures"] += len(failed)
        self._files.counters.add(counts)
        return failed

    def _open_for_store(
        self,
        blocks: Sequence[tuple[OffloadKey, int]],
        opened: list[_Block],
        failed: list[OffloadKey],
    ) -> None:
        """Append each block to ``opened``, its leaf directory open (created if needed), or its
        key to ``failed`` if that failed (logged). With the batched calls, one call opens the
        directories (creating those missing where ``mkdir`` alone gives their exact mode) and
        looks for the files in them (``_Block.absent``)."""
        mapper = self._files.mapper
        todo: list[tuple[OffloadKey, int, BlockPath]] = []
        for key, block_id in blocks:
            if len(key) > self._max_key_bytes:
                self._log(
                    logging.ERROR, "longkey", "fs tier: key of %d bytes is too long", len(key)
                )
                failed.append(key)
            else:
                todo.append((key, block_id, mapper.block_path(key)))
        if self._native is not None and todo:
            found = self._native.open_leaves(
                self._files.rank_fd,
                [(p.dir1, p.dir2, p.name) for _, _, p in todo],
                self._modes.dirs if self._modes.mkdir_is_exact else -1,
            )
            retry = []
            for (key, block_id, path), (leaf_fd, exists) in zip(todo, found, strict=True):
                if leaf_fd >= 0:
                    opened.append(_Block(key, block_id, path, leaf_fd, absent=exists == 0))
                else:
                    retry.append((key, block_id, path))  # to create, or an error to report
            todo = retry
        for key, block_id, path in todo:
            try:
                leaf_fd = open_block_dir(self._files.rank_fd, path, create=self._modes)
            except OSError as e:
                self._log_os_error("store", key, e)
                failed.append(key)
            else:
                opened.append(_Block(key, block_id, path, leaf_fd))

    def _needs_write(self, block: _Block, ticket: int, counts: Counter[str]) -> bool:
        """Whether ``block``'s file must be written: False if a complete file is there (dedupe,
        counted as skipped) or its stat failed (its leaf then closed, ``leaf_fd`` -1). A block
        the batched look found absent needs no ``stat``."""
        key, path = block.key, block.path
        try:
            st = None if block.absent else regular_file_stat(block.leaf_fd, path.name)
        except OSError as e:
            self._log_os_error("store", key, e)
            os.close(block.leaf_fd)
            block.leaf_fd = -1
            return False
        if st is None:
            # Deleted behind the tier's back: if the store fails below, the index must not keep
            # counting the file.
            self._files.index.observe(key, None, ticket, hot=False)
            return True
        if st.st_size != self.file_size:
            # Never indexed at its size; deleted (only that inode) before the new file is made.
            self._read_failures.clear((key,))
            self._remover.remove_wrong_size(block.leaf_fd, key, path, st)
            return True
        if self._read_failures.given_up(key, file_identity(st)):
            return True  # a whole file this tier gave up reading: the rename replaces it
        self._files.index.observe(key, st.st_size, ticket, hot=True)
        counts["blocks_skipped"] += 1
        return False

    def _write_blocks(
        self, todo: list[_Block], counts: Counter[str], failed: list[OffloadKey]
    ) -> list[tuple[_Block, tuple[int, int] | None]]:
        """Reserve room for ``todo`` (one reservation), evict its victims, write each; failed
        keys are appended to ``failed``. Returns the blocks written, in order, with their slot
        claim ``(slot, inode)`` (None without slots)."""
        written: list[tuple[_Block, tuple[int, int] | None]] = []
        if not todo:
            return written
        if not self._free_space.has_room():
            failed.extend(b.key for b in todo)
            return written
        statuses, victims = self._files.index.reserve_many([b.key for b in todo], self.file_size)
        if victims:
            self._remover.remove_victims(victims)
        reserved: list[_Block] = []
        for block, status in zip(todo, statuses, strict=True):
            if status is ReserveStatus.BUSY_WRITING:
                counts["blocks_skipped"] += 1
            elif status is not ReserveStatus.OK:
                if status is ReserveStatus.NO_ROOM:
                    self._log_no_room(block.key)
                failed.append(block.key)
            else:
                reserved.append(block)
        if self._native is not None and reserved:
            self._write_batch(reserved, written, failed)
            return written
        for block in reserved:
            ok, claim = self._write(block)
            if ok:
                written.append((block, claim))
            else:
                failed.append(block.key)
        return written

    def _write_batch(
        self,
        blocks: list[_Block],
        written: list[tuple[_Block, tuple[int, int] | None]],
        failed: list[OffloadKey],
    ) -> None:
        """``_write`` of every block of ``blocks`` (reserved) with the batched calls: what
        ``write_block_file`` does for each file, in its order, with its undo for a file not
        published. One call creates every temporary file; then for each, here, the capacity
        slot is claimed and the header encoded; one call writes, syncs (buffered I/O), closes
        and renames them all. Appends the blocks published to ``written``, the others' keys to
        ``failed``."""
        assert self._native is not None
        slots = self._files.slots
        row_bytes = self._files.row_bytes
        run_digest = self._files.mapper.run_digest
        tmps = [tmp_name(b.path.stem, self._writer) for b in blocks]
        created = self._native.create_files(
            [b.leaf_fd for b in blocks], tmps, new_file_flags(self._o_direct), self._modes.files
        )
        headers = self._buffers.many(len(blocks))
        ready: list[_Pending] = []  # created, slot claimed, header encoded: to publish
        left = deque(zip(blocks, tmps, created, strict=True))
        try:
            while left:
                block, tmp, (fd, ino) = left.popleft()
                if fd < 0:
                    self._files.index.abort(block.key)
                    self._log_os_error("store", block.key, OSError(-fd, os.strerror(-fd), tmp))
                    failed.append(block.key)
                    continue
                pending = _Pending(block, tmp, fd)
                start = block.block_id * row_bytes
                pending.row = self._rows[start : start + row_bytes]
                try:
                    self._modes.fix_file(fd)
                    if slots is not None:
                        pending.claim = (self._claim(block.leaf_fd, tmp, ino), ino)
                    at = len(ready) * HEADER_SIZE
                    with headers[at : at + HEADER_SIZE] as header:
                        write_block_header(
                            header, pending.row, key=block.key, run_digest=run_digest,
                            integrity=self._integrity,
                        )  # fmt: skip
                except (OSError, NoFreeSlot) as e:
                    self._abandon(pending, failed, e)
                    continue
                except BaseException:
                    self._abandon(pending, failed, None)
                    raise
                ready.append(pending)
            if not ready:
                return
            codes = self._native.publish_files(
                [p.fd for p in ready],
                headers[: len(ready) * HEADER_SIZE],
                [p.row for p in ready],
                [p.block.leaf_fd for p in ready],
                [p.tmp for p in ready],
                [p.block.path.name for p in ready],
                not self._o_direct,  # with O_DIRECT the bytes are on the device already
            )
            published, ready = ready, []  # closed by the call, published or not
            for pending, stage, err in zip(published, codes[::2], codes[1::2], strict=True):
                pending.fd = -1
                if stage == 0:
                    written.append((pending.block, pending.claim))
                    pending.release_row()
                else:
                    self._abandon(pending, failed, OSError(err, os.strerror(err), pending.tmp))
        finally:
            # Only after an unexpected exception: nothing of these is published.
            for pending in ready:
                self._abandon(pending, failed, None)
            for block, tmp, (fd, _) in left:
                self._abandon(_Pending(block, tmp, fd), failed, None)
            headers.release()

    def _abandon(
        self, pending: _Pending, failed: list[OffloadKey], error: BaseException | None
    ) -> None:
        """A batched store of ``pending``'s file that is not published: as ``write_block_file``
        and ``_write`` do, close it, release its slot, remove it, abort its reservation, log
        ``error`` (None: an unexpected exception, re-raised by the caller) and count it
        failed."""
        key = pending.block.key
        if pending.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(pending.fd)
            pending.fd = -1
        slots, claim = self._files.slots, pending.claim
        discard_unpublished(
            pending.block.leaf_fd,
            pending.tmp,
            None if claim is None or slots is None else functools.partial(slots.release, *claim),
        )
        pending.release_row()
        self._files.index.abort(key)
        if isinstance(error, NoFreeSlot):
            self._log_no_room(key)
        elif isinstance(error, OSError):
            self._log_os_error("store", key, error)
        failed.append(key)

    def _write(self, block: _Block) -> tuple[bool, tuple[int, int] | None]:
        """Write ``block``'s file (reserved): ``(written, slot claim)``; the reservation is
        aborted if not written."""
        key, leaf_fd = block.key, block.leaf_fd
        claim: list[tuple[int, int]] = []  # (slot, inode) once claimed
        try:
            with self._row(block.block_id) as row:
                write_block_file(
                    leaf_fd,
                    block.path,
                    tmp_name(block.path.stem, self._writer),
                    self._buffers.header,
                    row,
                    key=key,
                    run_digest=self._files.mapper.run_digest,
                    o_direct=self._o_direct,
                    modes=self._modes,
                    integrity=self._integrity,
                    on_created=(
                        None
                        if self._files.slots is None
                        else functools.partial(self._claim_slot, leaf_fd, claim)
                    ),
                )
        except BaseException as e:
            self._files.index.abort(key)
            if isinstance(e, NoFreeSlot):
                self._log_no_room(key)
                return False, None
            if isinstance(e, OSError):
                self._log_os_error("store", key, e)
                return False, None
            raise
        return True, claim[0] if claim else None

    def _claim_slot(
        self, leaf_fd: int, claim: list[tuple[int, int]], tmp: str, fd: int
    ) -> Callable[[], None]:
        """``on_created`` of a store: link the new (still empty) file to a capacity slot,
        evicting least recently used blocks until one is free; ``(slot, inode)`` is appended to
        ``claim``. Returns the slot's release (for a file that is not published)."""
        slots = self._files.slots
        assert slots is not None
        ino = os.fstat(fd).st_ino
        n = self._claim(leaf_fd, tmp, ino)
        claim.append((n, ino))

        def release() -> None:
            slots.release(n, ino)

        return release

    def _keep_slot(self, block: _Block, n: int, ino: int) -> None:
        """After publishing: the file must still hold its slot. A releaser that grabbed it by
        mistake and could not put it back (the number was claimed again meanwhile) leaves it
        without one: claim another (evicting as usual), or evict the new file itself, so that a
        published file never stays outside the bound."""
        slots = self._files.slots
        assert slots is not None
        try:
            if slots.holds(n, ino):
                return
            self._files.counters.incr("slots_lost")
            m = self._claim(block.leaf_fd, block.path.name, ino)
            if slots.holds(n, ino):
                slots.release(m, ino)  # it was only being put back: keep one slot
        except (OSError, NoFreeSlot):
            file_id = (os.fstat(block.leaf_fd).st_dev, ino)
            self._remover.remove(
                block.key, block.path, file_id, "blocks_evicted", leaf_fd=block.leaf_fd
            )

    def _claim(self, leaf_fd: int, name: str, ino: int) -> int:
        """Link file ``name`` (inode ``ino``) to a free capacity slot, evicting as needed.

        Raises:
            NoFreeSlot: none could be freed.
            OSError: from the system calls.
        """
        slots = self._files.slots
        assert slots is not None
        for _ in range(_MAX_EVICTIONS_PER_CLAIM + 1):
            n = slots.try_claim(leaf_fd, name, ino)
            if n is not None:
                return n
            victims = self._files.index.evict_lru(1)
            if victims:
                self._remover.remove_victims(victims)
            elif not slots.evict_unknown(self._remover.evict):
                # Nothing indexed is evictable (all pinned, or nothing known yet) and the
                # random slot tried held a block being written or removed.
                self._files.counters.incr("claim_misses")
        raise NoFreeSlot

    def _log_no_room(self, key: OffloadKey) -> None:
        self._log(
            logging.WARNING,
            "noroom",
            "fs tier: cannot make room under max_bytes=%s (blocks being loaded are never "
            "evicted); the store of block %s fails",
            self._files.index.max_bytes,
            key.hex(),
        )

    # -----------------------------------------------------------------------------------------
    # Load
    # -----------------------------------------------------------------------------------------

    def load(self, blocks: Sequence[tuple[OffloadKey, int]]) -> list[OffloadKey]:
        """Read and verify ``key``'s file into primary row ``block_id``, for each.

        Layout: a row is ``row_bytes`` bytes (page-aligned when O_DIRECT is on), written only
        here; it receives file bytes ``[HEADER_SIZE, HEADER_SIZE + row_bytes)`` verbatim.

        A failed block's row may hold part of its file; the caller must not mark it valid. A
        corrupt (or forged) file has been deleted, a vanished one forgotten; on a transient
        error the file is kept.

        Returns:
            The keys whose load failed.
        """
        counts: Counter[str] = Counter()
        failed: list[OffloadKey] = []
        loaded: list[OffloadKey] = []
        with self._files.counters.load_clock:
            ticket = self._files.index.ticket()
            if self._native is not None and blocks:
                blocks = self._load_batch(blocks, loaded)
            for key, block_id in blocks:
                (loaded if self._load_one(key, block_id, ticket, counts) else failed).append(key)
            if loaded:
                self._files.index.observe_many(loaded, self.file_size, ticket)
                self._read_failures.clear(loaded)
        counts["blocks_loaded"] += len(loaded)
        counts["load_failures"] += len(failed)
        self._files.counters.add(counts)
        return failed

    def _load_batch(
        self, blocks: Sequence[tuple[OffloadKey, int]], loaded: list[OffloadKey]
    ) -> list[tuple[OffloadKey, int]]:
        """Read ``blocks`` with one batched call and verify each read whole; append the keys
        verified to ``loaded``. Returns the rest, for ``_load_one`` to read again and decide
        about (a file missing, of the wrong kind or size, corrupt, not authenticated, or an
        error: the Python path's logging, counting and deletions apply to them unchanged)."""
        assert self._native is not None
        row_bytes = self._files.row_bytes
        run_digest = self._files.mapper.run_digest
        paths = [self._files.mapper.block_path(key) for key, _ in blocks]
        headers = self._buffers.many(len(blocks))
        rows = [self._rows[b * row_bytes : (b + 1) * row_bytes] for _, b in blocks]
        try:
            codes = self._native.read_files(
                self._files.rank_fd,
                [(p.dir1, p.dir2, p.name) for p in paths],
                headers,
                rows,
                self._o_direct,
            )
            rest = []
            for i, ((key, block_id), row, code) in enumerate(zip(blocks, rows, codes, strict=True)):
                if code == 0:
                    with headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] as header:
                        try:
                            verify_parts(
                                header, row, key=key, run_digest=run_digest,
                                integrity=self._integrity,
                            )  # fmt: skip
                        except (BlockFileCorrupt, BlockNotAuthenticated):
                            pass
                        else:
                            loaded.append(key)
                            continue
                rest.append((key, block_id))
            return rest
        finally:
            for row in rows:
                row.release()
            headers.release()

    def unpin(self, blocks: Sequence[tuple[OffloadKey, int]]) -> None:
        """The loads of these blocks ended: they may be evicted again."""
        self._files.index.unpin(key for key, _ in blocks)

    def _load_one(self, key: OffloadKey, block_id: int, ticket: int, counts: Counter[str]) -> bool:
        path = self._files.mapper.block_path(key)
        try:
            leaf_fd = open_block_dir(self._files.rank_fd, path)
        except FileNotFoundError:
            # Its directory is gone, so is the file: forget its failures, as below.
            self._read_failures.clear((key,))
            self._files.index.observe(key, None, ticket, hot=False)
            return False
        except OSError as e:
            # E.g. a symlink planted in the path: bounded retries, as for the file.
            self._read_failed(None, key, path, e, counts)
            return False
        try:
            with self._row(block_id) as row:
                read_block_file(
                    leaf_fd,
                    path.name,
                    self._buffers.header,
                    row,
                    key=key,
                    run_digest=self._files.mapper.run_digest,
                    o_direct=self._o_direct,
                    integrity=self._integrity,
                )
        except FileNotFoundError:
            self._read_failures.clear((key,))
            self._files.index.observe(key, None, ticket, hot=False)
            return False
        except BlockFileCorrupt as e:
            forged = isinstance(e, BlockForged)
            self._log(
                logging.WARNING,
                "forged" if forged else "corrupt",
                "fs tier: block file %s %s (%s); deleting it",
                path.rel,
                "failed authentication" if forged else "is invalid",
                e.reason,
            )
            self._read_failures.clear((key,))
            counter = "forged_removed" if forged else "corrupt_removed"
            self._remover.remove(key, path, e.file_id, counter, leaf_fd=leaf_fd)
            return False
        except BlockNotAuthenticated as e:
            # Written before the fleet had its secret, or under another one: never served, but
            # kept (its owner may read it) until it is evicted first or the next store of the
            # block replaces it.
            self._log(
                logging.WARNING,
                "unauthenticated",
                "fs tier: block file %s is not authenticated with the fleet's key (%s); it is "
                "not served, and the next store of the block replaces it",
                path.rel,
                e.reason,
            )
            counts["unauthenticated_misses"] += 1
            if self._read_failures.give_up(key, self._file_identity(leaf_fd, path)):
                self._files.index.demote(key)
            return False
        except OSError as e:
            self._read_failed(leaf_fd, key, path, e, counts)
            return False
        finally:
            os.close(leaf_fd)
        return True

    def _file_identity(self, leaf_fd: int | None, path: BlockPath) -> FileId | None:
        """The identity of ``path``'s file now; None if it cannot be told."""
        try:
            st = None if leaf_fd is None else regular_file_stat(leaf_fd, path.name)
        except OSError:
            st = None
        return None if st is None else file_identity(st)

    def _read_failed(
        self,
        leaf_fd: int | None,
        key: OffloadKey,
        path: BlockPath,
        e: OSError,
        counts: Counter[str],
    ) -> None:
        """A transient error ``e`` failed a read of ``key``'s file (``leaf_fd`` None: its
        directory could not be opened): log it, count it, maybe give the file up."""
        self._log_os_error("load", key, e)
        # A file that cannot be told apart is counted against the one that failed before.
        if not self._read_failures.failed(key, self._file_identity(leaf_fd, path)):
            return
        self._files.index.demote(key)
        counts["reads_given_up"] += 1
        self._log(
            logging.WARNING,
            "given_up",
            "fs tier: block file %s failed %d reads in a row; no longer served (lookups miss, "
            "it is evicted first, the next store of the block replaces it)",
            path.rel,
            self._read_failures.limit,
        )

    # -----------------------------------------------------------------------------------------
    # Probe (lookup thread)
    # -----------------------------------------------------------------------------------------

    def given_up(self, key: OffloadKey) -> bool:
        """Whether ``key``'s file failed ``max_read_failures`` reads in a row, or is not
        authenticated (no system call)."""
        return self._read_failures.given_up(key)

    def probe(self, key: OffloadKey) -> bool:
        """Whether ``key``'s file looks loadable: a regular file of the right size, below real
        directories, not given up. The file's contents are verified by the load."""
        path = self._files.mapper.block_path(key)
        ticket = self._files.index.ticket()
        rank_fd = self._files.rank_fd
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
            self._files.index.observe(key, None, ticket, hot=False)
            return False
        except OSError as e:
            self._log(logging.WARNING, "probe", "fs tier: cannot stat %s: %s", path.rel, e)
            return False
        if st.st_size != self.file_size:
            try:
                leaf_fd = open_block_dir(rank_fd, path)
            except OSError as e:
                self._log(logging.WARNING, "probe", "fs tier: cannot open %s: %s", path.rel, e)
                return False
            try:
                self._read_failures.clear((key,))
                self._remover.remove_wrong_size(leaf_fd, key, path, st)
            finally:
                os.close(leaf_fd)
            return False
        if self._read_failures.given_up(key, file_identity(st)):
            # Still accounted (it occupies the disk), left where it is in the LRU order.
            self._files.index.observe(key, st.st_size, ticket, hot=False)
            return False
        return self._files.index.observe(key, st.st_size, ticket, hot=True)

    # -----------------------------------------------------------------------------------------
    # Helpers
    # -----------------------------------------------------------------------------------------

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
