"""Batched KV-block copies between GPU KV caches and host memory: the Python face of ``csrc/``.

Two backends implement the same operations with the same semantics and the same argument checks:

* ``"cuda"``: the CUDA copy library built from ``csrc/`` (``vllm/_kv_offload_cuda*.so``), a plain C
  library loaded with ctypes and driven with raw addresses and stream handles. It needs no CUDA
  build of torch. Used when the library is built, its ABI matches and a GPU is visible.
* ``"torch"``: host copies (``memmove`` over addresses of torch CPU tensors, on a few threads), used
  when the KV cache itself lives in host memory, as on a CPU-only machine where the "GPU" KV cache
  is a CPU tensor. Measured faster than torch's indexing ops for scattered rows (``index_select`` +
  ``index_copy_`` copies every byte twice and reached about 1.3 GB/s against 12+ GB/s here).

``copy_backend()`` says which backend this process would pick (logged once); callers whose memory is
on the host use the torch backend whatever it says.

The unit of work is a *job*: a set of ``CopyRegion``s (one per KV tensor and KV-cache group) that
share arrays of block ids, all moved by one call. A region addresses each side as blocks of
sub-blocks (see ``BlockSide``); one offloaded CPU block can hold ``k`` GPU blocks.

Layout of a ``BlockSide`` (``S = block_stride``, ``s = sub_stride``, ``k = sub_blocks``)::

    id i -> address = base + (i // k) * S + (i % k) * s          (0 <= i < num_blocks * k)

    |<----------------------- S ----------------------->|
    | sub 0 | sub 1 | ... | sub k-1 |        pad         | sub 0 | ...
    |<- s ->|                                            ^ block 1 = base + S
    ^ block 0 = base

and a ``CopyRegion`` copies ``bytes`` bytes (``<= s`` when ``k > 1``) from
``src.address(src_ids[p])`` to ``dst.address(dst_ids[p])`` for every pair ``p`` in
``[pair_begin, pair_begin + pair_count)``. Any alignment is accepted; the CUDA kernel path uses
16-byte accesses where a copy's source and destination addresses agree modulo 16 (KV pages
normally are 16-byte aligned on both sides).
"""

from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import itertools
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, override

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Constants shared with csrc/kv_offload.h
# ---------------------------------------------------------------------------------------------

ABI_VERSION: Final = 2
"""The ``KVO_ABI_VERSION`` this module was written for; another version is refused."""

KVO_OK: Final = 0
KVO_ERR_INVALID_ARGUMENT: Final = 1
KVO_ERR_CUDA: Final = 2

HOST_REGISTER_PORTABLE: Final = 1
HOST_REGISTER_MAPPED: Final = 2

LIBRARY_ENV: Final = "VLLM_KV_OFFLOAD_CUDA_LIB"
"""Path of the CUDA copy library to load instead of the one next to this package."""

BACKEND_ENV: Final = "VLLM_KV_OFFLOAD_COPY_BACKEND"
"""``auto`` (default), ``torch`` (never use CUDA) or ``cuda`` (fail if CUDA is unusable)."""

HOST_COPY_THREADS_ENV: Final = "VLLM_KV_OFFLOAD_HOST_COPY_THREADS"
"""Threads used by the torch backend for large jobs (default ``min(4, cpu_count)``)."""

_U64_MAX: Final = (1 << 64) - 1
_I64_MAX: Final = (1 << 63) - 1
# Below this many bytes a job is copied on the calling thread only: handing work to another
# thread costs tens of microseconds.
_PARALLEL_MIN_BYTES: Final = 4 << 20
# Bytes per unit of work that the torch backend's threads claim (see _ChunkedCopies).
_CHUNK_BYTES: Final = 1 << 20


class CopyMethod(enum.Enum):
    """How the CUDA backend moves bytes (``KvoCopyMethod``); the torch backend ignores it."""

    DMA = 0
    """Copy engines: one ``cuMemcpyBatchAsync`` per job when the driver has it (and the stream is
    not the legacy default stream), else one ``cudaMemcpyAsync`` per (merged) copy."""

    DMA_LOOP = 1
    """Copy engines, always one ``cudaMemcpyAsync`` per (merged) copy."""

    KERNEL = 2
    """A copy kernel on a bounded number of thread blocks over device-mapped pinned host memory:
    for jobs of many small pages. Host memory must be registered with ``HOST_REGISTER_MAPPED``."""


class CopyArgumentError(ValueError):
    """A copy was refused because of its arguments; nothing was enqueued or copied."""


