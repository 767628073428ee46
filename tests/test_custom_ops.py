# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of vllm._custom_ops: block copies (torch backend always, CUDA when a GPU is present),
argument checks and error reports of the C library (run on CPU against the built .so), the C
self-test's checks that need no GPU, and the library's build."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import mmap
import os
import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.cuda_helpers import DeviceBuffer
from tests.subprocesses import run_python
from vllm import _custom_ops as ops
from vllm.kv_copy.cuda_library import TEST_BATCH_RESULT_ENV, default_library_path

ROOT = Path(__file__).resolve().parents[1]

LIB = ops.cuda_library()
DEVICES = ops.cuda_devices()
NUM_GPUS = DEVICES.count
needs_lib = pytest.mark.skipif(
    LIB is None, reason="the CUDA copy library is not built (pip install -e . with nvcc present)"
)
needs_gpu = pytest.mark.skipif(
    NUM_GPUS == 0, reason=f"needs a CUDA GPU usable by the copy library: {DEVICES.problem}"
)
DEV = 0  # the device every CUDA test runs on


def _buffer(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=g)


def _pinnable(nbytes: int, seed: int) -> torch.Tensor:
    """Random bytes in a private anonymous mapping: page-aligned, sharing no page with any other
    allocation, so registering it with CUDA cannot collide with another registration."""
    t = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.int8)
    t.copy_(_buffer(nbytes, seed))
    return t


