# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The description of a copy job: regions of blocks addressed by id (mirrors ``csrc/kv_offload.h``).

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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from vllm.kv_copy.errors import CopyArgumentError

BLOCK_SIDE_DTYPE: Final = np.dtype(
    [
        ("base", "<u8"),
        ("block_stride", "<u8"),
        ("sub_stride", "<u8"),
        ("num_blocks", "<i8"),
        ("sub_blocks", "<i8"),
    ]
)
"""numpy layout of ``KvoBlockSide`` (40 bytes, no padding)."""

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
"""A 1-D array of ``REGION_DTYPE`` records (``make_regions``)."""

IdArray = npt.NDArray[np.int64]
"""A 1-D, C-contiguous int64 array of block ids."""


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


def as_ids(ids: npt.ArrayLike, what: str) -> IdArray:
    """``ids`` as a contiguous int64 ``IdArray``.

    Raises:
        CopyArgumentError: ``ids`` is not 1-D, or holds non-integers.
    """
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise CopyArgumentError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise CopyArgumentError(f"{what} must hold integers, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def as_regions(regions: RegionArray) -> RegionArray:
    """``regions`` as a contiguous ``REGION_DTYPE`` array.

    Raises:
        CopyArgumentError: not a 1-D numpy array of ``REGION_DTYPE``.
    """
    if not isinstance(regions, np.ndarray) or regions.dtype != REGION_DTYPE or regions.ndim != 1:
        raise CopyArgumentError("regions must be a 1-D numpy array of REGION_DTYPE (make_regions)")
    return np.ascontiguousarray(regions)


def check_pair_counts(src: IdArray, dst: IdArray) -> None:
    """Raise ``CopyArgumentError`` unless ``src`` and ``dst`` have the same length."""
    if len(src) != len(dst):
        raise CopyArgumentError(
            f"src_ids and dst_ids must have the same length, got {len(src)} and {len(dst)}"
        )
