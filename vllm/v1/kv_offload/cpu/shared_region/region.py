# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
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

    total_bytes = num_blocks * row_bytes (what is mapped), then a metadata area of whole pages
    (join marks and trailer; see ``trailer``).

Within a worker's slot, the per-block pages of the worker's KV tensors follow one another in the
order of ``create_next_worker_view`` calls, or sit where ``create_worker_view`` puts them (per-group
rows: each KV-cache group's pages from offset 0, aliasing the other groups').

This module holds the region itself (mapping, rows, slots, views, teardown); the rest of the
package (``vllm.v1.kv_offload.cpu.shared_region``) holds the geometry and trailer (``trailer``),
the files' names (``files``), the creators' identities (``process_identity``), the sweep of dead
creators' files (``sweep``), creating or joining the file under its lock (``publish``) and
prefaulting (``prefault``).

Lifetime: nothing of a dead process may stay in the directory (the region is the whole CPU tier,
gigabytes of RAM on a tmpfs that no reboot-less process frees). The creator publishes a complete
file under the region's name; the participant that completes the set of joiners removes the name,
so from then on the file lives only as long as some participant maps it, even if every process is
``SIGKILL`` ed; before that, every start sweeps the files of dead creators (``publish``, ``sweep``).

Ownership and protection:

* Worker ``r`` writes only bytes of its own slot ``[r * S, (r + 1) * S)`` of a row, and only for
  rows the scheduler handed it in a store job. Workers never touch the padding.
