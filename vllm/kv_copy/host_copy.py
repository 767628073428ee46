# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The torch backend of ``copy_blocks``: copies between host addresses, a few calls per job.

Used when the KV cache itself lives in host memory, as on a CPU-only machine where the "GPU" KV
cache is a CPU tensor. A job's regions that continue each other on both sides are merged; then,
regions that move items of one size from sides at one offset within an item (a per-layer
layout's job: ``_FlatJob``) are a few indexed copies between two flat numpy views whose items
are those pages, one call per chunk of about ``_GATHER_BYTES`` (which keeps the gathered items
in cache) across the regions; the others are copied region by region, one numpy gather of each
region's source blocks and one scatter to its destination blocks per chunk. A run of consecutive
ids on one side is copied in one pass (a scatter from the run's view, or a gather into it).
numpy copies each item with ``memcpy``. What a job's geometry needs (the merge, the views, the
maps from ids to items) is computed once per geometry (``_job_shape``): a handler's jobs repeat
a few, so a small job costs a few numpy calls, not one Python call per page or per region.

The GIL: numpy keeps it for an indexed copy of at most 500 items and releases it for the whole
call above. A short copy under the GIL is what a step wants: the previous design's
``ctypes.memmove`` per page released and re-took the GIL for each page, and every re-take could
wait up to the interpreter's switch interval while another Python thread (the tiers' I/O
threads) ran. Large jobs (``_PARALLEL_MIN_BYTES``) share their chunks among a few threads; their
chunks hold at least ``_GIL_FREE_ITEMS`` items, so that numpy lets the threads copy together.

torch's own indexing ops were measured slower for scattered rows (``index_select`` +
``index_copy_`` reached about 1.3 GB/s against 12+ GB/s for ``memmove``; docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import numpy as np
import numpy.typing as npt

from vllm.kv_copy.regions import REGION_DTYPE, IdArray, RegionArray

HOST_COPY_THREADS_ENV: Final = "VLLM_KV_OFFLOAD_HOST_COPY_THREADS"
"""Threads used by the torch backend for large jobs (default ``min(4, cpu_count)``)."""

# Below this many bytes a job is copied on the calling thread only: handing work to another
# thread costs tens of microseconds.
_PARALLEL_MIN_BYTES: Final = 4 << 20
# Bytes per unit of work that the threads claim (see _ChunkedCopies), and per gather of a region
# (small enough that the gathered items are still in cache when they are scattered).
_CHUNK_BYTES: Final = 1 << 20
_GATHER_BYTES: Final = 512 << 10
# numpy releases the GIL for an indexed copy of more than 500 items (its threshold for every
# indexed assignment) and keeps it below: the parallel path's copies have at least this many
# items, or its threads would take turns instead of copying together (measured: 0.30 of a
# memcpy with 128-item copies on two threads, 0.60 with 512).
_GIL_FREE_ITEMS: Final = 512
# On one thread, a range whose ids on one side are consecutive is copied region by region in
# one pass when each region moves at least this much (below it one gather-and-scatter call for
# all regions costs less than a call per region).
_RUN_MIN_BYTES: Final = 128 << 10

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


@functools.cache
def _default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _host_copy_threads() -> int:
    env = os.environ.get(HOST_COPY_THREADS_ENV)
    if env:
        return max(1, int(env))
    return _default_threads()


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


# -- Region by region (copy_blocks' torch backend) ----------------------------------------------

# A BLOCK_SIDE_DTYPE record as Python ints: (base, block_stride, sub_stride, num_blocks, k).
_Side = tuple[int, int, int, int, int]
# A REGION_DTYPE record as Python ints: (src, dst, bytes, pair_begin, pair_count).
_Region = tuple[_Side, _Side, int, int, int]


def _continues(last: _Region, cur: _Region) -> bool:
    """Whether ``cur`` continues ``last`` on both sides, for the same pairs (``merge_regions``)."""
    nbytes = last[2] + cur[2]
    for a, b in ((last[0], cur[0]), (last[1], cur[1])):
        if a[1:] != b[1:] or b[0] != a[0] + last[2] or (a[4] > 1 and nbytes > a[2]):
            return False
    return last[3:] == cur[3:]


def merge_regions(regions: RegionArray) -> list[_Region]:
    """``regions`` (as Python ints) with each run of regions that continue each other merged.

    Region ``r + 1`` continues region ``r`` when both cover the same pairs, have the same
    geometry (strides, block and sub-block counts) on each side, and start on each side right
    where ``r``'s bytes end (and, with sub-blocks, the sum still fits in a sub-block): the same
    bytes then move as ``bytes(r) + bytes(r + 1)`` per pair. The K and V planes of a block in a
    blocks-first layout are such a pair. Regions without pairs are dropped.
    """
    merged: list[_Region] = []
    for region in regions.tolist():
        if region[4] == 0:
            continue
        if merged and _continues(merged[-1], region):
            last = merged[-1]
            merged[-1] = (last[0], last[1], last[2] + region[2], last[3], last[4])
        else:
            merged.append(region)
    return merged


