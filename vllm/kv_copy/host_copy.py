# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The torch backend of ``copy_blocks``: ``memmove`` between host addresses, on a few threads.

Used when the KV cache itself lives in host memory, as on a CPU-only machine where the "GPU" KV
cache is a CPU tensor. Measured faster than torch's indexing ops for scattered rows
(``index_select`` + ``index_copy_`` copies every byte twice and reached about 1.3 GB/s against
12+ GB/s here; see docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import numpy as np
import numpy.typing as npt

from vllm.kv_copy.regions import IdArray, RegionArray

HOST_COPY_THREADS_ENV: Final = "VLLM_KV_OFFLOAD_HOST_COPY_THREADS"
"""Threads used by the torch backend for large jobs (default ``min(4, cpu_count)``)."""

# Below this many bytes a job is copied on the calling thread only: handing work to another
# thread costs tens of microseconds.
_PARALLEL_MIN_BYTES: Final = 4 << 20
# Bytes per unit of work that the threads claim (see _ChunkedCopies).
_CHUNK_BYTES: Final = 1 << 20

Addresses = npt.NDArray[np.uint64]


def expand_copies(
    regions: RegionArray, src_ids: IdArray, dst_ids: IdArray
) -> tuple[Addresses, Addresses, Addresses]:
    """Expand checked regions into ``(dst_addrs, src_addrs, sizes)``, merging adjacent copies.

    Copy ``i`` moves ``sizes[i]`` bytes from ``src_addrs[i]`` to ``dst_addrs[i]``. Consecutive
    copies whose source and destination ranges both continue the previous copy are merged into it
    (the same bytes move, in fewer calls), exactly as the C library does.
    """
    counts = regions["pair_count"].astype(np.int64)
    live = np.flatnonzero(counts > 0)
    empty = np.zeros(0, dtype=np.uint64)
    if live.size == 0:
        return empty, empty, empty
    counts = counts[live]
    regs = regions[live]
    total = int(counts.sum())
    owner = np.repeat(np.arange(len(regs)), counts)
    first_item = np.cumsum(counts) - counts
    pair = regs["pair_begin"][owner] + (np.arange(total, dtype=np.int64) - first_item[owner])

    def addresses(side: str, ids: IdArray) -> Addresses:
        s = regs[side]
        sub_blocks = s["sub_blocks"][owner]
        i = ids[pair]
        block = (i // sub_blocks).astype(np.uint64)
        sub = (i % sub_blocks).astype(np.uint64)
        return s["base"][owner] + block * s["block_stride"][owner] + sub * s["sub_stride"][owner]

    dst = addresses("dst", dst_ids)
    src = addresses("src", src_ids)
    size = regs["bytes"][owner]
    if total > 1:
        cont = (dst[1:] == dst[:-1] + size[:-1]) & (src[1:] == src[:-1] + size[:-1])
        if cont.any():
            starts = np.flatnonzero(np.concatenate(([True], ~cont)))
            return dst[starts], src[starts], np.add.reduceat(size, starts)
    return dst, src, size


_host_pool: ThreadPoolExecutor | None = None
_host_pool_lock = threading.Lock()


def _host_copy_threads() -> int:
    env = os.environ.get(HOST_COPY_THREADS_ENV)
    if env:
        return max(1, int(env))
    return max(1, min(4, os.cpu_count() or 1))


def _get_host_pool(threads: int) -> ThreadPoolExecutor:
    global _host_pool
    with _host_pool_lock:
        if _host_pool is None:
            _host_pool = ThreadPoolExecutor(
                max_workers=threads - 1, thread_name_prefix="kvo-host-copy"
            )
        return _host_pool


def _memmove_all(dst: list[int], src: list[int], size: list[int]) -> None:
    move = ctypes.memmove  # releases the GIL for the duration of each copy
    for d, s, n in zip(dst, src, size, strict=True):
        move(d, s, n)


class _ChunkedCopies:
    """Copies cut into chunks of about ``_CHUNK_BYTES`` that threads claim one at a time.

    Dynamic claiming keeps every thread busy to the end even when one of them is descheduled (a
    static split would wait for the slowest share); copies larger than a chunk are cut into
    pieces so that one huge copy is shared too.
    """

    def __init__(self, dst: Addresses, src: Addresses, size: Addresses) -> None:
        piece = np.uint64(_CHUNK_BYTES)
        if int(size.max()) > _CHUNK_BYTES:
            pieces = ((size + piece - np.uint64(1)) // piece).astype(np.int64)
            owner = np.repeat(np.arange(len(size)), pieces)
            first = np.cumsum(pieces) - pieces
            offset = (np.arange(len(owner), dtype=np.int64) - first[owner]).astype(
                np.uint64
            ) * piece
            dst, src = dst[owner] + offset, src[owner] + offset
            size = np.minimum(size[owner] - offset, piece)
        ends = np.cumsum(size)
        cuts = np.searchsorted(ends, np.arange(1, int(ends[-1]) // _CHUNK_BYTES + 1) * piece) + 1
        self._bounds = sorted({0, len(size), *(int(c) for c in cuts if 0 < c < len(size))})
        self._dst, self._src, self._size = dst.tolist(), src.tolist(), size.tolist()
        self._next = itertools.count()  # next() on a count is atomic under the GIL

    def run(self) -> None:
        """Claim and copy chunks until none is left."""
        bounds = self._bounds
        while (c := next(self._next)) < len(bounds) - 1:
            a, b = bounds[c], bounds[c + 1]
            _memmove_all(self._dst[a:b], self._src[a:b], self._size[a:b])


def host_memmove(dst: Addresses, src: Addresses, size: Addresses) -> None:
    """Run copies ``(dst[i], src[i], size[i])`` between host addresses, on a few threads if large.

    Every address must be valid host memory of this process for its ``size`` bytes, and no copy's
    destination may overlap another copy's bytes (they run in no particular order). Returns when
    every byte is copied; nothing is checked (callers check their jobs first).
    """
    if len(size) == 0:
        return
    threads = _host_copy_threads()
    if threads == 1 or int(size.sum()) < _PARALLEL_MIN_BYTES:
        _memmove_all(dst.tolist(), src.tolist(), size.tolist())
        return
    work = _ChunkedCopies(dst, src, size)
    pool = _get_host_pool(threads)
    futures = [pool.submit(work.run) for _ in range(threads - 1)]
    try:
        work.run()
    finally:
        for f in futures:
            f.result()