class CudaCopyError(RuntimeError):
    """A CUDA call of the copy library failed (see the message)."""


# ---------------------------------------------------------------------------------------------
# Region descriptors (mirror KvoBlockSide / KvoCopyRegion)
# ---------------------------------------------------------------------------------------------

BLOCK_SIDE_DTYPE: Final = np.dtype(
    [
        ("base", "<u8"),
        ("block_stride", "<u8"),
        ("sub_stride", "<u8"),
        ("num_blocks", "<i8"),
        ("sub_blocks", "<i8"),
    ]
)
REGION_DTYPE: Final = np.dtype(
    [
        ("src", BLOCK_SIDE_DTYPE),
        ("dst", BLOCK_SIDE_DTYPE),
        ("bytes", "<u8"),
        ("pair_begin", "<i8"),
        ("pair_count", "<i8"),
    ]
)
"""numpy layout of ``KvoCopyRegion`` (104 bytes, no padding); arrays of it are passed as is."""

RegionArray = npt.NDArray[np.void]
IdArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class BlockSide:
    """One side of a ``CopyRegion``: memory addressed by block id (see the module docstring).

    Attributes:
        base: address of sub-block 0 of block 0 (device, or host).
        block_stride: bytes from block ``b`` to block ``b + 1``.
        num_blocks: blocks addressable from ``base``.
        sub_blocks: sub-blocks per block (``k >= 1``); id ``i`` is sub-block ``i % k`` of block
            ``i // k``.
        sub_stride: bytes from sub-block ``j`` to ``j + 1`` (ignored when ``sub_blocks == 1``).
    """

    base: int
    block_stride: int
    num_blocks: int
    sub_blocks: int = 1
    sub_stride: int = 0


@dataclass(frozen=True)
class CopyRegion:
    """One tensor's share of a job: ``bytes`` bytes per pair, for pairs
    ``[pair_begin, pair_begin + pair_count)`` of the job's id arrays."""

    src: BlockSide
    dst: BlockSide
    bytes: int
    pair_begin: int
    pair_count: int


def make_regions(regions: Sequence[CopyRegion]) -> RegionArray:
    """Pack ``regions`` into a ``REGION_DTYPE`` array (the form every copy function takes).

    Raises:
        CopyArgumentError: a field does not fit its C type.
    """
    out = np.zeros(len(regions), dtype=REGION_DTYPE)
    try:
        for name in ("src", "dst"):
            sides = [getattr(r, name) for r in regions]
            col = out[name]
            for field in BLOCK_SIDE_DTYPE.names or ():
                col[field] = [getattr(side, field) for side in sides]
        for field in ("bytes", "pair_begin", "pair_count"):
            out[field] = [getattr(r, field) for r in regions]
    except OverflowError as e:
        raise CopyArgumentError(f"a region field does not fit its C type: {e}") from e
    return out


