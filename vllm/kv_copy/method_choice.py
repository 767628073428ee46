# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``CopyMethodPolicy``: which CUDA copy path a job takes, by its chunk size and direction.

The copy engines (``CopyMethod.DMA``: one ``cuMemcpyBatchAsync`` per job) pay per contiguous
chunk they move, the SM-copy kernel (``CopyMethod.KERNEL``) mostly per byte. Measured on an H200
(docs/benchmarks.md, "Copy on a GPU"): the kernel holds 41-50 GB/s from 16 KiB chunks up in both
directions, DMA moves 16 KiB chunks at 16 GB/s to the host and 4 GB/s to the device, and passes
the kernel between 256 KiB (kernel 50.5 / 49.5 GB/s, DMA 46.7 / 45.5) and 1 MiB (DMA 53.6 /
52.0, kernel 52.0 / 50.4). Hence the default: chunks of at least 1 MiB take DMA, smaller ones
the kernel, in each direction; a deployment overrides the thresholds per direction.

A job's *chunk* is what the DMA path submits as one copy: a region's bytes per pair, or a run of
pairs whose blocks are contiguous on both sides (merged into one copy, as the library does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from vllm.kv_copy.cuda_library import CopyMethod
from vllm.kv_copy.regions import IdArray, RegionArray

DEFAULT_DMA_MIN_CHUNK_BYTES: Final = 1 << 20
"""Chunks of at least this many bytes take the DMA path (H200 crossover, see the docstring)."""


def _continuing_pairs(src: IdArray, dst: IdArray) -> int:
    """Pairs whose ids both continue the previous pair's (``src + 1``, ``dst + 1``)."""
    if len(src) < 2:
        return 0
    return int(np.count_nonzero((np.diff(src) == 1) & (np.diff(dst) == 1)))


def mean_chunk_bytes(regions: RegionArray, src_ids: IdArray, dst_ids: IdArray) -> float:
    """The job's bytes per chunk the DMA path would submit (0.0 for an empty job).

    O(regions) plus one pass over the ids of each distinct pair range. A run of pairs merges only
    in a region whose blocks are contiguous on both sides (``bytes == block_stride`` and no
    sub-blocks); every other pair is a chunk of its own.
    """
    total_bytes = 0
    chunks = 0
    continuing: dict[tuple[int, int], int] = {}
    for src, dst, nbytes, begin, count in regions.tolist():
        if count <= 0:
            continue
        total_bytes += nbytes * count
        chunks += count
        if nbytes == src[1] == dst[1] and src[4] == dst[4] == 1:
            key = (begin, count)
            if key not in continuing:
                end = begin + count
                continuing[key] = _continuing_pairs(src_ids[begin:end], dst_ids[begin:end])
            chunks -= continuing[key]
    return total_bytes / chunks if chunks else 0.0


@dataclass(frozen=True)
class CopyMethodPolicy:
    """Picks the CUDA copy path of each job (see the module docstring).

    Attributes:
        store_dma_min_chunk_bytes: GPU -> CPU jobs whose mean chunk has at least this many bytes
            take DMA, the others the kernel.
        load_dma_min_chunk_bytes: the same for CPU -> GPU jobs.
        method: a fixed path for every job instead (None: choose by size).
    """

    store_dma_min_chunk_bytes: int = DEFAULT_DMA_MIN_CHUNK_BYTES
    load_dma_min_chunk_bytes: int = DEFAULT_DMA_MIN_CHUNK_BYTES
    method: CopyMethod | None = None

    def __post_init__(self) -> None:
        for name in ("store_dma_min_chunk_bytes", "load_dma_min_chunk_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def choose_fixed(self, kernel_available: bool = True) -> CopyMethod | None:
        """The method of every job when it is fixed (``method``; DMA for the kernel without
        mapped host memory), None when each job's size decides."""
        if self.method is CopyMethod.KERNEL and not kernel_available:
            return CopyMethod.DMA
        return self.method

    def describe(self) -> str:
        """A short description for logs: the fixed method, or ``auto`` with the thresholds."""
        if self.method is not None:
            return self.method.name.lower()
        store, load = self.store_dma_min_chunk_bytes, self.load_dma_min_chunk_bytes
        return f"auto (dma from {store} B per chunk to the CPU, {load} B from it)"

    def choose(
        self,
        regions: RegionArray,
        src_ids: IdArray,
        dst_ids: IdArray,
        *,
        store: bool,
        kernel_available: bool = True,
    ) -> CopyMethod:
        """The path of one job.

        Args:
            regions, src_ids, dst_ids: the job, as ``copy_blocks`` takes it.
            store: GPU -> CPU (else CPU -> GPU).
            kernel_available: whether the host memory is pinned and mapped, as the kernel needs;
                without it every job takes DMA.
        """
        fixed = self.choose_fixed(kernel_available)
        if fixed is not None:
            return fixed
        if not kernel_available:
            return CopyMethod.DMA
        threshold = self.store_dma_min_chunk_bytes if store else self.load_dma_min_chunk_bytes
        chunk = mean_chunk_bytes(regions, src_ids, dst_ids)
        return CopyMethod.DMA if chunk >= threshold else CopyMethod.KERNEL
