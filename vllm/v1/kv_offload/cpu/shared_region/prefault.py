# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Pre-faulting a shared region's pages without disturbing bytes peers already wrote.

A worker faults in its own slot of every row, the scheduler side the whole region, so the first
transfers do not pay for page faults. ``MADV_POPULATE_WRITE`` is used where the kernel has it;
otherwise pages are touched one byte at a time in a way that cannot race with peers' stores.
"""

from __future__ import annotations

import errno
import mmap
import sys

import numpy as np

from vllm.logger import init_logger
from vllm.v1.kv_offload.cpu.shared_region.trailer import RegionGeometry, round_up

logger = init_logger(__name__)

# MADV_POPULATE_WRITE (Linux >= 5.14) faults pages in writable without writing to them, so it is
# race-free against peers that already store into the region. Older Pythons do not expose the
# constant, hence the literal (the Linux UAPI value).
MADV_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
# Rows touched per vectorised chunk by the fallback pre-fault (bounds its temporary memory).
PREFAULT_CHUNK_ELEMS = 1 << 20


def prefault(
    mm: mmap.mmap, geometry: RegionGeometry, rank: int | None, page: int, path: str, directory: str
) -> None:
    """Fault in the pages participant ``rank`` will touch, preserving every byte already written.

    ``page`` is the page size rows are aligned to; ``path`` and ``directory`` only name the
    region in errors.
    """
    if rank is None:
        # Whole rows: one contiguous range.
        row_lo, row_hi = 0, geometry.row_bytes
    else:
        slot_lo = rank * geometry.worker_page_bytes
        row_lo = slot_lo // page * page
        row_hi = round_up(slot_lo + geometry.worker_page_bytes, page)
    if _madvise_populate(mm, geometry, row_lo, row_hi, path, directory):
        return
    _touch_pages(mm, geometry, rank, page)


def _madvise_populate(
    mm: mmap.mmap, geometry: RegionGeometry, row_lo: int, row_hi: int, path: str, directory: str
) -> bool:
    """Populate ``[row_lo, row_hi)`` of every row (page-aligned); False if unsupported.

    Other failures (e.g. the tmpfs cannot back the pages) raise: the fallback would instead
    die of SIGBUS on the first touch of a page that cannot be allocated.
    """
    if MADV_POPULATE_WRITE is None or not hasattr(mm, "madvise"):
        return False
    if row_lo == 0 and row_hi == geometry.row_bytes:
        ranges = [(0, geometry.total_bytes)]
    else:
        ranges = [
            (b * geometry.row_bytes + row_lo, row_hi - row_lo) for b in range(geometry.num_blocks)
        ]
    for start, length in ranges:
        try:
            mm.madvise(MADV_POPULATE_WRITE, start, length)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                logger.debug("MADV_POPULATE_WRITE unsupported (%s); touching pages", e)
                return False
            raise OSError(
                e.errno,
                f"could not pre-fault shared region {path!r} "
                f"({geometry.total_bytes} bytes): {e.strerror}; is {directory!r} full?",
            ) from e
    return True


def _touch_pages(mm: mmap.mmap, geometry: RegionGeometry, rank: int | None, page: int) -> None:
    """Fallback pre-fault: touch one byte of each page participant ``rank`` uses.

    A worker rewrites (read-modify-write with the same value) one byte *of its own slot* per
    page, so it can never clobber a byte a peer writes concurrently. The scheduler only reads
    one byte per page: that allocates the page without any write, so it cannot race with
    workers already storing; the remaining write fault later is a cheap permission upgrade.
    """
    row_bytes, num_blocks = geometry.row_bytes, geometry.num_blocks
    if rank is None:
        in_row = np.arange(0, row_bytes, page, dtype=np.int64)
    else:
        slot_lo = rank * geometry.worker_page_bytes
        slot_hi = slot_lo + geometry.worker_page_bytes
        # Rows start page-aligned, so the offsets within a row are the same for every row:
        # the slot's first byte, then the first byte of each later page inside the slot.
        in_row = np.concatenate(
            [
                np.array([slot_lo], dtype=np.int64),
                np.arange(round_up(slot_lo + 1, page), slot_hi, page, dtype=np.int64),
            ]
        )
    arr = np.frombuffer(mm, dtype=np.uint8)
    try:
        rows_per_chunk = max(1, PREFAULT_CHUNK_ELEMS // len(in_row))
        for first in range(0, num_blocks, rows_per_chunk):
            rows = np.arange(first, min(first + rows_per_chunk, num_blocks), dtype=np.int64)
            idx = (rows[:, None] * row_bytes + in_row[None, :]).ravel()
            if rank is None:
                arr.take(idx)  # the gather reads, hence faults in, every page
            else:
                arr[idx] = arr[idx]
    finally:
        del arr