def _as_ids(ids: npt.ArrayLike, what: str) -> IdArray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise CopyArgumentError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CopyArgumentError(f"{what} must hold integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_regions(regions: RegionArray) -> RegionArray:
    if not isinstance(regions, np.ndarray) or regions.dtype != REGION_DTYPE or regions.ndim != 1:
        raise CopyArgumentError("regions must be a 1-D numpy array of REGION_DTYPE (make_regions)")
    return np.ascontiguousarray(regions)


# ---------------------------------------------------------------------------------------------
# Argument checks (the Python twin of kvo_check_copy_blocks)
# ---------------------------------------------------------------------------------------------


_Side = tuple[int, int, int, int, int]  # a BLOCK_SIDE_DTYPE record as Python ints


def _check_side(r: int, which: str, side: _Side, nbytes: int) -> tuple[int, int]:
    """Check one side of region ``r``; return ``(id_limit, end_address)``."""
    base, block_stride, sub_stride, num_blocks, sub_blocks = side
    if base == 0:
        raise CopyArgumentError(f"regions[{r}].{which}.base is 0")
    if num_blocks < 1:
        raise CopyArgumentError(f"regions[{r}].{which}.num_blocks={num_blocks} must be >= 1")
    if sub_blocks < 1:
        raise CopyArgumentError(f"regions[{r}].{which}.sub_blocks={sub_blocks} must be >= 1")
    span = nbytes
    if sub_blocks > 1:
        if nbytes > sub_stride:
            raise CopyArgumentError(
                f"regions[{r}]: bytes={nbytes} exceeds {which}.sub_stride={sub_stride} "
                "(sub-blocks would overlap)"
            )
        span = (sub_blocks - 1) * sub_stride + nbytes
    extent = span
    if num_blocks > 1:
        if span > block_stride:
            raise CopyArgumentError(
                f"regions[{r}].{which}: a block spans {span} bytes but block_stride="
                f"{block_stride} (blocks would overlap)"
            )
        extent = (num_blocks - 1) * block_stride + span
    # Python ints do not overflow: one bound on the end covers every intermediate the C side
    # checks, since each is at most the end.
    end = base + extent
    if end > _U64_MAX:
        raise CopyArgumentError(
            f"regions[{r}].{which}: [base, base + {extent}) wraps around the address space"
        )
    id_limit = num_blocks * sub_blocks
    if id_limit > _I64_MAX:
        raise CopyArgumentError(f"regions[{r}].{which}: num_blocks * sub_blocks overflows")
    return id_limit, end


def check_copy_blocks(regions: RegionArray, src_ids: npt.ArrayLike, dst_ids: npt.ArrayLike) -> None:
    """Check the arguments of a block copy exactly as the C library does, without copying.

    The rules are those of ``KvoCopyRegion`` in ``csrc/kv_offload.h``: positive sizes, non-null
    bases, sub-blocks and blocks that do not overlap, extents that do not wrap, pair ranges inside
    the id arrays, every id in range, source and destination extents disjoint, and no destination
    id repeated within a region's pair range.

    Args:
        regions: ``REGION_DTYPE`` array of R regions.
        src_ids, dst_ids: int64 arrays of P ids each (pair ``p`` is ``(src_ids[p], dst_ids[p])``).

    Raises:
        CopyArgumentError: naming the first offending region, pair or field.
    """
    regions = _as_regions(regions)
    src = _as_ids(src_ids, "src_ids")
    dst = _as_ids(dst_ids, "dst_ids")
    _check_prepared(regions, src, dst)


def _check_prepared(regions: RegionArray, src: IdArray, dst: IdArray) -> None:
    if len(src) != len(dst):
        raise CopyArgumentError(
            f"src_ids and dst_ids must have the same length, got {len(src)} and {len(dst)}"
        )
    num_pairs = len(src)
    # Statistics of each distinct pair range, computed once: regions of a group share one.
    range_stats: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    # tolist() turns the records into Python ints at once (field access per record is slow).
    for r, (src_side, dst_side, nbytes, begin, count) in enumerate(regions.tolist()):
        if nbytes == 0:
            raise CopyArgumentError(f"regions[{r}].bytes is 0")
        if begin < 0 or count < 0 or begin > num_pairs or count > num_pairs - begin:
            raise CopyArgumentError(
                f"regions[{r}]: pairs [{begin}, {begin} + {count}) are not within "
                f"[0, num_pairs={num_pairs})"
            )
        src_limit, src_end = _check_side(r, "src", src_side, nbytes)
        dst_limit, dst_end = _check_side(r, "dst", dst_side, nbytes)
        if src_side[0] < dst_end and dst_side[0] < src_end:
            raise CopyArgumentError(
                f"regions[{r}]: source extent [{src_side[0]:#x}, {src_end:#x}) and destination "
                f"extent [{dst_side[0]:#x}, {dst_end:#x}) overlap"
            )
        if count == 0:
            continue
        stats = range_stats.get((begin, count))
        if stats is None:
            s, d = src[begin : begin + count], dst[begin : begin + count]
            stats = (int(s.min()), int(s.max()), int(d.min()), int(d.max()))
            if count > 1:
                sorted_d = np.sort(d)
                dup = np.flatnonzero(sorted_d[1:] == sorted_d[:-1])
                if dup.size:
                    raise CopyArgumentError(
                        f"regions[{r}]: destination id {int(sorted_d[dup[0]])} appears more than "
                        f"once in pairs [{begin}, {begin + count}) (two copies would write the "
                        "same bytes)"
                    )
            range_stats[(begin, count)] = stats
        s_min, s_max, d_min, d_max = stats
        for name, ids, lo, hi, limit in (
            ("src_ids", src, s_min, s_max, src_limit),
            ("dst_ids", dst, d_min, d_max, dst_limit),
        ):
            if lo < 0 or hi >= limit:
                part = ids[begin : begin + count]
                bad = begin + int(np.flatnonzero((part < 0) | (part >= limit))[0])
                raise CopyArgumentError(
                    f"regions[{r}]: {name}[{bad}]={int(ids[bad])} is outside [0, {limit})"
                )


# ---------------------------------------------------------------------------------------------
# Torch (host) backend
# ---------------------------------------------------------------------------------------------


def expand_copies(
    regions: RegionArray, src_ids: IdArray, dst_ids: IdArray
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
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

    def addresses(side: str, ids: IdArray) -> npt.NDArray[np.uint64]:
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

    def __init__(
        self,
        dst: npt.NDArray[np.uint64],
        src: npt.NDArray[np.uint64],
        size: npt.NDArray[np.uint64],
    ) -> None:
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


def host_memmove(
    dst: npt.NDArray[np.uint64], src: npt.NDArray[np.uint64], size: npt.NDArray[np.uint64]
) -> None:
    """Run copies ``(dst[i], src[i], size[i])`` between host addresses, on a few threads if large.

    The copies must not overlap one another's destinations (they run in no particular order).
    Returns when every byte is copied.
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


# ---------------------------------------------------------------------------------------------
# The CUDA library
# ---------------------------------------------------------------------------------------------


def default_library_path() -> Path | None:
    """The built library next to this package (``vllm/_kv_offload_cuda<ext suffix>``), if any."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        cand = here / f"_kv_offload_cuda{suffix}"
        if cand.is_file():
            return cand
    return None


_c_void_p = ctypes.c_void_p
_c_int = ctypes.c_int
_c_int64 = ctypes.c_int64
_c_uint64 = ctypes.c_uint64

_SIGNATURES: Final[dict[str, tuple[Any, list[Any]]]] = {
    "kvo_abi_version": (_c_int, []),
    "kvo_copy_region_size": (_c_int, []),
    "kvo_last_error": (ctypes.c_char_p, []),
    "kvo_device_count": (_c_int, [ctypes.POINTER(_c_int)]),
    "kvo_get_device": (_c_int, [ctypes.POINTER(_c_int)]),
    "kvo_set_device": (_c_int, [_c_int]),
    "kvo_dma_batch_available": (_c_int, [ctypes.POINTER(_c_int)]),
    "kvo_check_copy_blocks": (_c_int, [_c_void_p, _c_int64, _c_void_p, _c_void_p, _c_int64]),
    "kvo_copy_blocks": (
        _c_int,
        [_c_void_p, _c_int64, _c_void_p, _c_void_p, _c_int64, _c_int, _c_int, _c_void_p],
    ),
    "kvo_memcpy_batch": (_c_int, [_c_void_p, _c_void_p, _c_void_p, _c_int64, _c_void_p]),
    "kvo_stream_create": (_c_int, [ctypes.POINTER(_c_void_p), _c_int]),
    "kvo_stream_destroy": (_c_int, [_c_void_p]),
    "kvo_stream_synchronize": (_c_int, [_c_void_p]),
    "kvo_stream_wait_event": (_c_int, [_c_void_p, _c_void_p]),
    "kvo_event_create": (_c_int, [ctypes.POINTER(_c_void_p), _c_int]),
    "kvo_event_destroy": (_c_int, [_c_void_p]),
    "kvo_event_record": (_c_int, [_c_void_p, _c_void_p]),
    "kvo_event_query": (_c_int, [_c_void_p, ctypes.POINTER(_c_int)]),
    "kvo_event_synchronize": (_c_int, [_c_void_p]),
    "kvo_event_elapsed_ms": (_c_int, [_c_void_p, _c_void_p, ctypes.POINTER(ctypes.c_float)]),
    "kvo_host_register": (_c_int, [_c_void_p, _c_uint64, ctypes.c_uint, ctypes.POINTER(_c_int)]),
    "kvo_host_unregister": (_c_int, [_c_void_p]),
    "kvo_host_get_device_pointer": (_c_int, [_c_uint64, ctypes.POINTER(_c_uint64)]),
    "kvo_device_malloc": (_c_int, [_c_uint64, ctypes.POINTER(_c_uint64)]),
    "kvo_device_free": (_c_int, [_c_uint64]),
    "kvo_memcpy_sync": (_c_int, [_c_uint64, _c_uint64, _c_uint64]),
    "kvo_memset_sync": (_c_int, [_c_uint64, _c_int, _c_uint64]),
}


class CudaCopyLibrary:
    """ctypes binding of the CUDA copy library; every method raises on a non-OK status.

    ``raw`` is the ``ctypes.CDLL`` with argument types set, for callers (tests) that need the
    status codes themselves. Loading needs no GPU or driver: argument checks work anywhere.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.raw = ctypes.CDLL(self.path)
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.raw, name)
            fn.restype = restype
            fn.argtypes = argtypes
        version = int(self.raw.kvo_abi_version())
        if version != ABI_VERSION:
            raise RuntimeError(
                f"{self.path} has ABI version {version}, this module needs {ABI_VERSION}: "
                "rebuild it"
            )
        region_size = int(self.raw.kvo_copy_region_size())
        if region_size != REGION_DTYPE.itemsize:
            raise RuntimeError(
                f"{self.path}: sizeof(KvoCopyRegion)={region_size} but REGION_DTYPE has "
                f"{REGION_DTYPE.itemsize} bytes"
            )

    def last_error(self) -> str:
        """The library's message for the last failed call on this thread."""
        msg = self.raw.kvo_last_error()
        return msg.decode(errors="replace") if msg else ""

    def check(self, status: int, what: str) -> None:
        """Raise the error matching ``status`` (from a call named ``what``), if not OK."""
        if status == KVO_OK:
            return
        msg = f"{what}: {self.last_error()}"
        if status == KVO_ERR_INVALID_ARGUMENT:
            raise CopyArgumentError(msg)
        raise CudaCopyError(msg)

    # -- device --------------------------------------------------------------------------------

    def device_count(self) -> int:
        n = _c_int(0)
        self.check(self.raw.kvo_device_count(ctypes.byref(n)), "kvo_device_count")
        return n.value

    def get_device(self) -> int:
        d = _c_int(0)
        self.check(self.raw.kvo_get_device(ctypes.byref(d)), "kvo_get_device")
        return d.value

    def set_device(self, device: int) -> None:
        self.check(self.raw.kvo_set_device(device), "kvo_set_device")

    def dma_batch_available(self) -> bool:
        a = _c_int(0)
        self.check(self.raw.kvo_dma_batch_available(ctypes.byref(a)), "kvo_dma_batch_available")
        return bool(a.value)

    # -- copies --------------------------------------------------------------------------------

    def check_copy_blocks(self, regions: RegionArray, src_ids: IdArray, dst_ids: IdArray) -> None:
        """``kvo_check_copy_blocks`` on prepared arrays (see ``check_copy_blocks``)."""
        if len(src_ids) != len(dst_ids):
            raise CopyArgumentError("src_ids and dst_ids must have the same length")
        self.check(
            self.raw.kvo_check_copy_blocks(
                _ptr(regions), len(regions), _ptr(src_ids), _ptr(dst_ids), len(src_ids)
            ),
            "kvo_check_copy_blocks",
        )

    def copy_blocks(
        self,
        regions: RegionArray,
        src_ids: IdArray,
        dst_ids: IdArray,
        method: CopyMethod,
        max_ctas: int,
        stream: int,
    ) -> None:
        """``kvo_copy_blocks`` on prepared arrays (see ``copy_blocks``)."""
        if len(src_ids) != len(dst_ids):
            raise CopyArgumentError("src_ids and dst_ids must have the same length")
        self.check(
            self.raw.kvo_copy_blocks(
                _ptr(regions),
                len(regions),
                _ptr(src_ids),
                _ptr(dst_ids),
                len(src_ids),
                method.value,
                max_ctas,
                stream or None,
            ),
            "kvo_copy_blocks",
        )

    def memcpy_batch(
        self,
        dst_ptrs: npt.NDArray[np.uint64],
        src_ptrs: npt.NDArray[np.uint64],
        sizes: npt.NDArray[np.uint64],
        stream: int,
    ) -> None:
        self.check(
            self.raw.kvo_memcpy_batch(
                _ptr(dst_ptrs), _ptr(src_ptrs), _ptr(sizes), len(sizes), stream or None
            ),
            "kvo_memcpy_batch",
        )

    # -- streams and events ---------------------------------------------------------------------

    def stream_create(self, priority: int = 0) -> int:
        h = _c_void_p()
        self.check(self.raw.kvo_stream_create(ctypes.byref(h), priority), "kvo_stream_create")
        return int(h.value or 0)

    def stream_destroy(self, stream: int) -> None:
        self.check(self.raw.kvo_stream_destroy(stream or None), "kvo_stream_destroy")

    def stream_synchronize(self, stream: int) -> None:
        self.check(self.raw.kvo_stream_synchronize(stream or None), "kvo_stream_synchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.check(
            self.raw.kvo_stream_wait_event(stream or None, event or None), "kvo_stream_wait_event"
        )

    def event_create(self, enable_timing: bool = True) -> int:
        h = _c_void_p()
        self.check(
            self.raw.kvo_event_create(ctypes.byref(h), int(enable_timing)), "kvo_event_create"
        )
        return int(h.value or 0)

    def event_destroy(self, event: int) -> None:
        self.check(self.raw.kvo_event_destroy(event or None), "kvo_event_destroy")

    def event_record(self, event: int, stream: int) -> None:
        self.check(self.raw.kvo_event_record(event or None, stream or None), "kvo_event_record")

    def event_query(self, event: int) -> bool:
        done = _c_int(0)
        self.check(self.raw.kvo_event_query(event or None, ctypes.byref(done)), "kvo_event_query")
        return bool(done.value)

    def event_synchronize(self, event: int) -> None:
        self.check(self.raw.kvo_event_synchronize(event or None), "kvo_event_synchronize")

    def event_elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float(0.0)
        self.check(
            self.raw.kvo_event_elapsed_ms(start or None, end or None, ctypes.byref(ms)),
            "kvo_event_elapsed_ms",
        )
        return float(ms.value)

    # -- memory ----------------------------------------------------------------------------------

    def host_register(self, ptr: int, nbytes: int, flags: int) -> bool:
        """Pin ``[ptr, ptr + nbytes)``; False if it was already registered (not ours to undo)."""
        already = _c_int(0)
        self.check(
            self.raw.kvo_host_register(ptr or None, nbytes, flags, ctypes.byref(already)),
            "kvo_host_register",
        )
        return not already.value

    def host_unregister(self, ptr: int) -> None:
        self.check(self.raw.kvo_host_unregister(ptr or None), "kvo_host_unregister")

    def host_get_device_pointer(self, ptr: int) -> int:
        out = _c_uint64(0)
        self.check(
            self.raw.kvo_host_get_device_pointer(ptr, ctypes.byref(out)),
            "kvo_host_get_device_pointer",
        )
        return int(out.value)

    def device_malloc(self, nbytes: int) -> int:
        out = _c_uint64(0)
        self.check(self.raw.kvo_device_malloc(nbytes, ctypes.byref(out)), "kvo_device_malloc")
        return int(out.value)

    def device_free(self, ptr: int) -> None:
        self.check(self.raw.kvo_device_free(ptr), "kvo_device_free")

    def memcpy_sync(self, dst: int, src: int, nbytes: int) -> None:
        self.check(self.raw.kvo_memcpy_sync(dst, src, nbytes), "kvo_memcpy_sync")

    def memset_sync(self, ptr: int, value: int, nbytes: int) -> None:
        self.check(self.raw.kvo_memset_sync(ptr, value, nbytes), "kvo_memset_sync")

    @override
    def __repr__(self) -> str:
        return f"CudaCopyLibrary({self.path!r})"


def _ptr(arr: np.ndarray) -> int | None:
    return int(arr.ctypes.data) if arr.size else None


_library_lock = threading.Lock()
_library_loaded = False
_library: CudaCopyLibrary | None = None
_library_problem = "not loaded yet"
_backend: str | None = None


def cuda_library() -> CudaCopyLibrary | None:
    """The loaded CUDA copy library, or None if it is not built or cannot be loaded.

    The path is ``$VLLM_KV_OFFLOAD_CUDA_LIB`` if set, else the library next to this package.
    Loaded once per process; a GPU is not needed (argument checks work without one).
    """
    global _library_loaded, _library, _library_problem
    with _library_lock:
        if not _library_loaded:
            _library_loaded = True
            env = os.environ.get(LIBRARY_ENV)
            path = Path(env) if env else default_library_path()
            if path is None:
                _library_problem = "the CUDA copy library is not built (no vllm/_kv_offload_cuda*)"
            else:
                try:
                    _library = CudaCopyLibrary(path)
                    _library_problem = ""
                except (OSError, RuntimeError, AttributeError) as e:
                    _library_problem = f"cannot load {path}: {e}"
        return _library


def copy_backend() -> str:
    """Which backend this process uses for device memory: ``"cuda"`` or ``"torch"``.

    ``"cuda"`` when the library is loaded and sees a GPU, unless ``VLLM_KV_OFFLOAD_COPY_BACKEND``
    is ``torch``; otherwise ``"torch"``. Decided and logged once per process.

    Raises:
        RuntimeError: ``VLLM_KV_OFFLOAD_COPY_BACKEND=cuda`` but CUDA is unusable.
    """
    global _backend
    if _backend is not None:
        return _backend
    wanted = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "torch", "cuda"):
        raise ValueError(f"{BACKEND_ENV}={wanted!r}: expected auto, torch or cuda")
    reason: str
    backend = "torch"
    if wanted == "torch":
        reason = f"{BACKEND_ENV}=torch"
    else:
        lib = cuda_library()
        if lib is None:
            reason = _library_problem
        else:
            count = lib.device_count()
            if count > 0:
                backend = "cuda"
                reason = (
                    f"{lib.path}, {count} GPU(s), cuMemcpyBatchAsync "
                    f"{'available' if lib.dma_batch_available() else 'unavailable (loop fallback)'}"
                )
            else:
                reason = f"{lib.path} is loaded but sees no GPU"
        if wanted == "cuda" and backend != "cuda":
            raise RuntimeError(f"{BACKEND_ENV}=cuda but the CUDA backend is unusable: {reason}")
    _backend = backend
    logger.info("KV offload copy backend: %s (%s)", backend, reason)
    return backend


def _reset_backend_for_tests() -> None:
    """Forget the cached backend decision (tests that change the environment)."""
    global _backend
    _backend = None


def _require_library() -> CudaCopyLibrary:
    lib = cuda_library()
    if lib is None:
        raise RuntimeError(f"the CUDA copy backend is unavailable: {_library_problem}")
    return lib


# ---------------------------------------------------------------------------------------------
# Public copy operations
# ---------------------------------------------------------------------------------------------


def copy_blocks(
    regions: RegionArray,
    src_ids: npt.ArrayLike,
    dst_ids: npt.ArrayLike,
    *,
    backend: str | None = None,
    method: CopyMethod = CopyMethod.DMA,
    stream: int = 0,
    max_ctas: int = 0,
) -> None:
    """Copy every pair of every region of one job (see the module docstring for the layouts).

    For each region ``r`` and pair ``p`` in ``[r.pair_begin, r.pair_begin + r.pair_count)``:
    ``r.bytes`` bytes move from ``r.src.address(src_ids[p])`` to ``r.dst.address(dst_ids[p])``.
    Copies of one call may run in any order and concurrently.

    Args:
        regions: ``REGION_DTYPE`` array (``make_regions``) of R regions.
        src_ids, dst_ids: 1-D integer arrays of P ids each.
        backend: ``"cuda"`` or ``"torch"``; default ``copy_backend()``. The torch backend needs
            every address to be valid host memory of this process.
        method: CUDA backend only: DMA (default), DMA_LOOP or KERNEL (``CopyMethod``).
        stream: CUDA backend only: the ``cudaStream_t`` handle to enqueue on (0: legacy default
            stream). The call is then asynchronous: the bytes have moved once work recorded on
            ``stream`` after it completes; until then the memory must stay valid and untouched.
            The torch backend returns after the last byte is copied.
        max_ctas: CUDA kernel path only: most thread blocks (0: library default, 16).

    Raises:
        CopyArgumentError: invalid arguments (the same checks on both backends); nothing moved.
        CudaCopyError: a CUDA call failed.
    """
    regions = _as_regions(regions)
    src = _as_ids(src_ids, "src_ids")
    dst = _as_ids(dst_ids, "dst_ids")
    if len(src) != len(dst):
        raise CopyArgumentError(
            f"src_ids and dst_ids must have the same length, got {len(src)} and {len(dst)}"
        )
    chosen = backend or copy_backend()
    if chosen == "cuda":
        _require_library().copy_blocks(regions, src, dst, method, max_ctas, stream)
    elif chosen == "torch":
        _check_prepared(regions, src, dst)
        host_memmove(*expand_copies(regions, src, dst))
    else:
        raise ValueError(f"backend={chosen!r}: expected 'cuda' or 'torch'")


def swap_blocks_batch(
    src_ptrs: npt.ArrayLike,
    dst_ptrs: npt.ArrayLike,
    sizes: npt.ArrayLike,
    *,
    backend: str | None = None,
    stream: int = 0,
) -> None:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` for every ``i``.

    Args:
        src_ptrs, dst_ptrs, sizes: 1-D arrays of N unsigned 64-bit addresses / byte counts; each
            address a contiguous page of device or host memory. Copies must not overlap.
        backend, stream: as for ``copy_blocks``.

    Raises:
        CopyArgumentError: unequal lengths, a zero size or address, a wrapping or overlapping
            copy (checked on both backends before anything moves).
        CudaCopyError: a CUDA call failed.
    """
    src = np.ascontiguousarray(src_ptrs, dtype=np.uint64)
    dst = np.ascontiguousarray(dst_ptrs, dtype=np.uint64)
    size = np.ascontiguousarray(sizes, dtype=np.uint64)
    if not (src.ndim == dst.ndim == size.ndim == 1) or not (len(src) == len(dst) == len(size)):
        raise CopyArgumentError("src_ptrs, dst_ptrs and sizes must be 1-D arrays of equal length")
    chosen = backend or copy_backend()
    if chosen == "cuda":
        _require_library().memcpy_batch(dst, src, size, stream)
        return
    if chosen != "torch":
        raise ValueError(f"backend={chosen!r}: expected 'cuda' or 'torch'")
    for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), size.tolist(), strict=True)):
        if n == 0:
            raise CopyArgumentError(f"sizes[{i}] is 0")
        if d == 0 or s == 0:
            raise CopyArgumentError(f"copy {i} has a null pointer")
        if d + n > _U64_MAX or s + n > _U64_MAX:
            raise CopyArgumentError(f"copy {i} wraps around the address space")
        if d < s + n and s < d + n:
            raise CopyArgumentError(f"copy {i}: source and destination overlap")
    host_memmove(dst, src, size)


# ---------------------------------------------------------------------------------------------
# CUDA resources for callers without a CUDA build of torch
# ---------------------------------------------------------------------------------------------


class CudaStream:
    """A non-blocking CUDA stream owned by this object (destroyed by ``close``)."""

    def __init__(self, lib: CudaCopyLibrary, priority: int = 0) -> None:
        self._lib = lib
        self.handle = lib.stream_create(priority)

    def wait_event(self, event: CudaEvent) -> None:
        """Make later work on this stream wait for ``event``'s last record."""
        self._lib.stream_wait_event(self.handle, event.handle)

    def synchronize(self) -> None:
        self._lib.stream_synchronize(self.handle)

    def close(self) -> None:
        """Destroy the stream (idempotent); pending work still completes."""
        if self.handle:
            handle, self.handle = self.handle, 0
            self._lib.stream_destroy(handle)

    @override
    def __repr__(self) -> str:
        return f"CudaStream({self.handle:#x})"


class CudaEvent:
    """A CUDA event owned by this object (destroyed by ``close``)."""

    def __init__(self, lib: CudaCopyLibrary, enable_timing: bool = True) -> None:
        self._lib = lib
        self.handle = lib.event_create(enable_timing)

    def record(self, stream: int) -> None:
        """Record on the stream with handle ``stream`` (0: the legacy default stream)."""
        self._lib.event_record(self.handle, stream)

    def query(self) -> bool:
        """True when the work of the last record is complete (raises if it failed)."""
        return self._lib.event_query(self.handle)

    def synchronize(self) -> None:
        self._lib.event_synchronize(self.handle)

    def elapsed_ms(self, end: CudaEvent) -> float:
        """Milliseconds from this (completed) event to ``end``."""
        return self._lib.event_elapsed_ms(self.handle, end.handle)

    def close(self) -> None:
        if self.handle:
            handle, self.handle = self.handle, 0
            self._lib.event_destroy(handle)

    @override
    def __repr__(self) -> str:
        return f"CudaEvent({self.handle:#x})"


class DeviceBuffer:
    """``nbytes`` of device memory (``cudaMalloc``), freed by ``close``; for tests and benchmarks.

    Attributes:
        ptr: device address of the first byte.
        nbytes: size in bytes.
    """

    def __init__(self, lib: CudaCopyLibrary, nbytes: int) -> None:
        self._lib = lib
        self.nbytes = nbytes
        self.ptr = lib.device_malloc(nbytes)

    def copy_from_host(self, src: npt.NDArray[Any], offset: int = 0) -> None:
        """Synchronously copy the bytes of C-contiguous host array ``src`` to ``ptr + offset``."""
        data = np.ascontiguousarray(src)
        if offset < 0 or offset + data.nbytes > self.nbytes:
            raise ValueError(f"{data.nbytes} bytes at offset {offset} overrun {self!r}")
        if data.nbytes:
            self._lib.memcpy_sync(self.ptr + offset, int(data.ctypes.data), data.nbytes)

    def copy_to_host(self, dst: npt.NDArray[Any], offset: int = 0) -> None:
        """Synchronously copy ``dst.nbytes`` bytes at ``ptr + offset`` into contiguous ``dst``."""
        if not dst.flags.c_contiguous:
            raise ValueError("dst must be C-contiguous")
        if offset < 0 or offset + dst.nbytes > self.nbytes:
            raise ValueError(f"{dst.nbytes} bytes at offset {offset} overrun {self!r}")
        if dst.nbytes:
            self._lib.memcpy_sync(int(dst.ctypes.data), self.ptr + offset, dst.nbytes)

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self._lib.device_free(ptr)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @override
    def __repr__(self) -> str:
        return f"DeviceBuffer(ptr={self.ptr:#x}, nbytes={self.nbytes})"