* Secondary tiers read or write *whole rows* (every worker's slot of a block at once), and only the
  rows named by a job the scheduler-side manager issued; the manager guarantees that no worker is
  storing into, and no tier is writing, a row that someone else reads or writes at the same time.
* Metadata (join marks) is read and written only under an exclusive ``flock`` of the file, and the
  region's name is only ever unlinked under that lock after checking that it still names the
  same file (so nobody removes a successor's region). The kernel drops the lock of a dead holder.
* The creator also unlinks the name in ``cleanup()`` if it is still there. Unlinking does not
  invalidate mappings still held by peers.
* Nothing locks the rows: the region is plain shared memory and the scheduler's block bookkeeping
  is the only synchronisation.
"""

from __future__ import annotations

import fcntl
import mmap
import operator
import os
import sys

import torch
from typing_extensions import override

import vllm.v1.kv_offload.cpu.shared_region.prefault as page_prefault
from vllm.logger import init_logger
from vllm.utils.closing import ClosingContextManager
from vllm.v1.kv_offload.cpu.shared_region.files import region_path, unlink_if_names
from vllm.v1.kv_offload.cpu.shared_region.publish import open_region
from vllm.v1.kv_offload.cpu.shared_region.trailer import RegionGeometry

__all__ = ["SharedOffloadRegion"]

logger = init_logger(__name__)


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
    ``rank=None`` (if ``expect_scheduler``) and each worker with its rank. Whoever publishes the
    file first is the creator; the others join it. Once every participant joined, the file's
    name is removed (see ``publish``), so the region's memory is freed when the last
    participant unmaps it, however the processes end.

    Args:
        instance_id: engine-instance id (unique per DP replica); only ``[A-Za-z0-9_.-]`` so the
            file name cannot leave ``directory``.
        num_blocks: number of rows (offloaded blocks), > 0.
        worker_page_bytes: bytes of one worker's slot in a row, > 0.
        num_workers: number of worker slots per row (the TP/PP world size), > 0.
        rank: the worker's rank in ``[0, num_workers)``, or None for the scheduler side.
        directory: where the backing file lives; a tmpfs such as ``/dev/shm`` keeps it in RAM.
        join_timeout_s: how long to keep retrying when the file vanishes under a joiner (its
            creator gave up) before giving up too.
        expect_scheduler: whether the scheduler side (``rank=None``) maps the region too, besides
            every worker rank; the same for every participant (it is recorded by the creator and
            checked by joiners). The name is removed once all expected participants joined.
        prefault: fault the pages in up front (a worker its own slot of every row, the scheduler
            the whole region) so the first transfers do not pay for page faults.

    Raises:
        ValueError: invalid arguments.
        SharedRegionError: the file under the region's name belongs to a dead creator, was made
            for another geometry or participant set, is not a region of this format, or already
            has a participant of this rank.
        OSError: the directory lacks free space (``ENOSPC``) or any system call failed.
        TimeoutError: the file kept vanishing under this joiner for ``join_timeout_s``.

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
        expect_scheduler: bool = True,
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
        if rank is None and not expect_scheduler:
            raise ValueError("the scheduler side (rank=None) needs expect_scheduler=True")

        self._path = self.region_path(instance_id, directory)
        self._directory = os.fspath(directory)
        self._num_blocks = num_blocks
        self._worker_page_bytes = worker_page_bytes
        self._num_workers = num_workers
        self._rank = rank
        self._expect_scheduler = bool(expect_scheduler)
        self._geometry = RegionGeometry.compute(
            num_blocks, worker_page_bytes, num_workers, expect_scheduler, self.BLOCK_SIZE_ALIGNMENT
        )
        self._row_bytes = self._geometry.row_bytes
        self._total_bytes = self._geometry.total_bytes
        self._file_bytes = self._geometry.file_bytes

        try:
            self._fd, self._is_creator = open_region(
                self._path, self._directory, self._geometry, rank, join_timeout_s
            )
            self._mm = mmap.mmap(
                self._fd,
                self._total_bytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
            if prefault:
                page_prefault.prefault(
                    self._mm,
                    self._geometry,
                    rank,
                    self.BLOCK_SIZE_ALIGNMENT,
                    self._path,
                    self._directory,
                )
            # The base tensor keeps a reference to the mmap object, so the mapping outlives any
            # view handed out even if the caller keeps one past cleanup().
            self._base = torch.frombuffer(self._mm, dtype=torch.int8)
            self._base_ptr = self._base.data_ptr()
        except BaseException:
            self.cleanup()
            raise

    # -----------------------------------------------------------------------------------------
    # Naming
    # -----------------------------------------------------------------------------------------

    @staticmethod
    def region_path(instance_id: str, directory: str | os.PathLike[str] = "/dev/shm") -> str:
        """Return the backing-file path of ``instance_id`` in ``directory``.

        Raises:
            ValueError: ``instance_id`` is empty, too long, or has a character outside
                ``[A-Za-z0-9_.-]``.
        """
        return region_path(instance_id, directory)

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
        the sum of the ``tensor_page_bytes`` of earlier calls (``create_worker_view`` calls do
        not move it). ``int8`` makes strides and offsets byte counts, so callers need no dtype
        arithmetic. Only this worker may write these bytes.

        Raises:
            ValueError: ``tensor_page_bytes`` is not > 0, or the view would overrun the slot.
            RuntimeError: called on the scheduler side (``rank is None``) or after ``cleanup()``.
        """
        view = self.create_worker_view(self._worker_offset, tensor_page_bytes)
        self._worker_offset += int(view.shape[1])
        return view

    def create_worker_view(self, slot_offset: int, tensor_page_bytes: int) -> torch.Tensor:
        """Return the per-block page view at byte ``slot_offset`` of this worker's slot.

        For layouts whose views alias one another (``RowLayout.PER_GROUP``: every KV-cache
        group's tensors start at offset 0 of the slot, since a row holds one group's block);
        which views may alias is the caller's to decide, this only keeps each view inside the
        slot.

        Layout: ``int8`` tensor of shape ``(num_blocks, tensor_page_bytes)``, stride
        ``(row_bytes, 1)`` and storage offset ``rank * worker_page_bytes + slot_offset``. Only
        this worker may write these bytes.

        Raises:
            ValueError: ``slot_offset`` is negative, ``tensor_page_bytes`` is not > 0, or the
                view would overrun the slot.
            RuntimeError: called on the scheduler side (``rank is None``) or after ``cleanup()``.
        """
        self._require_open()
        if self._rank is None:
            raise RuntimeError("worker views need a worker region (rank is None)")
        tensor_page_bytes = _positive_int("tensor_page_bytes", tensor_page_bytes)
        if isinstance(slot_offset, bool) or operator.index(slot_offset) < 0:
            raise ValueError(f"slot_offset must be an integer >= 0, got {slot_offset!r}")
        slot_offset = operator.index(slot_offset)
        end = slot_offset + tensor_page_bytes
        if end > self._worker_page_bytes:
            raise ValueError(
                f"tensor_page_bytes={tensor_page_bytes} at offset {slot_offset} overruns "
                f"worker {self._rank}'s slot of {self._worker_page_bytes} bytes "
                f"({max(self._worker_page_bytes - slot_offset, 0)} bytes left)"
            )
        assert self._base is not None
        view = torch.as_strided(
            self._base,
            (self._num_blocks, tensor_page_bytes),
            (self._row_bytes, 1),
            self._rank * self._worker_page_bytes + slot_offset,
        )
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
    def file_bytes(self) -> int:
        """Size of the backing file: ``total_bytes`` plus the metadata pages (not mapped)."""
        return self._file_bytes

    @property
    def expect_scheduler(self) -> bool:
        """Whether the scheduler side is one of the region's participants."""
        return self._expect_scheduler

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
            if self._is_creator and os.getpid() == self._owner_pid:
                # Under the lock, and only if the name is still ours (it is gone already once
                # every participant joined).
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    unlink_if_names(self._path, os.fstat(fd))
                except OSError as e:
                    logger.warning("could not remove shared region %s: %s", self._path, e)
            os.close(fd)  # also drops the lock

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

    def __repr__(self) -> str:
        return (
            f"SharedOffloadRegion(path={self._path!r}, num_blocks={self._num_blocks}, "
            f"row_bytes={self._row_bytes}, worker_page_bytes={self._worker_page_bytes}, "
            f"num_workers={self._num_workers}, rank={self._rank}, "
            f"is_creator={self._is_creator}, closed={self._closed})"
        )