def _side_span(side: _Side, nbytes: int) -> int:
    """Bytes from a side's base to the end of its last (sub-)block's ``nbytes``."""
    _, block_stride, sub_stride, num_blocks, sub_blocks = side
    return (num_blocks - 1) * block_stride + (sub_blocks - 1) * sub_stride + nbytes


def _raw(base: int, span: int) -> memoryview:
    """The ``span`` bytes at address ``base``, unowned (the caller guarantees the memory)."""
    return memoryview((ctypes.c_char * span).from_address(base))


@functools.lru_cache(maxsize=1024)
def _side_view(side: _Side, nbytes: int) -> np.ndarray:
    """A numpy view of one region side whose items are the ``nbytes`` of each (sub-)block.

    Shape ``(num_blocks,)``, or ``(num_blocks, sub_blocks)`` with sub-blocks. Cached: a handler's
    jobs name the same few sides again and again. The view only holds the address; it is read or
    written only for the ids of a job whose addresses the caller guarantees.
    """
    base, block_stride, sub_stride, num_blocks, sub_blocks = side
    buffer = _raw(base, _side_span(side, nbytes))
    item = np.dtype((np.void, nbytes))
    if sub_blocks == 1:
        return np.ndarray((num_blocks,), item, buffer=buffer, strides=(block_stride,))
    return np.ndarray(
        (num_blocks, sub_blocks), item, buffer=buffer, strides=(block_stride, sub_stride)
    )


_Index = IdArray | tuple[IdArray, IdArray]


