"""One host-memory region per engine instance, shared by the scheduler and every worker.

The CPU primary tier keeps offloaded KV blocks in a single file-backed mapping (by default on the
``/dev/shm`` tmpfs) so that the scheduler process, each GPU worker process and the secondary tiers
all address the same bytes without copies.

Layout (``M = num_workers``, ``S = worker_page_bytes``, ``A = BLOCK_SIZE_ALIGNMENT``)::

    row b (b in [0, num_blocks)), row_bytes = round_up(M * S, A) bytes, starting at b * row_bytes
    +-----------------+-----------------+-----+---------------------+-----+
    | worker 0 slot   | worker 1 slot   | ... | worker M-1 slot     | pad |
    | S bytes         | S bytes         |     | S bytes             |     |
    +-----------------+-----------------+-----+---------------------+-----+

    total_bytes = num_blocks * row_bytes

Within a worker's slot, the per-block pages of the worker's KV tensors follow one another in the
order of ``create_next_worker_view`` calls.

Ownership and protection:

* Worker ``r`` writes only bytes of its own slot ``[r * S, (r + 1) * S)`` of a row, and only for
  rows the scheduler handed it in a store job. Workers never touch the padding.
* Secondary tiers read or write *whole rows* (every worker's slot of a block at once), and only the
  rows named by a job the scheduler-side manager issued; the manager guarantees that no worker is
  storing into, and no tier is writing, a row that someone else reads or writes at the same time.
* The creator (the first process to arrive) owns the file: it sizes it and unlinks it in
  ``cleanup()``. Joiners only map it. Unlinking does not invalidate mappings still held by peers.
* Nothing here locks: the region is plain shared memory and the scheduler's block bookkeeping is
  the only synchronisation.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import operator
import os
import re
import stat
import sys
import time

import numpy as np
import torch
from typing_extensions import override

from vllm.utils.closing import ClosingContextManager

logger = logging.getLogger(__name__)

_INSTANCE_ID_RE = re.compile(r"[A-Za-z0-9_.-]+")
_FILE_PREFIX = "vllm_offload_"
_FILE_SUFFIX = ".mmap"
# Longest name most filesystems accept (NAME_MAX).
_MAX_FILE_NAME = 255
_MAX_INSTANCE_ID_LEN = _MAX_FILE_NAME - len(_FILE_PREFIX) - len(_FILE_SUFFIX)

_JOIN_POLL_INTERVAL_S = 0.005

# MADV_POPULATE_WRITE (Linux >= 5.14) faults pages in writable without writing to them, so it is
# race-free against peers that already store into the region. Older Pythons do not expose the
# constant, hence the literal (the Linux UAPI value).
_MADV_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
# Rows touched per vectorised chunk by the fallback pre-fault (bounds its temporary memory).
_PREFAULT_CHUNK_ELEMS = 1 << 20


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _positive_int(name: str, value: int) -> int:
    """Return ``value`` as an int if it is an integer (not a bool) > 0, else raise ValueError."""
    if not isinstance(value, bool):
        try:
            as_int = operator.index(value)
        except TypeError:
            pass
        else:
            if as_int > 0:
                return as_int
    raise ValueError(f"{name} must be an integer > 0, got {value!r}")


class SharedOffloadRegion(ClosingContextManager):
    """A ``MAP_SHARED`` file mapping holding ``num_blocks`` rows of offloaded KV data.

    Every process of an engine instance constructs one over the same file: the scheduler with
    ``rank=None`` and each worker with its rank. Whoever creates the file first (``O_EXCL``) is the
    creator; the others join and wait until the creator has sized it.

    Args:
        instance_id: engine-instance id (unique per DP replica); only ``[A-Za-z0-9_.-]`` so the
            file name cannot leave ``directory``.
        num_blocks: number of rows (offloaded blocks), > 0.
        worker_page_bytes: bytes of one worker's slot in a row, > 0.
        num_workers: number of worker slots per row (the TP/PP world size), > 0.
        rank: the worker's rank in ``[0, num_workers)``, or None for the scheduler side.
        directory: where the backing file lives; a tmpfs such as ``/dev/shm`` keeps it in RAM.
        join_timeout_s: how long a joiner waits for the creator to size the file.
        prefault: fault the pages in up front (a worker its own slot of every row, the scheduler
            the whole region) so the first transfers do not pay for page faults.

    Raises:
        ValueError: invalid arguments, or an existing file larger than this geometry.
        OSError: the directory lacks free space (``ENOSPC``) or any system call failed.
        TimeoutError: a joiner waited ``join_timeout_s`` without the file reaching its size.

    Not thread-safe: one owner per object. Code that registered ``base_ptr`` with the CUDA driver
    (``cudaHostRegister``) must unregister it before calling ``cleanup()``.
    """

    BLOCK_SIZE_ALIGNMENT: int = mmap.PAGESIZE
    """Rows are padded to a multiple of the page size, keeping O_DIRECT tier I/O aligned."""

    def __init__(
        self,
        instance_id: str,
        num_blocks: int,
        worker_page_bytes: int,
        num_workers: int = 1,
        rank: int | None = None,
        directory: str | os.PathLike[str] = "/dev/shm",
        join_timeout_s: float = 30.0,
        *,
        prefault: bool = True,
    ) -> None:
        # Set first so cleanup()/__del__ work whatever fails below.
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._memoryviews: list[memoryview] = []
        self._is_creator = False
        self._closed = False
        self._owner_pid = os.getpid()
        self._worker_offset = 0
        self._base_ptr = 0
        self._path = ""

        num_blocks = _positive_int("num_blocks", num_blocks)
        worker_page_bytes = _positive_int("worker_page_bytes", worker_page_bytes)
        num_workers = _positive_int("num_workers", num_workers)
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_workers:
                raise ValueError(
                    f"rank must be None or an integer in [0, {num_workers}), got {rank!r}"
                )
            rank = int(rank)
        if not join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be > 0, got {join_timeout_s!r}")

        self._path = self.region_path(instance_id, directory)
        self._directory = os.fspath(directory)
        self._num_blocks = num_blocks
        self._worker_page_bytes = worker_page_bytes
        self._num_workers = num_workers
        self._rank = rank
        self._row_bytes = _round_up(num_workers * worker_page_bytes, self.BLOCK_SIZE_ALIGNMENT)
        self._total_bytes = num_blocks * self._row_bytes

        try:
            self._open(join_timeout_s)
            assert self._fd is not None
            self._mm = mmap.mmap(
                self._fd,
                self._total_bytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
            if prefault:
                self._prefault()
            # The base tensor keeps a reference to the mmap object, so the mapping outlives any
            # view handed out even if the caller keeps one past cleanup().
            self._base = torch.frombuffer(self._mm, dtype=torch.int8)
            self._base_ptr = self._base.data_ptr()
        except BaseException:
            self.cleanup()
            raise

    # -----------------------------------------------------------------------------------------
    # Creation / joining
    # -----------------------------------------------------------------------------------------

    @staticmethod
    def region_path(instance_id: str, directory: str | os.PathLike[str] = "/dev/shm") -> str:
        """Return the backing-file path of ``instance_id`` in ``directory``.

        Raises:
            ValueError: ``instance_id`` is empty, too long, or has a character outside
                ``[A-Za-z0-9_.-]``.
        """
        if not isinstance(instance_id, str) or not _INSTANCE_ID_RE.fullmatch(instance_id):
            raise ValueError(
                f"instance_id={instance_id!r} is invalid: expected a non-empty string of "
                "[A-Za-z0-9_.-] characters"
            )
        if len(instance_id) > _MAX_INSTANCE_ID_LEN:
            raise ValueError(
                f"instance_id={instance_id!r} is too long: at most {_MAX_INSTANCE_ID_LEN} "
                "characters"
            )
        return os.path.join(os.fspath(directory), f"{_FILE_PREFIX}{instance_id}{_FILE_SUFFIX}")

    def _open(self, join_timeout_s: float) -> None:
        if not os.path.isdir(self._directory):
            raise FileNotFoundError(
                errno.ENOENT,
                f"shared region directory {self._directory!r} does not exist or is not a directory",
            )
        deadline = time.monotonic() + join_timeout_s
        while True:
            try:
                self._fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            except FileExistsError:
                pass
            else:
                self._is_creator = True
                self._size_as_creator()
                return
            try:
                self._fd = os.open(self._path, os.O_RDWR)
            except FileNotFoundError:
                # A failed creator unlinked the file between our two opens: race to create it.
                self._check_deadline(deadline, join_timeout_s, size=None)
                continue
            if self._wait_for_size(deadline, join_timeout_s):
                return
            # The creator failed and unlinked the file we opened: start over on a fresh one.
            os.close(self._fd)
            self._fd = None

    def _check_deadline(self, deadline: float, join_timeout_s: float, size: int | None) -> None:
        if time.monotonic() < deadline:
            return
        seen = "it never appeared" if size is None else f"its size is {size}"
        raise TimeoutError(
            f"timed out after {join_timeout_s} s waiting for the creator of shared region "
            f"{self._path!r} to size it to {self._total_bytes} bytes ({seen}); the creator may "
            "have died, or a stale file is in the way"
        )

    def _size_as_creator(self) -> None:
        assert self._fd is not None
        st = os.statvfs(self._directory)
        available = st.f_bavail * st.f_frsize
        if available < self._total_bytes:
            raise OSError(
                errno.ENOSPC,
                f"not enough free space in {self._directory!r} for shared region "
                f"{self._path!r}: needed {self._total_bytes} bytes, available {available} bytes",
            )
        os.ftruncate(self._fd, self._total_bytes)

    def _wait_for_size(self, deadline: float, join_timeout_s: float) -> bool:
        """Wait until the creator sized the file; False if it unlinked the file instead."""
        assert self._fd is not None
        while True:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"shared region {self._path!r} is not a regular file")
            if st.st_size == self._total_bytes:
                return True
            if st.st_size > self._total_bytes:
                raise ValueError(
                    f"shared region {self._path!r} has {st.st_size} bytes but this geometry "
                    f"needs {self._total_bytes} (num_blocks={self._num_blocks}, "
                    f"row_bytes={self._row_bytes}): a stale or foreign file; remove it or use "
                    "another instance id"
                )
            try:
                current = os.stat(self._path)
            except FileNotFoundError:
                return False
            if (current.st_dev, current.st_ino) != (st.st_dev, st.st_ino):
                return False
            self._check_deadline(deadline, join_timeout_s, size=st.st_size)
            # Another process sizes the file: no event to wait on across processes, so poll.
            time.sleep(_JOIN_POLL_INTERVAL_S)

    # -----------------------------------------------------------------------------------------
    # Pre-faulting
    # -----------------------------------------------------------------------------------------

    def _prefault(self) -> None:
        """Fault in the pages this process will touch, preserving every byte already written."""
        assert self._mm is not None
        page = self.BLOCK_SIZE_ALIGNMENT
        if self._rank is None:
            # Whole rows: one contiguous range.
            row_lo, row_hi = 0, self._row_bytes
        else:
            slot_lo = self._rank * self._worker_page_bytes
            row_lo = slot_lo // page * page
            row_hi = _round_up(slot_lo + self._worker_page_bytes, page)
        if self._madvise_populate(row_lo, row_hi):
            return
        self._touch_pages()

    def _madvise_populate(self, row_lo: int, row_hi: int) -> bool:
        """Populate ``[row_lo, row_hi)`` of every row (page-aligned); False if unsupported.

        Other failures (e.g. the tmpfs cannot back the pages) raise: the fallback would instead
        die of SIGBUS on the first touch of a page that cannot be allocated.
        """
        assert self._mm is not None
        if _MADV_POPULATE_WRITE is None or not hasattr(self._mm, "madvise"):
            return False
        if row_lo == 0 and row_hi == self._row_bytes:
            ranges = [(0, self._total_bytes)]
        else:
            ranges = [
                (b * self._row_bytes + row_lo, row_hi - row_lo) for b in range(self._num_blocks)
            ]
        for start, length in ranges:
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE, start, length)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    logger.debug("MADV_POPULATE_WRITE unsupported (%s); touching pages", e)
                    return False
                raise OSError(
                    e.errno,
                    f"could not pre-fault shared region {self._path!r} "
                    f"({self._total_bytes} bytes): {e.strerror}; is {self._directory!r} full?",
                ) from e
        return True

    def _touch_pages(self) -> None:
        """Fallback pre-fault: touch one byte of each page this process uses.

        A worker rewrites (read-modify-write with the same value) one byte *of its own slot* per
        page, so it can never clobber a byte a peer writes concurrently. The scheduler only reads
        one byte per page: that allocates the page without any write, so it cannot race with
        workers already storing; the remaining write fault later is a cheap permission upgrade.
        """
        assert self._mm is not None
        page = self.BLOCK_SIZE_ALIGNMENT
        if self._rank is None:
            in_row = np.arange(0, self._row_bytes, page, dtype=np.int64)
        else:
            slot_lo = self._rank * self._worker_page_bytes
            slot_hi = slot_lo + self._worker_page_bytes
            # Rows start page-aligned, so the offsets within a row are the same for every row:
            # the slot's first byte, then the first byte of each later page inside the slot.
            in_row = np.concatenate(
                [
                    np.array([slot_lo], dtype=np.int64),
                    np.arange(_round_up(slot_lo + 1, page), slot_hi, page, dtype=np.int64),
                ]
            )
        arr = np.frombuffer(self._mm, dtype=np.uint8)
        try:
            rows_per_chunk = max(1, _PREFAULT_CHUNK_ELEMS // len(in_row))
            for first in range(0, self._num_blocks, rows_per_chunk):
                rows = np.arange(
                    first, min(first + rows_per_chunk, self._num_blocks), dtype=np.int64
                )
                idx = (rows[:, None] * self._row_bytes + in_row[None, :]).ravel()
                if self._rank is None:
                    arr.take(idx)  # the gather reads, hence faults in, every page
                else:
                    arr[idx] = arr[idx]
        finally:
            del arr

    # -----------------------------------------------------------------------------------------
    # Views
    # -----------------------------------------------------------------------------------------

    def _require_open(self) -> mmap.mmap:
        if self._mm is None or self._closed:
            raise RuntimeError(f"shared region {self._path!r} is closed")
        return self._mm

    def create_kv_memoryview(self) -> memoryview:
        """Return a zero-copy byte view of the whole region, one row per block.

        Layout: format ``"B"``, shape ``(num_blocks, row_bytes)``, C-contiguous; row ``b`` holds
        every worker's slot of block ``b`` followed by padding. For the scheduler side and
        secondary tiers, which move whole rows named by their jobs.

        The view is released by ``cleanup()``; using it afterwards raises ``ValueError``.
        """
        mm = self._require_open()
        flat = memoryview(mm)
        view = flat.cast("B", (self._num_blocks, self._row_bytes))
        self._memoryviews += [view, flat]
        return view

    def create_next_worker_view(self, tensor_page_bytes: int) -> torch.Tensor:
        """Return the next per-block page view inside this worker's slot.

        Layout: ``int8`` tensor of shape ``(num_blocks, tensor_page_bytes)``, stride
        ``(row_bytes, 1)`` and storage offset ``rank * worker_page_bytes + o``, where ``o`` is
        the sum of the ``tensor_page_bytes`` of earlier calls. ``int8`` makes strides and offsets
        byte counts, so callers need no dtype arithmetic. Only this worker may write these bytes.

        Raises:
            ValueError: ``tensor_page_bytes`` is not > 0, or the view would overrun the slot.
            RuntimeError: called on the scheduler side (``rank is None``) or after ``cleanup()``.
        """
        self._require_open()
        if self._rank is None:
            raise RuntimeError("create_next_worker_view needs a worker region (rank is None)")
        tensor_page_bytes = _positive_int("tensor_page_bytes", tensor_page_bytes)
        end = self._worker_offset + tensor_page_bytes
        if end > self._worker_page_bytes:
            raise ValueError(
                f"tensor_page_bytes={tensor_page_bytes} at offset {self._worker_offset} overruns "
                f"worker {self._rank}'s slot of {self._worker_page_bytes} bytes "
                f"({self._worker_page_bytes - self._worker_offset} bytes left)"
            )
        assert self._base is not None
        view = torch.as_strided(
            self._base,
            (self._num_blocks, tensor_page_bytes),
            (self._row_bytes, 1),
            self._rank * self._worker_page_bytes + self._worker_offset,
        )
        self._worker_offset = end
        self._views.append(view)
        return view

    # -----------------------------------------------------------------------------------------
    # Properties
    # -----------------------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """Path of the backing file."""
        return self._path

    @property
    def num_blocks(self) -> int:
        """Number of rows (offloaded blocks)."""
        return self._num_blocks

    @property
    def row_bytes(self) -> int:
        """Bytes per row: ``round_up(num_workers * worker_page_bytes, BLOCK_SIZE_ALIGNMENT)``."""
        return self._row_bytes

    @property
    def worker_page_bytes(self) -> int:
        """Bytes of one worker's slot in a row."""
        return self._worker_page_bytes

    @property
    def num_workers(self) -> int:
        """Number of worker slots per row."""
        return self._num_workers

    @property
    def rank(self) -> int | None:
        """This worker's rank, or None on the scheduler side."""
        return self._rank

    @property
    def total_bytes(self) -> int:
        """Size of the mapping: ``num_blocks * row_bytes``."""
        return self._total_bytes

    @property
    def is_creator(self) -> bool:
        """Whether this object created (and so will unlink) the backing file."""
        return self._is_creator

    @property
    def base_ptr(self) -> int:
        """Virtual address of the mapping in this process (e.g. for ``cudaHostRegister``)."""
        self._require_open()
        return self._base_ptr

    @property
    def closed(self) -> bool:
        """Whether ``cleanup()`` ran."""
        return self._closed

    # -----------------------------------------------------------------------------------------
    # Teardown
    # -----------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Release the mapping and the file descriptor; the creator also unlinks the file.

        Idempotent. Views handed out by this object are dropped first. If a caller still holds
        a tensor over the region (torch keeps the mmap object alive through it), the mapping is
        not closed explicitly, which would leave that tensor dangling: it is unmapped when the
        last such reference goes away. Only the creating process unlinks, so a forked child that
        inherits the object cannot remove a file its parent still serves.
        """
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        self._base = None
        for view in self._memoryviews:
            try:
                view.release()
            except BufferError:
                logger.warning(
                    "a buffer exported from a memoryview of %s is still alive; the mapping is "
                    "released when it is",
                    self._path,
                )
        self._memoryviews.clear()
        mm, self._mm = self._mm, None
        if mm is not None:
            # Our local and getrefcount's argument: any other reference is a live tensor storage
            # or memoryview over the mapping, which mm.close() would leave dangling.
            if sys.getrefcount(mm) <= 2:
                mm.close()
            else:
                logger.warning(
                    "tensors over %s are still alive after cleanup(); the mapping is unmapped "
                    "when they are released",
                    self._path,
                )
            del mm
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if self._is_creator and os.getpid() == self._owner_pid:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)

    @override
    def _release(self) -> None:
        self.cleanup()

    def __del__(self) -> None:
        # Safety net only; owners call cleanup(). Must never raise (interpreter shutdown included).
        try:
            if not getattr(self, "_closed", True):
                self.cleanup()
        except Exception:
            pass

    @override
    def __repr__(self) -> str:
        return (
            f"SharedOffloadRegion(path={self._path!r}, num_blocks={self._num_blocks}, "
            f"row_bytes={self._row_bytes}, worker_page_bytes={self._worker_page_bytes}, "
            f"num_workers={self._num_workers}, rank={self._rank}, "
            f"is_creator={self._is_creator}, closed={self._closed})"
        )
