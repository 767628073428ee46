# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Argument checks of a block copy: the Python twin of ``kvo_check_copy_blocks`` (csrc/).

Both backends refuse exactly the jobs the C library refuses, before any byte moves; a property
test (tests/test_custom_ops.py) checks that the two agree.
"""

from __future__ import annotations

import functools
from typing import Final

import numpy as np
import numpy.typing as npt

from vllm.kv_copy.errors import CopyArgumentError
from vllm.kv_copy.regions import (
    REGION_DTYPE,
    IdArray,
    RegionArray,
    as_ids,
    as_regions,
    check_pair_counts,
)

U64_MAX: Final = (1 << 64) - 1
_I64_MAX: Final = (1 << 63) - 1

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
    if end > U64_MAX:
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
    check_prepared(as_regions(regions), as_ids(src_ids, "src_ids"), as_ids(dst_ids, "dst_ids"))


# Up to this many ids, a range's statistics are taken in Python (numpy's per-call cost is more).
_SMALL_RANGE: Final = 64


@functools.lru_cache(maxsize=1024)
def _region_geometry(records: bytes) -> tuple[tuple[int, int, int, int], ...]:
    """Check what of a job depends on its regions alone (``records``: the array's bytes);
    return each region's ``(pair_begin, pair_count, src id limit, dst id limit)``.

    Memoised by the regions' bytes: a handler's jobs repeat the same few region arrays. Refusals
    raise, and are not cached.
    """
    out = []
    regions = np.frombuffer(records, dtype=REGION_DTYPE)
    # tolist() turns the records into Python ints at once (field access per record is slow).
    for r, (src_side, dst_side, nbytes, begin, count) in enumerate(regions.tolist()):
        if nbytes == 0:
            raise CopyArgumentError(f"regions[{r}].bytes is 0")
        src_limit, src_end = _check_side(r, "src", src_side, nbytes)
        dst_limit, dst_end = _check_side(r, "dst", dst_side, nbytes)
        if src_side[0] < dst_end and dst_side[0] < src_end:
            raise CopyArgumentError(
                f"regions[{r}]: source extent [{src_side[0]:#x}, {src_end:#x}) and destination "
                f"extent [{dst_side[0]:#x}, {dst_end:#x}) overlap"
            )
        out.append((begin, count, src_limit, dst_limit))
    return tuple(out)


def _range_stats(r: int, src: IdArray, dst: IdArray, begin: int, count: int) -> tuple[int, ...]:
    """``(min src id, max src id, min dst id, max dst id)`` of pairs ``[begin, begin + count)``.

    Raises:
        CopyArgumentError: a destination id repeats in the range.
    """
    s, d = src[begin : begin + count], dst[begin : begin + count]
    if count <= _SMALL_RANGE:
        sl, dl = s.tolist(), d.tolist()
        if len(set(dl)) == len(dl):
            return min(sl), max(sl), min(dl), max(dl)
    stats = (int(s.min()), int(s.max()), int(d.min()), int(d.max()))
    if count > 1:
        sorted_d = np.sort(d)
        dup = np.flatnonzero(sorted_d[1:] == sorted_d[:-1])
        if dup.size:
            raise CopyArgumentError(
                f"regions[{r}]: destination id {int(sorted_d[dup[0]])} appears more than once in "
                f"pairs [{begin}, {begin + count}) (two copies would write the same bytes)"
            )
    return stats


def check_prepared(regions: RegionArray, src: IdArray, dst: IdArray) -> None:
    """``check_copy_blocks`` on arrays already prepared by ``as_regions`` / ``as_ids``."""
    check_pair_counts(src, dst)
    num_pairs = len(src)
    # Statistics of each distinct pair range, computed once: regions of a group share one.
    range_stats: dict[tuple[int, int], tuple[int, ...]] = {}
    for r, (begin, count, src_limit, dst_limit) in enumerate(_region_geometry(regions.tobytes())):
        if begin < 0 or count < 0 or begin > num_pairs or count > num_pairs - begin:
            raise CopyArgumentError(
                f"regions[{r}]: pairs [{begin}, {begin} + {count}) are not within "
                f"[0, num_pairs={num_pairs})"
            )
        if count == 0:
            continue
        stats = range_stats.get((begin, count))
        if stats is None:
            stats = range_stats[(begin, count)] = _range_stats(r, src, dst, begin, count)
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