def _index(side: _Side, ids: IdArray) -> _Index:
    k = side[4]
    return ids if k == 1 else (ids // k, ids % k)


def _is_run(ids: IdArray) -> bool:
    """Whether ``ids`` are consecutive and increasing."""
    return int(ids[-1]) - int(ids[0]) == len(ids) - 1 and bool(np.all(np.diff(ids) == 1))


def _gather_scatter(
    dst: np.ndarray, dst_index: _Index, src: np.ndarray, src_index: _Index
) -> Callable[[], None]:
    def copy() -> None:
        dst[dst_index] = src[src_index]  # one gather, one scatter

    return copy


def _scatter(dst: np.ndarray, dst_index: _Index, run: np.ndarray) -> Callable[[], None]:
    def copy() -> None:
        dst[dst_index] = run  # consecutive source blocks: scattered from their view in one pass

    return copy


def _gather(dst_run: np.ndarray, src: np.ndarray, src_index: IdArray) -> Callable[[], None]:
    def copy() -> None:
        # Into a run of destination items in one pass: take() writes an unbuffered ``out``
        # only when it is contiguous and the mode is not "raise" (the ids are checked already).
        np.take(src, src_index, out=dst_run, mode="clip")

    return copy


def _chunk_copy(
    dst: np.ndarray, dst_index: _Index, src: np.ndarray, src_index: _Index, src_run: bool
) -> Callable[[], None]:
    """``dst[dst_index] = src[src_index]`` as one item; ``src_run``: ``src_index`` is a run of
    consecutive ids of ``src``'s only axis, scattered from their view in one pass."""
    if src_run:
        ids = src_index
        assert not isinstance(ids, tuple)
        return _scatter(dst, dst_index, src[int(ids[0]) : int(ids[-1]) + 1])
    return _gather_scatter(dst, dst_index, src, src_index)


def _copy_items(
    regions: list[_Region], src_ids: IdArray, dst_ids: IdArray, min_items: int = 1
) -> list[Callable[[], None]]:
    """The job as independent copies: per region, chunks of indexed copies of about
    ``_GATHER_BYTES`` each, and of at least ``min_items`` items."""
    items: list[Callable[[], None]] = []
    # Per pair chunk (regions of one job share their chunks): the id slices, and whether the
    # source ids are a run.
    chunks: dict[tuple[int, int], tuple[IdArray, IdArray, bool]] = {}
    for region in regions:
        src_side, dst_side, nbytes, begin, count = region
        src, dst = _side_view(src_side, nbytes), _side_view(dst_side, nbytes)
        step = max(min_items, _GATHER_BYTES // nbytes)
        for a in range(begin, begin + count, step):
            b = min(a + step, begin + count)
            chunk = chunks.get((a, b))
            if chunk is None:
                s = src_ids[a:b]
                chunk = chunks[(a, b)] = (s, dst_ids[a:b], _is_run(s))
            s, d, src_run = chunk
            run = src_run and src_side[4] == 1
            items.append(_chunk_copy(dst, _index(dst_side, d), src, _index(src_side, s), run))
    return items


class _SideMap:
    """Where the items of one side of a pair range lie in that side's flat view: for region
    ``r`` and id ``i``, item ``first[r] + (i // k) * block[r] + (i % k) * sub[r]``.

    Arrays of shape ``(R, 1)`` (R: the range's regions), so that ``index(ids)`` is an
    ``(R, len(ids))`` matrix, region after region.
    """

    __slots__ = ("block", "dense", "first", "k", "sub")

    def __init__(self, sides: list[_Side], nbytes: int, lo: int) -> None:
        self.k = sides[0][4]
        self.first = np.array([(x[0] - lo) // nbytes for x in sides], dtype=np.int64)[:, None]
        self.block = np.array([x[1] // nbytes for x in sides], dtype=np.int64)[:, None]
        self.sub = np.array([x[2] // nbytes for x in sides], dtype=np.int64)[:, None]
        # Consecutive blocks on adjacent items (a "GPU" plane; not a CPU row of every plane).
        self.dense = bool((self.block == 1).all())

    def index(self, ids: IdArray) -> IdArray:
        if self.k == 1:
            index: IdArray = self.first + ids * self.block
            return index
        index = self.first + (ids // self.k) * self.block + (ids % self.k) * self.sub
        return index


def _flat_view(sides: list[_Side], nbytes: int) -> tuple[int, np.ndarray]:
    """The lowest base of ``sides`` and a view of ``nbytes`` items from it that spans every
    side's blocks (``_FlatJob``)."""
    lo = min(x[0] for x in sides)
    end = max(x[0] + _side_span(x, nbytes) for x in sides)
    item = np.dtype((np.void, nbytes))
    return lo, np.ndarray(((end - lo) // nbytes,), item, buffer=_raw(lo, end - lo))


class _FlatJob:
    """Regions of a job as two flat views of one item size and, per pair range, the maps from a
    pair's ids to its items (built once per geometry by ``_job_shape``).

    Regions are flat together when they all move items of one size ``S`` and, on each side,
    every base is a whole number of ``S`` from that side's lowest base and every stride a
    multiple of ``S``: each side is then one array of ``S``-byte items from its lowest base. A
    per-layer layout's job is one or a few such groups (every page one size; each tensor's
    pages start at some offset of a memory page, and tensors allocated apart may differ in it),
    whose regions have one item per block each: copied region by region, a small job would be
    one numpy call per region; flat, it is one call per group and chunk of about
    ``_GATHER_BYTES``, whatever region its items belong to. The views span the addresses between
    the side's tensors too, but only the job's own items are read or written.
    """

    __slots__ = ("dst_view", "nbytes", "ranges", "src_view")

    def __init__(self, regions: list[_Region]) -> None:
        nbytes = self.nbytes = regions[0][2]
        src_sides, dst_sides = [r[0] for r in regions], [r[1] for r in regions]
        s_lo, self.src_view = _flat_view(src_sides, nbytes)
        d_lo, self.dst_view = _flat_view(dst_sides, nbytes)
        by_range: dict[tuple[int, int], list[_Region]] = {}
        for r in regions:
            by_range.setdefault((r[3], r[4]), []).append(r)
        self.ranges = [
            (
                begin,
                count,
                _SideMap([r[0] for r in members], nbytes, s_lo),
                _SideMap([r[1] for r in members], nbytes, d_lo),
            )
            for (begin, count), members in by_range.items()
        ]

    @staticmethod
    def fits(regions: list[_Region]) -> bool:
        """Whether a group of ``_job_shape`` (one item size, sub-block count and base offset
        within an item per side) is flat: every stride a whole number of items."""
        nbytes = regions[0][2]
        return all(
            x[1] % nbytes == 0 and (x[4] == 1 or x[2] % nbytes == 0)
            for r in regions
            for x in (r[0], r[1])
        )

    def items(self, src_ids: IdArray, dst_ids: IdArray, min_items: int) -> list[Callable[[], None]]:
        """The job as independent copies of at least ``min_items`` items each.

        On one thread (``min_items`` 1), a range whose ids on one side are consecutive and whose
        regions move at least ``_RUN_MIN_BYTES`` each is copied region by region in one pass:
        consecutive source ids are evenly spaced items of the source view, scattered from that
        strided view; consecutive destination ids on adjacent items (a "GPU" plane) are one
        contiguous slice of the destination view, gathered into. Otherwise chunks of the
        raveled pairs, a gather into a buffer and a scatter each.
        """
        src, dst = self.src_view, self.dst_view
        step = max(min_items, _GATHER_BYTES // self.nbytes)
        items: list[Callable[[], None]] = []
        for begin, count, s_map, d_map in self.ranges:
            s_ids, d_ids = src_ids[begin : begin + count], dst_ids[begin : begin + count]
            s, d = s_map.index(s_ids), d_map.index(d_ids)  # (R, count)
            by_rows = min_items == 1 and count * self.nbytes >= _RUN_MIN_BYTES
            if by_rows and s_map.k == 1 and _is_run(s_ids):
                # Each region's source items: a run of ids, every block_stride-th item.
                rows = zip(s[:, 0].tolist(), s_map.block[:, 0].tolist(), d, strict=True)
                for s_row, stride, d_row in rows:
                    for a in range(0, count, step):
                        b = min(a + step, count)
                        run = src[s_row + a * stride : s_row + b * stride : stride]
                        items.append(_scatter(dst, d_row[a:b], run))
            elif by_rows and d_map.k == 1 and d_map.dense and _is_run(d_ids):
                # Each region's destination items: a run of ids on adjacent items.
                for s_row, d_row in zip(s, d[:, 0].tolist(), strict=True):
                    for a in range(0, count, step):
                        b = min(a + step, count)
                        items.append(_gather(dst[d_row + a : d_row + b], src, s_row[a:b]))
            else:
                # Pair after pair, each pair's regions together (column order): a per-layer
                # job then writes (stores) or reads (loads) each CPU row as one run of pages,
                # not one page of every row per region: 1.10-1.23x faster for jobs of 256-512
                # blocks on two threads, caches cold (docs/benchmarks.md).
                s, d = s.ravel(order="F"), d.ravel(order="F")
                for a in range(0, len(s), step):
                    chunk = s[a : a + step]
                    items.append(_chunk_copy(dst, d[a : a + step], src, chunk, _is_run(chunk)))
        return items


@functools.lru_cache(maxsize=512)
def _job_shape(records: bytes) -> tuple[int, list[_FlatJob], list[_Region]]:
    """A job's geometry: the bytes it moves, its flat parts and the regions copied one by one.

    The merged regions (``merge_regions``) are grouped by their item size, sub-block counts and
    the offsets of their bases within an item on each side: each group of several regions whose
    strides are whole items is one ``_FlatJob`` (tensors allocated separately may start at
    various offsets of a memory page, so a per-layer job can be a few such groups rather than
    one); the rest is copied region by region. Cached by the regions' bytes: a handler's jobs
    repeat a few geometries (one per job length), so a job's Python setup is done once per
    geometry.
    """
    merged = merge_regions(np.frombuffer(records, dtype=REGION_DTYPE))
    num_bytes = sum(r[2] * r[4] for r in merged)
    groups: dict[tuple[int, ...], list[_Region]] = {}
    for r in merged:
        n = r[2]
        groups.setdefault((n, r[0][0] % n, r[1][0] % n, r[0][4], r[1][4]), []).append(r)
    flats: list[_FlatJob] = []
    rest: list[_Region] = []
    for members in groups.values():
        # A lone region gains nothing from a flat view (one call either way) and its maps cost.
        if len(members) > 1 and _FlatJob.fits(members):
            flats.append(_FlatJob(members))
        else:
            rest += members
    return num_bytes, flats, rest


def host_copy(regions: RegionArray, src_ids: IdArray, dst_ids: IdArray) -> None:
    """Run a checked job (``check_prepared``) between host addresses (see the module docstring).

    Every address the job names must be valid host memory of this process, and no copy's
    destination may overlap another copy's bytes (they run in no particular order). Returns when
    every byte is copied.
    """
    num_bytes, flats, rest = _job_shape(regions.tobytes())
    threads = _host_copy_threads()
    parallel = threads > 1 and num_bytes >= _PARALLEL_MIN_BYTES
    # A large job's chunks have enough items for numpy to copy them without the GIL, so that
    # the threads copy together.
    min_items = _GIL_FREE_ITEMS if parallel else 1
    items = _copy_items(rest, src_ids, dst_ids, min_items) if rest else []
    for flat in flats:
        items += flat.items(src_ids, dst_ids, min_items)
    if not parallel or len(items) == 1:
        for item in items:
            item()
        return
    claim = itertools.count()  # next() on a count is atomic under the GIL

    def run() -> None:
        while (i := next(claim)) < len(items):
            items[i]()

    pool = _get_host_pool(threads)
    futures = [pool.submit(run) for _ in range(threads - 1)]
    try:
        run()
    finally:
        for f in futures:
            f.result()