def _reference_copy(
    regions: np.ndarray,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    src_buf: np.ndarray,
    src_base: int,
    dst_buf: np.ndarray,
    dst_base: int,
) -> None:
    """The semantics of a job, one pair at a time, on byte arrays standing for the memory."""
    for r in regions:
        for p in range(int(r["pair_begin"]), int(r["pair_begin"]) + int(r["pair_count"])):
            offs = []
            for side, ids, base in (("src", src_ids, src_base), ("dst", dst_ids, dst_base)):
                s = r[side]
                i = int(ids[p])
                k = int(s["sub_blocks"])
                addr = (
                    int(s["base"])
                    + (i // k) * int(s["block_stride"])
                    + (i % k) * int(s["sub_stride"])
                )
                offs.append(addr - base)
            n = int(r["bytes"])
            dst_buf[offs[1] : offs[1] + n] = src_buf[offs[0] : offs[0] + n]


def _job(
    src: torch.Tensor, dst: torch.Tensor, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A job with two groups: a per-layer-like region set with sub-blocks, and a plain one."""
    rng = np.random.default_rng(seed)
    s0, d0 = src.data_ptr(), dst.data_ptr()
    # group 0: src blocks of 96 bytes (stride 128); dst rows of 3 sub-blocks of 100 (stride 320).
    # group 1: 64-byte pages both sides, contiguous blocks (adjacent copies get merged).
    n0, n1 = 5, 6
    src_ids = np.concatenate([rng.choice(16, n0, replace=False), np.arange(3, 3 + n1)]).astype(
        np.int64
    )
    dst_ids = np.concatenate([rng.choice(8 * 3, n0, replace=False), np.arange(10, 10 + n1)]).astype(
        np.int64
    )
    regions = ops.make_regions(
        [
            ops.CopyRegion(
                ops.BlockSide(s0, 128, 16), ops.BlockSide(d0, 320, 8, 3, 100), 96, 0, n0
            ),
            ops.CopyRegion(
                ops.BlockSide(s0 + 2048, 128, 16),
                ops.BlockSide(d0 + 2560, 320, 8, 3, 100),
                100,
                0,
                n0,
            ),
            ops.CopyRegion(
                ops.BlockSide(s0 + 4096, 64, 16), ops.BlockSide(d0 + 5120, 64, 32), 64, n0, n1
            ),
        ]
    )
    return regions, src_ids, dst_ids


# ---------------------------------------------------------------------------------------------
# Torch backend
# ---------------------------------------------------------------------------------------------


def test_region_dtype_matches_c_layout() -> None:
    assert ops.REGION_DTYPE.itemsize == 104
    assert ops.BLOCK_SIDE_DTYPE.itemsize == 40
    if LIB is not None:
        assert LIB.raw.kvo_copy_region_size() == ops.REGION_DTYPE.itemsize
        assert LIB.raw.kvo_abi_version() == ops.ABI_VERSION


def test_torch_copy_blocks_matches_reference_and_leaves_other_bytes() -> None:
    src, dst = _buffer(8192, 1), _buffer(8192, 2)
    regions, src_ids, dst_ids = _job(src, dst, seed=3)
    expected = dst.numpy().copy()
    _reference_copy(
        regions, src_ids, dst_ids, src.numpy(), src.data_ptr(), expected, dst.data_ptr()
    )
    before_src = src.clone()
    ops.copy_blocks(regions, src_ids, dst_ids, backend="torch")
    assert np.array_equal(dst.numpy(), expected)
    assert torch.equal(src, before_src)
    assert not np.array_equal(expected, _buffer(8192, 2).numpy()), "the job must move something"


@st.composite
def _host_jobs(draw: st.DrawFn) -> tuple[list[ops.CopyRegion], np.ndarray, np.ndarray]:
    """Valid jobs in the shapes the handlers build: per layer (regions of one page each, over
    separate "GPU" planes and shared CPU rows), stores and loads, with or without sub-blocks on
    either side, ids scattered or in runs on either side, pair counts on both sides of the
    indexed path's threshold, and regions large enough for the one-pass copies of runs (8 KiB
    pages). Bases are offsets (the test places them on its buffers)."""
    layers = draw(st.integers(1, 3))
    page = draw(st.sampled_from([64, 96, 256, 8192]))
    k_gpu, k_cpu = draw(st.sampled_from([(1, 1), (1, 2), (3, 1)]))
    n = draw(st.integers(1, 12))
    num_blocks = 24

    def ids(k: int) -> np.ndarray:
        scattered = st.permutations(range(num_blocks * k)).map(lambda p: p[:n])
        run = st.integers(0, num_blocks * k - n).map(lambda a: list(range(a, a + n)))
        return np.array(draw(st.one_of(scattered, run)), np.int64)

    gpu_ids, cpu_ids = ids(k_gpu), ids(k_cpu)
    # "GPU" planes: 2 per layer (K, V), each a pool of blocks of k_gpu pages, one after another
    # with a gap (of a whole page: the job is one flat copy; of 512 bytes: flat only for pages
    # that divide it); CPU rows of every plane's page (k_cpu sub-blocks per row and plane).
    plane_bytes = num_blocks * k_gpu * page + draw(st.sampled_from([page, 512]))
    row = 2 * layers * k_cpu * page
    store = draw(st.booleans())
    regions = []
    for j in range(2 * layers):
        gpu = ops.BlockSide(j * plane_bytes, k_gpu * page, num_blocks, k_gpu, page)
        cpu = ops.BlockSide(j * k_cpu * page, row, num_blocks, k_cpu, page)
        src, dst = (gpu, cpu) if store else (cpu, gpu)
        regions.append(ops.CopyRegion(src, dst, page, 0, n))
    return (regions, gpu_ids, cpu_ids) if store else (regions, cpu_ids, gpu_ids)


def _extent(sides: list[ops.BlockSide]) -> int:
    return max(x.base + x.num_blocks * x.block_stride for x in sides)


@settings(max_examples=200, deadline=None)
@given(job=_host_jobs(), threads=st.sampled_from(["1", "2"]))
def test_host_copy_matches_the_reference(
    job: tuple[list[ops.CopyRegion], np.ndarray, np.ndarray], threads: str
) -> None:
    regions, src_ids, dst_ids = job
    src = _buffer(_extent([r.src for r in regions]), 1)
    dst = _buffer(_extent([r.dst for r in regions]), 2)

    def on(buf: torch.Tensor, side: ops.BlockSide) -> ops.BlockSide:
        return dataclasses.replace(side, base=buf.data_ptr() + side.base)

    placed = [dataclasses.replace(r, src=on(src, r.src), dst=on(dst, r.dst)) for r in regions]
    arr = ops.make_regions(placed)
    expected = dst.numpy().copy()
    _reference_copy(arr, src_ids, dst_ids, src.numpy(), src.data_ptr(), expected, dst.data_ptr())
    old = os.environ.get(ops.HOST_COPY_THREADS_ENV)
    os.environ[ops.HOST_COPY_THREADS_ENV] = threads
    try:
        ops.copy_blocks(arr, src_ids, dst_ids, backend="torch")
    finally:
        if old is None:
            del os.environ[ops.HOST_COPY_THREADS_ENV]
        else:
            os.environ[ops.HOST_COPY_THREADS_ENV] = old
    assert np.array_equal(dst.numpy(), expected)


def test_merge_regions_joins_regions_that_continue_each_other() -> None:
    def region(src: int, dst: int, nbytes: int, begin: int = 0, k: int = 1) -> ops.CopyRegion:
        return ops.CopyRegion(
            ops.BlockSide(src, 4096, 8), ops.BlockSide(dst, 8192, 8, k, 256), nbytes, begin, 4
        )

    merged = ops.merge_regions(
        ops.make_regions(
            [
                region(0x10000, 0x90000, 128),
                region(0x10080, 0x90080, 128),  # continues on both sides: merged
                region(0x10100, 0x90180, 64),  # a gap on the dst side
                region(0x10140, 0x901C0, 64, begin=1),  # other pairs
            ]
        )
    )
    assert [(r[0][0], r[1][0], r[2], r[3]) for r in merged] == [
        (0x10000, 0x90000, 256, 0),
        (0x10100, 0x90180, 64, 0),
        (0x10140, 0x901C0, 64, 1),
    ]
    # With sub-blocks, a merge may not outgrow the sub-block.
    subs = ops.merge_regions(
        ops.make_regions([region(0x10000, 0x90000, 192, k=2), region(0x100C0, 0x900C0, 128, k=2)])
    )
    assert [r[2] for r in subs] == [192, 128]


def _pages_job(
    page: int, n: int, regions: int, *, runs: bool, row: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A job of ``n`` pairs over ``regions`` regions of ``page`` bytes (addresses only: the
    method choice reads no memory). ``row``: the CPU side's block stride (default: the pages
    of every region side by side); ids consecutive on both sides if ``runs``."""
    row = row or page * regions
    made = [
        ops.CopyRegion(
            ops.BlockSide(0x1000_0000 + j * (1 << 30), page, 4 * n),
            ops.BlockSide(0x8000_0000_0000 + j * page, row, 4 * n),
            page,
            0,
            n,
        )
        for j in range(regions)
    ]
    ids = np.arange(n, dtype=np.int64)
    scattered = np.random.default_rng(0).permutation(4 * n)[:n].astype(np.int64)
    return ops.make_regions(made), ids if runs else scattered, ids if runs else scattered[::-1]


def test_copy_method_policy_chooses_the_kernel_for_small_chunks_and_dma_for_large() -> None:
    policy = ops.CopyMethodPolicy()
    assert policy.store_dma_min_chunk_bytes == policy.load_dma_min_chunk_bytes == 1 << 20
    kernel, dma = ops.CopyMethod.KERNEL, ops.CopyMethod.DMA
    per_layer = _pages_job(4096, 64, 16, runs=True)  # 16 pages of 4 KiB per block
    assert ops.mean_chunk_bytes(*per_layer) == 4096
    assert policy.choose(*per_layer, store=True) is kernel
    assert policy.choose(*per_layer, store=False) is kernel
    big = _pages_job(2 << 20, 8, 1, runs=False)  # 2 MiB blocks, one region
    assert policy.choose(*big, store=True) is dma and policy.choose(*big, store=False) is dma
    # Whole 64 KiB rows: consecutive ids on both sides merge into one 4 MiB chunk (DMA); the
    # same job scattered is 64 chunks of 64 KiB (kernel).
    rows = _pages_job(64 << 10, 64, 1, runs=True, row=64 << 10)
    assert ops.mean_chunk_bytes(*rows) == 64 * (64 << 10)
    assert policy.choose(*rows, store=False) is dma
    assert policy.choose(*_pages_job(64 << 10, 64, 1, runs=False), store=False) is kernel
    # Per direction, and exactly at the threshold.
    loads_by_dma = ops.CopyMethodPolicy(load_dma_min_chunk_bytes=4096)
    assert loads_by_dma.choose(*per_layer, store=False) is dma
    assert loads_by_dma.choose(*per_layer, store=True) is kernel
    # Without pinned, mapped host memory the kernel cannot run; a fixed method is kept.
    assert policy.choose(*per_layer, store=True, kernel_available=False) is dma
    fixed = ops.CopyMethodPolicy(method=ops.CopyMethod.DMA_LOOP)
    assert fixed.choose(*per_layer, store=True) is ops.CopyMethod.DMA_LOOP
    forced = ops.CopyMethodPolicy(method=kernel)
    assert forced.choose(*big, store=True) is kernel
    assert forced.choose(*big, store=True, kernel_available=False) is dma
    assert ops.mean_chunk_bytes(*_pages_job(4096, 0, 2, runs=True)) == 0.0
    with pytest.raises(ValueError, match="store_dma_min_chunk_bytes=-1"):
        ops.CopyMethodPolicy(store_dma_min_chunk_bytes=-1)


def test_expand_copies_merges_adjacent_copies() -> None:
    src, dst = _buffer(4096, 1), _buffer(4096, 2)
    regions = ops.make_regions(
        [
            ops.CopyRegion(
                ops.BlockSide(src.data_ptr(), 64, 32),
                ops.BlockSide(dst.data_ptr(), 64, 32),
                64,
                0,
                6,
            )
        ]
    )
    ids_src = np.array([0, 1, 2, 7, 8, 20], dtype=np.int64)
    ids_dst = np.array([4, 5, 6, 9, 10, 0], dtype=np.int64)
    d, s, n = ops.expand_copies(regions, ids_src, ids_dst)
    assert n.tolist() == [192, 128, 64]
    assert (d - dst.data_ptr()).tolist() == [256, 576, 0]
    assert (s - src.data_ptr()).tolist() == [0, 448, 1280]
    ops.copy_blocks(regions, ids_src, ids_dst, backend="torch")
    for a, b in zip(ids_src, ids_dst, strict=True):
        assert torch.equal(dst[b * 64 : b * 64 + 64], src[a * 64 : a * 64 + 64])


@pytest.mark.parametrize("aligned", [True, False], ids=["one-flat-copy", "one-plane-off"])
def test_a_large_per_layer_job_is_exact_on_threads(
    aligned: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A per-layer job above the threads' threshold: 8 planes of 4 KiB pages (as the engine's
    # layers), one CPU row of every plane's page per block, ids scattered on both sides; planes
    # from one offset of a page (copied as one flat copy of every region's pages), or one of
    # them 64 bytes off (that region alone region by region, the others one flat copy).
    monkeypatch.setenv(ops.HOST_COPY_THREADS_ENV, "2")
    page, planes, n, pool = 4096, 8, 160, 256  # 160 blocks x 32 KiB: 5 MiB
    gpu = _pinnable(planes * pool * page + page, 7)
    cpu = torch.zeros(pool * planes * page, dtype=torch.int8)
    rng = np.random.default_rng(1)
    gpu_ids = rng.permutation(pool)[:n].astype(np.int64)
    cpu_ids = rng.permutation(pool)[:n].astype(np.int64)
    skew = [0] * planes if aligned else [0, 0, 0, 64, 0, 0, 0, 0]
    sides = [
        ops.BlockSide(gpu.data_ptr() + j * pool * page + skew[j], page, pool) for j in range(planes)
    ]
    rows = [ops.BlockSide(cpu.data_ptr() + j * page, planes * page, pool) for j in range(planes)]
    for store in (True, False):
        regions = ops.make_regions(
            [
                ops.CopyRegion(g, c, page, 0, n) if store else ops.CopyRegion(c, g, page, 0, n)
                for g, c in zip(sides, rows, strict=True)
            ]
        )
        src_ids, dst_ids = (gpu_ids, cpu_ids) if store else (cpu_ids, gpu_ids)
        src, dst = (gpu, cpu) if store else (cpu, gpu)
        expected = dst.numpy().copy()
        _reference_copy(
            regions, src_ids, dst_ids, src.numpy(), src.data_ptr(), expected, dst.data_ptr()
        )
        if not store:
            cpu.copy_(_buffer(cpu.numel(), 8))  # loads read other bytes than stores wrote
            expected = gpu.numpy().copy()
            _reference_copy(
                regions, src_ids, dst_ids, cpu.numpy(), cpu.data_ptr(), expected, gpu.data_ptr()
            )
        ops.copy_blocks(regions, src_ids, dst_ids, backend="torch")
        assert np.array_equal(dst.numpy(), expected)


@pytest.mark.parametrize("store", [True, False], ids=["store", "load"])
@pytest.mark.parametrize("run", ["gpu", "cpu", "none"])
def test_per_layer_jobs_on_one_thread_are_exact_at_any_plane_offset(
    store: bool, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's shape on one thread: 8 planes of 4 KiB pages, each layer's K and V planes in
    # one tensor and the layers' tensors at different offsets of a page (as separately
    # allocated tensors are), one CPU row of every plane's page per block; a job of 48 blocks
    # (192 KiB per region: runs are copied in one pass) with consecutive ids on the GPU side,
    # on the CPU side, or on neither.
    monkeypatch.setenv(ops.HOST_COPY_THREADS_ENV, "1")
    page, layers, n, pool = 4096, 4, 48, 64
    layer_bytes = 2 * pool * page
    gpu = _buffer(layers * (layer_bytes + page), 3)
    cpu = _buffer(pool * 2 * layers * page, 4)
    rng = np.random.default_rng(2)
    gpu_ids = np.arange(5, 5 + n) if run == "gpu" else rng.permutation(pool)[:n]
    cpu_ids = np.arange(9, 9 + n) if run == "cpu" else rng.permutation(pool)[:n]
    regions = []
    for layer in range(layers):
        base = gpu.data_ptr() + layer * (layer_bytes + page) + 128 * layer  # offsets differ
        for kv in range(2):
            plane = ops.BlockSide(base + kv * pool * page, page, pool)
            row = ops.BlockSide(cpu.data_ptr() + (2 * layer + kv) * page, 2 * layers * page, pool)
            src, dst = (plane, row) if store else (row, plane)
            regions.append(ops.CopyRegion(src, dst, page, 0, n))
    arr = ops.make_regions(regions)
    src_ids, dst_ids = (gpu_ids, cpu_ids) if store else (cpu_ids, gpu_ids)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    expected = dst.numpy().copy()
    _reference_copy(arr, src_ids, dst_ids, src.numpy(), src.data_ptr(), expected, dst.data_ptr())
    ops.copy_blocks(arr, src_ids.astype(np.int64), dst_ids.astype(np.int64), backend="torch")
    assert np.array_equal(dst.numpy(), expected)


def test_host_memmove_parallel_split_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ops.HOST_COPY_THREADS_ENV, "3")
    rows, row = 96, 64 << 10  # 6 MiB: above the threshold for splitting across threads
    src, dst = _buffer(rows * row, 5), torch.zeros(rows * row + row, dtype=torch.int8)
    perm = np.random.default_rng(0).permutation(rows).astype(np.int64)
    regions = ops.make_regions(
        [
            ops.CopyRegion(
                ops.BlockSide(src.data_ptr(), row, rows),
                ops.BlockSide(dst.data_ptr() + row, row, rows),
                row,
                0,
                rows,
            )
        ]
    )
    ops.copy_blocks(regions, np.arange(rows), perm, backend="torch")
    out = dst[row:].view(rows, row)
    assert torch.equal(out[torch.from_numpy(perm)], src.view(rows, row))
    assert not dst[:row].any()
    # Copies larger than a chunk (one of 5 MiB + 3 bytes, odd offsets) are cut into pieces.
    big = (5 << 20) + 3
    dst.zero_()
    ops.host_memmove(
        np.array([dst.data_ptr() + 5, dst.data_ptr() + big + 9], dtype=np.uint64),
        np.array([src.data_ptr() + 1, src.data_ptr() + big + 7], dtype=np.uint64),
        np.array([big, 1000], dtype=np.uint64),
    )
    assert torch.equal(dst[5 : 5 + big], src[1 : 1 + big])
    assert torch.equal(dst[big + 9 : big + 1009], src[big + 7 : big + 1007])
    assert not dst[:5].any() and not dst[5 + big : big + 9].any() and not dst[big + 1009 :].any()


def test_copy_backend_is_logged_and_overridable(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    try:
        monkeypatch.setenv(ops.BACKEND_ENV, "torch")
        ops.copy_backend.cache_clear()
        assert ops.copy_backend() == "torch"
        monkeypatch.setenv(ops.BACKEND_ENV, "auto")
        ops.copy_backend.cache_clear()
        with caplog.at_level("INFO", logger="vllm._custom_ops"):
            assert ops.copy_backend() == ("cuda" if NUM_GPUS else "torch")
        if NUM_GPUS == 0:
            # The reason names the real problem (e.g. the CUDA error of a too old driver).
            assert DEVICES.problem and DEVICES.problem in caplog.text
            monkeypatch.setenv(ops.BACKEND_ENV, "cuda")
            ops.copy_backend.cache_clear()
            with pytest.raises(RuntimeError, match="unusable") as info:
                ops.copy_backend()
            assert DEVICES.problem in str(info.value)
        monkeypatch.setenv(ops.BACKEND_ENV, "bogus")
        ops.copy_backend.cache_clear()
        with pytest.raises(ValueError, match="bogus"):
            ops.copy_backend()
    finally:
        ops.copy_backend.cache_clear()


def test_cuda_backend_needs_a_device() -> None:
    regions, s, d = _valid_job()
    with pytest.raises(ops.CopyArgumentError, match="device="):
        ops.copy_blocks(ops.make_regions(regions), s, d, backend="cuda")


def test_default_library_path_takes_a_library_built_for_another_python(
    tmp_path: Path,
) -> None:
    assert default_library_path(tmp_path) is None
    foreign = tmp_path / "_kv_offload_cuda.cpython-399-x86_64-linux-gnu.so"
    foreign.touch()
    assert default_library_path(tmp_path) == foreign
    own = tmp_path / "_kv_offload_cuda.so"
    own.touch()
    assert default_library_path(tmp_path) == own  # the interpreter's own suffix wins


# ---------------------------------------------------------------------------------------------
# Argument checks: Python twin and C library agree
# ---------------------------------------------------------------------------------------------


def _valid_job() -> tuple[list[ops.CopyRegion], list[int], list[int]]:
    src = ops.BlockSide(base=0x10000, block_stride=256, num_blocks=8)
    dst = ops.BlockSide(
        base=0x100000, block_stride=1024, num_blocks=4, sub_blocks=4, sub_stride=256
    )
    return [ops.CopyRegion(src, dst, 200, 0, 3)], [0, 5, 7], [0, 9, 15]


def _bad_jobs() -> dict[str, tuple[list[ops.CopyRegion], list[int], list[int]]]:
    (r,), s, d = _valid_job()
    src, dst = r.src, r.dst

    def with_(**kw: Any) -> ops.CopyRegion:
        return dataclasses.replace(r, **kw)

    def side(orig: ops.BlockSide, **kw: int) -> ops.BlockSide:
        return dataclasses.replace(orig, **kw)

    return {
        "zero bytes": ([with_(bytes=0)], s, d),
        "null src base": ([with_(src=side(src, base=0))], s, d),
        "no blocks": ([with_(dst=side(dst, num_blocks=0))], s, d),
        "zero sub_blocks": ([with_(dst=side(dst, sub_blocks=0))], s, d),
        "bytes > sub_stride": ([with_(bytes=257)], s, d),
        "blocks overlap": ([with_(dst=side(dst, block_stride=700))], s, d),
        "src page > stride": ([with_(bytes=250, src=side(src, block_stride=200))], s, d),
        "wraps": ([with_(src=side(src, base=(1 << 64) - 1000))], s, d),
        "pairs past end": ([with_(pair_begin=1)], s, d),
        "negative count": ([with_(pair_count=-1)], s, d),
        "src id too big": ([with_()], [0, 8, 7], d),
        "dst id too big": ([with_()], s, [0, 9, 16]),
        "negative id": ([with_()], [0, -1, 7], d),
        "duplicate dst": ([with_()], s, [9, 0, 9]),
        "src/dst overlap": ([with_(dst=side(dst, base=0x10100))], s, d),
        "length mismatch": ([with_()], s, [0, 9]),
    }


@pytest.mark.parametrize("case", sorted(_bad_jobs()))
def test_bad_arguments_rejected_by_python_and_library(case: str) -> None:
    regions, s, d = _bad_jobs()[case]
    arr = ops.make_regions(regions)
    with pytest.raises(ops.CopyArgumentError):
        ops.check_copy_blocks(arr, s, d)
    with pytest.raises(ops.CopyArgumentError):
        ops.copy_blocks(arr, s, d, backend="torch")  # refused before any byte is touched
    if LIB is not None:
        with pytest.raises(ops.CopyArgumentError):
            LIB.check_copy_blocks(arr, np.asarray(s, np.int64), np.asarray(d, np.int64))


def test_valid_arguments_accepted_by_python_and_library() -> None:
    regions, s, d = _valid_job()
    arr = ops.make_regions(regions)
    ops.check_copy_blocks(arr, s, d)
    if LIB is not None:
        LIB.check_copy_blocks(arr, np.asarray(s, np.int64), np.asarray(d, np.int64))


_U64 = st.sampled_from([0, 1, 64, 100, 256, 4096, 1 << 40, (1 << 64) - 4096, (1 << 64) - 1])


@st.composite
def _side(draw: st.DrawFn) -> ops.BlockSide:
    return ops.BlockSide(
        base=draw(_U64),
        block_stride=draw(st.sampled_from([0, 64, 100, 256, 1024, 1 << 62])),
        num_blocks=draw(st.integers(-1, 6)),
        sub_blocks=draw(st.integers(-1, 4)),
        sub_stride=draw(st.sampled_from([0, 50, 64, 100, 256])),
    )


@needs_lib
@settings(max_examples=300, deadline=None)
@given(
    regions=st.lists(
        st.builds(
            ops.CopyRegion,
            src=_side(),
            dst=_side(),
            bytes=st.sampled_from([0, 1, 50, 64, 100]),
            pair_begin=st.integers(-1, 5),
            pair_count=st.integers(-1, 5),
        ),
        max_size=3,
    ),
    ids=st.lists(st.tuples(st.integers(-1, 25), st.integers(-1, 25)), max_size=5),
)
def test_python_and_library_checks_agree(
    regions: list[ops.CopyRegion], ids: list[tuple[int, int]]
) -> None:
    assert LIB is not None
    arr = ops.make_regions(regions)
    s = np.array([a for a, _ in ids], dtype=np.int64)
    d = np.array([b for _, b in ids], dtype=np.int64)
    outcomes = []
    for check in (ops.check_copy_blocks, LIB.check_copy_blocks):
        try:
            check(arr, s, d)
            outcomes.append(True)
        except ops.CopyArgumentError:
            outcomes.append(False)
    assert outcomes[0] == outcomes[1], f"python accepts={outcomes[0]}, C accepts={outcomes[1]}"
    event("accepted" if outcomes[0] else "rejected")


@needs_lib
def test_library_entry_points_reject_null_and_bad_handles() -> None:
    """Argument errors are found before CUDA is touched, so this runs without a GPU too."""
    assert LIB is not None
    raw = LIB.raw
    bad = ops.KVO_ERR_INVALID_ARGUMENT
    regions, s, d = _valid_job()
    arr = ops.make_regions(regions)
    si, di = np.asarray(s, np.int64), np.asarray(d, np.int64)
    assert raw.kvo_check_copy_blocks(None, 1, si.ctypes.data, di.ctypes.data, 3) == bad
    assert "regions is NULL" in LIB.last_error()
    assert raw.kvo_check_copy_blocks(arr.ctypes.data, 1, None, di.ctypes.data, 3) == bad
    assert raw.kvo_check_copy_blocks(arr.ctypes.data, -1, None, None, 0) == bad
    assert raw.kvo_check_copy_blocks(arr.ctypes.data, 1, si.ctypes.data, di.ctypes.data, -2) == bad
    assert raw.kvo_check_copy_blocks(None, 0, None, None, 0) == ops.KVO_OK
    assert LIB.last_error() == ""
    args = (arr.ctypes.data, 1, si.ctypes.data, di.ctypes.data, 3)
    assert raw.kvo_copy_blocks(DEV, *args, 7, 0, None) == bad  # unknown method
    assert "method" in LIB.last_error()
    assert raw.kvo_copy_blocks(DEV, *args, 2, -1, None) == bad
    assert raw.kvo_copy_blocks(DEV, *args, 2, 70000, None) == bad
    assert raw.kvo_copy_blocks(DEV, None, 1, si.ctypes.data, di.ctypes.data, 3, 0, 0, None) == bad
    assert raw.kvo_copy_blocks(-1, *args, 0, 0, None) == bad
    assert "device=-1" in LIB.last_error()
    assert raw.kvo_device_count(None) == bad
    assert raw.kvo_dma_batch_available(None) == bad
    assert raw.kvo_dma_batch_fallbacks(None, None, 0) == bad
    assert raw.kvo_stream_create(DEV, None, 0) == bad
    assert raw.kvo_stream_destroy(DEV, None) == bad
    assert raw.kvo_stream_wait_event(DEV, None, None) == bad
    assert raw.kvo_event_create(DEV, None, 1) == bad
    assert raw.kvo_event_destroy(DEV, None) == bad
    assert raw.kvo_event_record(DEV, None, None) == bad
    assert raw.kvo_event_query(DEV, None, None) == bad
    assert raw.kvo_event_synchronize(DEV, None) == bad
    assert raw.kvo_event_elapsed_ms(DEV, None, None, None) == bad
    buf = ctypes.create_string_buffer(64)
    assert raw.kvo_host_register(DEV, None, 64, 0, None) == bad
    assert raw.kvo_host_register(DEV, ctypes.addressof(buf), 0, 0, None) == bad
    assert raw.kvo_host_register(DEV, ctypes.addressof(buf), 64, 0x80, None) == bad
    assert "flags" in LIB.last_error()
    assert raw.kvo_host_unregister(DEV, None) == bad
    # A negative device is an argument error wherever a device is taken, never a CUDA error.
    handle = ctypes.c_void_p()
    done = ctypes.c_int()
    for name, call in {
        "stream_create": lambda: raw.kvo_stream_create(-1, ctypes.byref(handle), 0),
        "stream_synchronize": lambda: raw.kvo_stream_synchronize(-1, None),
        "event_create": lambda: raw.kvo_event_create(-1, ctypes.byref(handle), 0),
        "event_query": lambda: raw.kvo_event_query(-1, 1, ctypes.byref(done)),
        "host_register": lambda: raw.kvo_host_register(-1, ctypes.addressof(buf), 64, 0, None),
        "host_unregister": lambda: raw.kvo_host_unregister(-1, ctypes.addressof(buf)),
    }.items():
        assert call() == bad, name
        assert "device=-1" in LIB.last_error(), name
    for gone in ("kvo_memcpy_batch", "kvo_host_get_device_pointer", "kvo_set_device"):
        assert not hasattr(raw, gone), f"{gone} was removed in ABI 3"


@needs_lib
def test_batch_fallbacks_start_at_zero() -> None:
    assert LIB is not None
    count, reason = LIB.dma_batch_fallbacks()
    assert (count, reason) == (0, "")


@needs_lib
@pytest.mark.skipif(NUM_GPUS > 0, reason="checks the no-GPU behaviour of the library")
def test_library_without_gpu_reports_cuda_errors() -> None:
    assert LIB is not None
    # No driver here: an error naming the CUDA error, not "0 devices".
    with pytest.raises(ops.CudaCopyError, match=r"cudaGetDeviceCount failed: .*cudaError"):
        LIB.device_count()
    assert "cannot use CUDA" in DEVICES.problem and "cudaGetDeviceCount" in DEVICES.problem
    assert LIB.dma_batch_available() is False
    src, dst = _buffer(8192, 1), _buffer(8192, 2)
    regions, s, d = _job(src, dst, seed=0)
    before = dst.clone()
    for method in ops.CopyMethod:
        with pytest.raises(ops.CudaCopyError, match=r"cudaSetDevice\(0\)"):
            LIB.copy_blocks(DEV, regions, s, d, method, 0, 0)
    assert torch.equal(dst, before)
    with pytest.raises(ops.CudaCopyError):
        LIB.stream_create(DEV)
    with pytest.raises(ops.CudaCopyError):
        LIB.event_create(DEV)


@needs_lib
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the C self-test")
def test_c_selftest_checks(tmp_path: Path) -> None:
    """The C self-test's checks that need no GPU (the batch fallback decision) pass here; with a
    GPU it runs every check (run_gpu_checks.sh also runs its forced-failure modes)."""
    assert LIB is not None
    exe = tmp_path / "copy_selftest"
    lib = Path(LIB.path)
    subprocess.run(
        [
            "g++",
            "-O1",
            "-std=c++17",
            "-pthread",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "benchmarks/kv_offload/copy_selftest.cpp"),
            str(lib),
            f"-Wl,-rpath,{lib.parent}",
            "-o",
            str(exe),
        ],
        check=True,
        capture_output=True,
    )
    run = subprocess.run([str(exe), "--no-bench"], capture_output=True, text=True, timeout=300)
    assert "PASS batch fallback decision" in run.stdout
    assert "FAIL" not in run.stdout, run.stdout
    assert run.returncode == (0 if NUM_GPUS else 77), run.stdout + run.stderr


# ---------------------------------------------------------------------------------------------
# CUDA backend
# ---------------------------------------------------------------------------------------------


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("method", list(ops.CopyMethod))
def test_cuda_copy_blocks_round_trip(method: ops.CopyMethod) -> None:
    """Host -> device -> host with the job of the torch test: same bytes as the reference."""
    assert LIB is not None
    host = _pinnable(2 * 8192, 11)
    host_src, host_out = host[:8192], host[8192:]
    flags = ops.HOST_REGISTER_PORTABLE | ops.HOST_REGISTER_MAPPED
    assert LIB.host_register(DEV, host.data_ptr(), host.numel(), flags)
    stream = ops.CudaStream(LIB, DEV)
    fallbacks_before = LIB.dma_batch_fallbacks()[0]
    try:
        with DeviceBuffer(LIB, 8192, DEV) as dev:
            dev.copy_from_host(_buffer(8192, 13).numpy())
            # host_src -> dev
            fake = torch.empty(8192, dtype=torch.int8)  # same geometry, to build the job
            regions, s, d = _job(host_src, fake, seed=4)
            shift = dev.ptr - fake.data_ptr()
            regions["dst"]["base"] += np.uint64(shift % (1 << 64))
            expected_dev = _buffer(8192, 13).numpy().copy()
            _reference_copy(
                regions, s, d, host_src.numpy(), host_src.data_ptr(), expected_dev, dev.ptr
            )
            ops.copy_blocks(
                regions, s, d, backend="cuda", device=DEV, method=method, stream=stream.handle
            )
            # dev -> host_out, the same pairs reversed
            back = regions.copy()
            back["src"], back["dst"] = regions["dst"], regions["src"]
            back["dst"]["base"] += np.uint64(
                (host_out.data_ptr() - host_src.data_ptr()) % (1 << 64)
            )
            expected_out = host_out.numpy().copy()
            _reference_copy(back, d, s, expected_dev, dev.ptr, expected_out, host_out.data_ptr())
            ops.copy_blocks(
                back, d, s, backend="cuda", device=DEV, method=method, stream=stream.handle
            )
            stream.synchronize()
            got_dev = np.empty(8192, dtype=np.int8)
            dev.copy_to_host(got_dev)
            assert np.array_equal(got_dev, expected_dev)
            assert np.array_equal(host_out.numpy(), expected_out)
        # A batch call refused on this machine would still copy (as a loop), only slower.
        count, reason = LIB.dma_batch_fallbacks()
        assert count == fallbacks_before, f"DMA batch calls fell back: {reason}"
    finally:
        stream.close()
        LIB.host_unregister(DEV, host.data_ptr())


@pytest.mark.cuda
@needs_gpu
def test_cuda_kernel_path_rejects_unregistered_host_memory() -> None:
    assert LIB is not None
    host = _buffer(8192, 1)
    with DeviceBuffer(LIB, 8192, DEV) as dev:
        regions = ops.make_regions(
            [
                ops.CopyRegion(
                    ops.BlockSide(host.data_ptr(), 64, 8), ops.BlockSide(dev.ptr, 64, 8), 64, 0, 1
                )
            ]
        )
        with pytest.raises(ops.CopyArgumentError, match="cannot reach"):
            LIB.copy_blocks(DEV, regions, np.array([0]), np.array([1]), ops.CopyMethod.KERNEL, 0, 0)


@pytest.mark.cuda
@needs_gpu
def test_cuda_kernel_unaligned_and_odd_sizes() -> None:
    """Scalar head/tail and every vector width: odd offsets and sizes, checked byte for byte."""
    assert LIB is not None
    host = _pinnable(1 << 16, 21)
    flags = ops.HOST_REGISTER_PORTABLE | ops.HOST_REGISTER_MAPPED
    assert LIB.host_register(DEV, host.data_ptr(), host.numel(), flags)
    try:
        with DeviceBuffer(LIB, 1 << 16, DEV) as dev:
            init = _buffer(1 << 16, 22).numpy()
            dev.copy_from_host(init)
            expected = init.copy()
            regions = []
            for i, (src_off, dst_off, n) in enumerate(
                [(0, 0, 4096), (1, 3, 1001), (2, 18, 777), (4, 40, 999), (8, 24, 1500), (16, 0, 17)]
            ):
                base = 8192 * i
                regions.append(
                    ops.CopyRegion(
                        ops.BlockSide(host.data_ptr() + base + src_off, 4096 + 32, 1),
                        ops.BlockSide(dev.ptr + base + dst_off, 4096 + 32, 1),
                        n,
                        0,
                        1,
                    )
                )
                expected[base + dst_off : base + dst_off + n] = host.numpy()[
                    base + src_off : base + src_off + n
                ]
            arr = ops.make_regions(regions)
            LIB.copy_blocks(DEV, arr, np.array([0]), np.array([0]), ops.CopyMethod.KERNEL, 3, 0)
            LIB.stream_synchronize(DEV, 0)
            got = np.empty(1 << 16, dtype=np.int8)
            dev.copy_to_host(got)
            assert np.array_equal(got, expected)
    finally:
        LIB.host_unregister(DEV, host.data_ptr())


@pytest.mark.cuda
@needs_gpu
def test_cuda_events_and_streams() -> None:
    assert LIB is not None
    stream = ops.CudaStream(LIB, DEV)
    start, end = ops.CudaEvent(LIB, DEV), ops.CudaEvent(LIB, DEV)
    try:
        start.record(stream.handle)
        end.record(stream.handle)
        end.synchronize()
        assert end.query()
        assert start.elapsed_ms(end) >= 0.0
        assert LIB.dma_batch_available() in (True, False)
        with pytest.raises(ops.CudaCopyError, match="cudaSetDevice"):
            ops.CudaStream(LIB, NUM_GPUS)  # no such device: CUDA's error, naming the call
    finally:
        for r in (start, end, stream):
            r.close()


# A DMA job in a fresh interpreter whose every cuMemcpyBatchAsync call "fails" with the CUresult
# in argv[1] (the library reads the test hook once); prints what happened as JSON.
_FORCED_BATCH_SCRIPT = textwrap.dedent(
    """
    import json, mmap, sys
    import numpy as np, torch
    from tests.cuda_helpers import DeviceBuffer
    from vllm import _custom_ops as ops

    lib = ops.cuda_library()
    host = torch.frombuffer(mmap.mmap(-1, 1 << 16), dtype=torch.int8)
    host.copy_(torch.randint(-128, 128, (1 << 16,), dtype=torch.int8))
    lib.host_register(0, host.data_ptr(), host.numel(), ops.HOST_REGISTER_PORTABLE)
    stream = ops.CudaStream(lib, 0)
    out = {"batch": lib.dma_batch_available(), "error": ""}
    with DeviceBuffer(lib, 1 << 16, 0) as dev:
        side = ops.BlockSide(host.data_ptr(), 4096, 16), ops.BlockSide(dev.ptr, 4096, 16)
        regions = ops.make_regions([ops.CopyRegion(*side, 4096, 0, 4)])
        src, dst = np.array([0, 3, 5, 9]), np.array([15, 2, 7, 1])
        try:
            ops.copy_blocks(regions, src, dst, backend="cuda", device=0, stream=stream.handle)
        except ops.CudaCopyError as e:
            out["error"] = str(e)
        stream.synchronize()
        got = np.empty(1 << 16, dtype=np.int8)
        dev.copy_to_host(got)
        rows = host.numpy().reshape(16, 4096)
        out["exact"] = all(
            np.array_equal(got.reshape(16, 4096)[d], rows[s]) for s, d in zip(src, dst))
    out["fallbacks"], out["reason"] = lib.dma_batch_fallbacks()
    stream.close()
    print(json.dumps(out))
    """
)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(
    ("forced", "name", "falls_back"),
    [(801, "CUDA_ERROR_NOT_SUPPORTED", True), (700, "CUDA_ERROR_ILLEGAL_ADDRESS", False)],
)
def test_cuda_refused_batch_call_falls_back_or_fails_naming_the_cuda_error(
    forced: int, name: str, falls_back: bool
) -> None:
    env = {**os.environ, TEST_BATCH_RESULT_ENV: str(forced), "PYTHONPATH": str(ROOT)}
    run = run_python("-c", _FORCED_BATCH_SCRIPT, env=env)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if not out["batch"]:
        pytest.skip("the driver has no cuMemcpyBatchAsync: the loop is used anyway")
    if falls_back:
        assert out["error"] == "" and out["exact"]
        assert (
            out["fallbacks"] == 1
            and name in out["reason"]
            and f"CUresult {forced}" in out["reason"]
        )
    else:
        assert "cuMemcpyBatchAsync" in out["error"] and name in out["error"], out["error"]
        assert out["fallbacks"] == 0


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("cmake") is None
    or not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")),
    reason="needs cmake and nvcc to build csrc/",
)
def test_library_builds_with_cmake_and_nvcc(tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmake = shutil.which("cmake")
    assert cmake is not None
    build = tmp_path / "build"
    subprocess.run(
        [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={nvcc}",
            "-DCMAKE_CUDA_ARCHITECTURES=80;90",
            f"-DKVO_OUTPUT_DIR={tmp_path}",
            "-DKVO_OUTPUT_NAME=libkvo_test.so",
        ],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [cmake, "--build", str(build), "--parallel", "2"], check=True, capture_output=True
    )
    lib = ops.CudaCopyLibrary(tmp_path / "libkvo_test.so")
    assert lib.raw.kvo_abi_version() == ops.ABI_VERSION
    lib.check_copy_blocks(ops.make_regions([]), np.zeros(0, np.int64), np.zeros(0, np.int64))
