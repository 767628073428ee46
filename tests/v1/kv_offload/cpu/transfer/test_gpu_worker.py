# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the GPU <-> CPU handlers: bit-exact round trips for every layout, block-size factor
and group combination (whole GPU and CPU memory compared against an independent per-block
reference, so bytes outside a job are checked untouched), ordering, wait, FIFO and failures.

The torch path (KV cache in host memory) always runs; the CUDA paths (DMA and kernel, KV cache in
device memory allocated through the copy library) run when a GPU is present. The handlers' use of
the library (every call bound to the KV cache's device, from any thread) is also checked without
a GPU, against a recording stand-in for the library. Tests over torch CUDA tensors are in
test_gpu_worker_torch_cuda.py."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import mmap
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cuda_helpers import DeviceBuffer
from tests.v1.kv_offload.utils import closed_at_teardown
from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.transfer.gpu_worker import (
    CpuGpuOffloadingHandlers,
    current_compute_stream,
)
from vllm.v1.kv_offload.cpu.transfer.handler import CrossDirectionOrder
from vllm.v1.kv_offload.worker.canonical import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    KVCacheLayout,
    build_canonical_kv_caches,
)
from vllm.v1.kv_offload.worker.worker import OffloadingWorker, TransferResult, TransferSpec

LIB = ops.cuda_library()
DEVICES = ops.cuda_devices()
HAS_GPU = DEVICES.count > 0
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason=f"needs a CUDA GPU usable by the copy library: {DEVICES.problem}"
)
DEV = 0  # the device the CUDA paths run on

PATHS = [
    pytest.param("torch", id="torch"),
    pytest.param("dma", id="cuda-dma", marks=[pytest.mark.cuda, needs_gpu]),
    pytest.param("kernel", id="cuda-kernel", marks=[pytest.mark.cuda, needs_gpu]),
]
LAYOUTS = list(KVCacheLayout)
NUM_LAYERS, NUM_GPU_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 40, 4, 2, 8
LAYER_GAP = 256  # bytes between layer tensors, checked untouched like everything else


# ---------------------------------------------------------------------------------------------
# Setup: a "GPU" KV cache (host or device memory) and CPU memory, both fully snapshot-able
# ---------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One group combination: per-group factors, layer sets and unpadded page sizes.

    ``block_sizes`` gives each layer's tokens per GPU block (None: ``BLOCK_SIZE`` everywhere):
    groups of different block sizes have canonical tensors of different page sizes, as a hybrid
    model's do. Per-layer tensors only (not ``CROSS_LAYER``, one tensor for every layer).
    """

    name: str
    factors: tuple[int, ...]
    layer_groups: list[list[int]] | None
    unpadded: tuple[int | None, ...] | None  # bytes less than the full page, per group
    block_sizes: tuple[int, ...] | None = None


CONFIGS = [
    Config("1group-k1", (1,), None, None),
    Config("1group-k4", (4,), None, None),
    Config("2groups-disjoint-k1k2", (1, 2), [[0, 1], [2]], None),
    Config("2groups-shared-k2k4-unpadded", (2, 4), [[0, 1, 2], [0, 1, 2]], (None, 40)),
    # GPU block sizes (16, 8) and (8, 16): the group with the larger pages first, then last.
    # 32 tokens of every layer per GPU block id: a worker's page is exactly one region row.
    Config("2groups-blocks16-8-k1k2", (1, 2), [[0], [1, 2]], None, (16, 8, 8)),
    Config("2groups-blocks8-16-k2k1", (2, 1), [[0, 1], [2]], None, (8, 8, 16)),
]


def each_case(
    configs: list[Config], layouts: list[KVCacheLayout]
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Parametrize a test over every copy path, ``configs`` and ``layouts``, ids by name."""

    def parametrize(test: Callable[..., None]) -> Callable[..., None]:
        test = pytest.mark.parametrize("layout", layouts, ids=[x.value for x in layouts])(test)
        test = pytest.mark.parametrize("config", configs, ids=[c.name for c in configs])(test)
        return pytest.mark.parametrize("path", PATHS)(test)

    return parametrize


def _layer_shape(layout: KVCacheLayout, block_size: int = BLOCK_SIZE) -> tuple[int, ...]:
    if layout is KVCacheLayout.KV_FIRST:
        return (2, NUM_GPU_BLOCKS, block_size, HEADS, HEAD_DIM)
    if layout is KVCacheLayout.BLOCKS_FIRST:
        return (NUM_GPU_BLOCKS, 2, block_size, HEADS, HEAD_DIM)
    return (NUM_GPU_BLOCKS, NUM_LAYERS, 2, block_size, HEADS, HEAD_DIM)


class Setup:
    """KV caches + CPU memory + handlers registered in a worker, for one test."""

    def __init__(
        self,
        layout: KVCacheLayout,
        config: Config,
        path: str,
        num_cpu_blocks: int = 16,
        region: SharedOffloadRegion | None = None,
        seed: int = 0,
        per_group_rows: bool = False,
    ) -> None:
        self.layout, self.config, self.path = layout, config, path
        gen = torch.Generator().manual_seed(seed)
        count = 1 if layout is KVCacheLayout.CROSS_LAYER else NUM_LAYERS
        if config.block_sizes is not None:
            assert layout is not KVCacheLayout.CROSS_LAYER and len(config.block_sizes) == count
        shapes = [_layer_shape(layout, bs) for bs in config.block_sizes or (BLOCK_SIZE,) * count]
        sizes = [math.prod(shape) * 2 for shape in shapes]  # float16
        total = sum(sizes) + (count + 1) * LAYER_GAP
        self.gpu_host = torch.randint(-128, 128, (total,), dtype=torch.int8, generator=gen)
        layers = []
        off = LAYER_GAP
        for shape, nbytes in zip(shapes, sizes, strict=True):
            layers.append(self.gpu_host[off : off + nbytes].view(torch.float16).view(shape))
            off += nbytes + LAYER_GAP
        layer_groups = config.layer_groups
        if layout is KVCacheLayout.CROSS_LAYER and layer_groups is not None:
            layer_groups = [[0] for _ in layer_groups]
        page_bytes = None
        if config.unpadded is not None:
            full = build_canonical_kv_caches(layers, layout).tensors[0].page_size_bytes
            page_bytes = [None if u is None else full - u for u in config.unpadded]
        host_kv = build_canonical_kv_caches(layers, layout, layer_groups, page_bytes)
        self.dev: DeviceBuffer | None = None
        if path == "torch":
            self.kv = host_kv
            self.gpu_base = self.gpu_host.data_ptr()
        else:
            assert LIB is not None
            self.dev = DeviceBuffer(LIB, total, DEV)
            self.dev.copy_from_host(self.gpu_host.numpy())
            self.gpu_base = self.dev.ptr
            self.kv = CanonicalKVCaches(
                tuple(
                    dataclasses.replace(
                        t,
                        ptr=self.dev.ptr + (t.ptr - self.gpu_host.data_ptr()),
                        device_index=DEV,
                        tensor=None,
                        owner=self.dev,
                    )
                    for t in host_kv.tensors
                ),
                host_kv.group_data_refs,
            )
        self.region = region
        views: list[torch.Tensor] | None = None
        if region is None:
            offsets, pages = _view_layout(self.kv, config.factors, per_group_rows)
            self.row_bytes = max(o + p for o, p in zip(offsets, pages, strict=True)) + 48
            # (+ 48: padding after the worker's slot, checked untouched.)
            # A private mapping: page-aligned, so the handlers can pin it on the CUDA paths.
            self.cpu_mem = torch.frombuffer(
                mmap.mmap(-1, num_cpu_blocks * self.row_bytes), dtype=torch.int8
            )
            views = [
                torch.as_strided(self.cpu_mem, (num_cpu_blocks, page), (self.row_bytes, 1), off)
                for off, page in zip(offsets, pages, strict=True)
            ]
        else:
            self.row_bytes = region.row_bytes
            self.cpu_mem = torch.frombuffer(region.create_kv_memoryview(), dtype=torch.int8)
        self.cpu_mem.copy_(
            torch.randint(-128, 128, self.cpu_mem.shape, dtype=torch.int8, generator=gen)
        )
        # The handlers take the views from the region when there is one, else the views above.
        self.handlers = CpuGpuOffloadingHandlers(
            self.kv,
            config.factors,
            region=region,
            cpu_views=views,
            copy_method=ops.CopyMethod.KERNEL if path == "kernel" else ops.CopyMethod.DMA,
            per_group_rows=per_group_rows,
        )
        self.cpu_base = self.cpu_mem.data_ptr()
        self.worker = OffloadingWorker()
        self.handlers.register(self.worker)
        self.job_id = 0

    # -- memory snapshots ------------------------------------------------------------------------

    def gpu_bytes(self) -> np.ndarray:
        if self.dev is None:
            return self.gpu_host.numpy().copy()
        out = np.empty(self.dev.nbytes, dtype=np.int8)
        self.dev.copy_to_host(out)
        return out

    def cpu_bytes(self) -> np.ndarray:
        return self.cpu_mem.numpy().copy()

    # -- jobs --------------------------------------------------------------------------------------

    def submit(self, spec: TransferSpec) -> int:
        self.job_id += 1
        assert self.worker.transfer_async(self.job_id, spec)
        return self.job_id

    def finish(self, job_ids: Sequence[int]) -> list[TransferResult]:
        self.worker.wait(set(job_ids))
        results = self.worker.get_finished()
        assert [r.job_id for r in results] == list(job_ids)
        return results

    def reference(
        self,
        gpu_spec: GPULoadStoreSpec,
        cpu_spec: CPULoadStoreSpec,
        store: bool,
        gpu: np.ndarray,
        cpu: np.ndarray,
    ) -> None:
        """Apply a job to snapshots, one block and one tensor at a time (the documented rule)."""
        gpu_ids, cpu_ids = gpu_spec.block_ids.tolist(), cpu_spec.block_ids.tolist()
        views = self.handlers.cpu_views
        gi = ci = 0
        for g, n in enumerate(gpu_spec.group_sizes):
            k = self.config.factors[g]
            skip = gpu_spec.block_indices[g] % k
            for m in range(n):
                row, sub = cpu_ids[ci + (skip + m) // k], (skip + m) % k
                for ref in self.kv.group_data_refs[g]:
                    t = self.kv.tensors[ref.tensor_idx]
                    goff = t.ptr - self.gpu_base + gpu_ids[gi + m] * t.row_stride_bytes
                    view_off = views[ref.tensor_idx].data_ptr() - self.cpu_base
                    coff = view_off + row * self.row_bytes + sub * t.page_size_bytes
                    nb = ref.page_size_bytes
                    if store:
                        cpu[coff : coff + nb] = gpu[goff : goff + nb]
                    else:
                        gpu[goff : goff + nb] = cpu[coff : coff + nb]
            gi += n
            ci += -(-(skip + n) // k) if n else 0

    def close(self) -> None:
        self.handlers.shutdown()
        if self.dev is not None:
            self.dev.close()


def _view_layout(
    kv: CanonicalKVCaches, factors: Sequence[int], per_group_rows: bool
) -> tuple[list[int], list[int]]:
    """``(offsets, pages)`` of each canonical tensor's CPU view in a row, written out from the
    documented layouts: shared rows put every tensor's ``P_t * K`` bytes one after another;
    per-group rows start each group at offset 0, its tensors' ``P_t * k_g`` bytes in turn."""
    if not per_group_rows:
        pages = [t.page_size_bytes * max(factors) for t in kv.tensors]
        return [sum(pages[:i]) for i in range(len(pages))], pages
    offsets, pages = [0] * len(kv.tensors), [0] * len(kv.tensors)
    for g, refs in enumerate(kv.group_data_refs):
        off = 0
        for ref in refs:
            pages[ref.tensor_idx] = kv.tensors[ref.tensor_idx].page_size_bytes * factors[g]
            offsets[ref.tensor_idx] = off
            off += pages[ref.tensor_idx]
    return offsets, pages


def _specs(
    gpu_pool: list[int],
    cpu_rows: list[list[int]],
    block_indices: Sequence[int],
    counts: Sequence[int],
) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    """GPU blocks drawn from ``gpu_pool`` (consumed), CPU rows given per group."""
    gpu_ids = [gpu_pool.pop() for _ in range(sum(counts))]
    return (
        GPULoadStoreSpec(gpu_ids, counts, block_indices),
        CPULoadStoreSpec([r for rows in cpu_rows for r in rows]),
    )


@contextlib.contextmanager
def _region(
    name: str, worker_page_bytes: int, directory: Path, setups: list[Setup]
) -> Iterator[SharedOffloadRegion]:
    """A one-worker region of 16 rows for a test; on exit the ``setups`` over it are closed
    (and forgotten) before the region is cleaned up."""
    region = SharedOffloadRegion(
        name, 16, worker_page_bytes, num_workers=1, rank=0, directory=directory
    )
    try:
        yield region
    finally:
        for made in setups:
            made.close()
        setups.clear()
        region.cleanup()


@pytest.fixture
def setups() -> Iterator[list[Setup]]:
    yield from closed_at_teardown(Setup.close)


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------


@each_case(CONFIGS, LAYOUTS)
def test_round_trip_is_bit_exact(
    layout: KVCacheLayout, config: Config, path: str, setups: list[Setup]
) -> None:
    if config.block_sizes is not None and layout is KVCacheLayout.CROSS_LAYER:
        pytest.skip("one cross-layer tensor cannot hold groups of different block sizes")
    s = Setup(layout, config, path)
    setups.append(s)
    _check_round_trip(s)


PER_LAYER_LAYOUTS = [KVCacheLayout.KV_FIRST, KVCacheLayout.BLOCKS_FIRST]
MIXED_BLOCK_SIZES = [c for c in CONFIGS if c.block_sizes is not None]


@each_case(MIXED_BLOCK_SIZES, PER_LAYER_LAYOUTS)
def test_round_trip_through_a_shared_region_with_groups_of_different_block_sizes(
    layout: KVCacheLayout, config: Config, path: str, tmp_path: Path, setups: list[Setup]
) -> None:
    # The engine's path with one worker: every tensor's view is taken in turn from the worker's
    # slot of the shared region, sized like OffloadingSpec.worker_page_bytes (every layer's K and
    # V pages, times the largest factor), here exactly one row. With the larger pages first, the
    # views were refused as overlapping ("CPU views 0 and <last> overlap"), though disjoint.
    assert config.block_sizes is not None
    kv_bytes = sum(2 * bs * HEADS * HEAD_DIM * 2 for bs in config.block_sizes)
    worker_page = kv_bytes * max(config.factors)
    with _region("kvo-test-mixed-blocks", worker_page, tmp_path, setups) as region:
        assert region.row_bytes == worker_page  # no padding: the views tile every row
        s = Setup(layout, config, path, region=region)
        setups.append(s)
        views = s.handlers.cpu_views
        assert views[0].data_ptr() == s.cpu_base
        assert views[-1].data_ptr() + views[-1].shape[1] - s.cpu_base == worker_page
        _check_round_trip(s)


def _check_round_trip(s: Setup) -> None:
    """Store two offloaded blocks per group, load them back (partly) into other GPU blocks, and
    compare every byte of GPU and CPU memory against the reference after each job."""
    config = s.config
    rng = np.random.default_rng(7)
    groups = len(config.factors)
    gpu_pool = [int(x) for x in rng.permutation(NUM_GPU_BLOCKS)]
    cpu_free = [int(x) for x in rng.permutation(16)]
    # Store: per group 2 full offloaded blocks (aligned, block_indices a multiple of k).
    store_rows = [[cpu_free.pop(), cpu_free.pop()] for _ in range(groups)]
    counts = [2 * k for k in config.factors]
    gpu_spec, cpu_spec = _specs(gpu_pool, store_rows, [k * 3 for k in config.factors], counts)
    g0, c0 = s.gpu_bytes(), s.cpu_bytes()
    expected_cpu = c0.copy()
    s.reference(gpu_spec, cpu_spec, True, g0.copy(), expected_cpu)
    assert not np.array_equal(expected_cpu, c0)
    [res] = s.finish([s.submit(TransferSpec(gpu_spec, cpu_spec))])
    assert res.success and res.transfer_type == ("GPU", "CPU")
    assert res.transfer_size == sum(
        n * sum(r.page_size_bytes for r in refs)
        for n, refs in zip(counts, s.kv.group_data_refs, strict=True)
    )
    assert np.array_equal(s.cpu_bytes(), expected_cpu)
    assert np.array_equal(s.gpu_bytes(), g0)

    # Load the same rows into fresh GPU blocks: the first offloaded block only partly used when
    # k > 1 (block_indices % k == k - 1: one sub-block of it).
    skips = [k - 1 for k in config.factors]
    load_counts = [2 * k - skip for k, skip in zip(config.factors, skips, strict=True)]
    load_gpu, load_cpu = _specs(
        gpu_pool,
        store_rows,
        [5 * k + sk for k, sk in zip(config.factors, skips, strict=True)],
        load_counts,
    )
    expected_gpu = g0.copy()
    s.reference(load_gpu, load_cpu, False, expected_gpu, expected_cpu.copy())
    [res] = s.finish([s.submit(TransferSpec(load_cpu, load_gpu))])
    assert res.success and res.transfer_type == ("CPU", "GPU")
    assert np.array_equal(s.gpu_bytes(), expected_gpu)
    assert np.array_equal(s.cpu_bytes(), expected_cpu)

    # Direct round-trip check: each loaded GPU block equals the stored GPU block it came from.
    got = s.gpu_bytes()
    gi = 0
    store_ids = gpu_spec.block_ids.tolist()
    for g in range(len(config.factors)):
        for m in range(load_counts[g]):
            src_block = store_ids[sum(counts[:g]) + skips[g] + m]
            dst_block = load_gpu.block_ids[gi + m]
            for ref in s.kv.group_data_refs[g]:
                t = s.kv.tensors[ref.tensor_idx]
                a = t.ptr - s.gpu_base + src_block * t.row_stride_bytes
                b = t.ptr - s.gpu_base + int(dst_block) * t.row_stride_bytes
                n = ref.page_size_bytes
                assert np.array_equal(got[b : b + n], g0[a : a + n]), (g, m, ref)
        gi += load_counts[g]


def _store_into_region(path: str, region: SharedOffloadRegion) -> tuple[np.ndarray, np.ndarray]:
    """Store two offloaded blocks through a region; return (CPU bytes before, expected after)."""
    s = Setup(KVCacheLayout.KV_FIRST, Config("1group-k2", (2,), None, None), path, region=region)
    try:
        assert s.row_bytes == region.row_bytes >= 2 * region.worker_page_bytes
        gpu_spec = GPULoadStoreSpec([3, 4, 9, 10], [4], [0])
        cpu_spec = CPULoadStoreSpec([11, 0])
        before = s.cpu_bytes()
        expected = before.copy()
        s.reference(gpu_spec, cpu_spec, True, s.gpu_bytes(), expected)
        [res] = s.finish([s.submit(TransferSpec(gpu_spec, cpu_spec))])
        assert res.success
        assert np.array_equal(s.cpu_bytes(), expected)
        return before, expected
    finally:
        s.close()


@pytest.mark.parametrize("path", PATHS)
def test_shared_region_rows_keep_other_workers_bytes(path: str, tmp_path: Path) -> None:
    # Worker 1 of 2: its slot follows worker 0's in every row; it moves 3 layers x K/V planes of
    # (block_size * heads * head_dim * 2) bytes, k = 2 GPU blocks per offloaded block.
    worker_page = NUM_LAYERS * 2 * (BLOCK_SIZE * HEADS * HEAD_DIM * 2) * 2
    region = SharedOffloadRegion(
        "kvo-test-gpu-worker", 12, worker_page, num_workers=2, rank=1, directory=tmp_path
    )
    try:
        before, expected = _store_into_region(path, region)
    finally:
        region.cleanup()
    rows_before = before.reshape(12, -1)
    rows_after = expected.reshape(12, -1)
    assert np.array_equal(rows_after[:, :worker_page], rows_before[:, :worker_page])
    assert np.array_equal(rows_after[:, 2 * worker_page :], rows_before[:, 2 * worker_page :])
    assert not np.array_equal(rows_after[11], rows_before[11])
    assert np.array_equal(rows_after[1:11], rows_before[1:11])


# ---------------------------------------------------------------------------------------------
# Ordering, FIFO, wait
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_load_after_store_of_same_rows_reads_stored_bytes(path: str, setups: list[Setup]) -> None:
    s = Setup(KVCacheLayout.CROSS_LAYER, CONFIGS[1], path)  # k = 4
    setups.append(s)
    g0 = s.gpu_bytes()
    ids = []
    # Three stores overwrite rows 2 and 5 in turn; a load issued right after them (no wait in
    # between) must see the last store's bytes.
    for first in (0, 8, 16):
        ids.append(
            s.submit(
                TransferSpec(
                    GPULoadStoreSpec(list(range(first, first + 8)), [8], [0]),
                    CPULoadStoreSpec([2, 5]),
                )
            )
        )
    load = GPULoadStoreSpec(list(range(30, 38)), [8], [0])
    ids.append(s.submit(TransferSpec(CPULoadStoreSpec([2, 5]), load)))
    results = s.finish(ids)
    assert all(r.success for r in results)
    got = s.gpu_bytes()
    t = s.kv.tensors[0]
    for m in range(8):
        a = t.ptr - s.gpu_base + (16 + m) * t.row_stride_bytes
        b = t.ptr - s.gpu_base + (30 + m) * t.row_stride_bytes
        assert np.array_equal(got[b : b + t.page_size_bytes], g0[a : a + t.page_size_bytes])


@pytest.mark.parametrize("path", PATHS)
def test_store_after_load_of_same_rows_does_not_clobber_the_load(
    path: str, setups: list[Setup]
) -> None:
    s = Setup(KVCacheLayout.BLOCKS_FIRST, CONFIGS[0], path)  # k = 1
    setups.append(s)
    first = s.submit(
        TransferSpec(GPULoadStoreSpec([0, 1, 2, 3], [4], [0]), CPULoadStoreSpec([2, 5, 7, 9]))
    )
    s.finish([first])
    g0 = s.gpu_bytes()
    # The load reads rows 2, 5, 7, 9; the stores submitted right after it overwrite those rows
    # (and one reads a GPU block the load writes): the load must still get the first contents.
    load = s.submit(
        TransferSpec(CPULoadStoreSpec([2, 5, 7, 9]), GPULoadStoreSpec([20, 21, 22, 23], [4], [0]))
    )
    stores = [
        s.submit(
            TransferSpec(
                GPULoadStoreSpec([10, 11, 12, 13], [4], [0]), CPULoadStoreSpec([2, 5, 7, 9])
            )
        ),
        s.submit(TransferSpec(GPULoadStoreSpec([23], [1], [0]), CPULoadStoreSpec([3]))),
    ]
    s.worker.wait({load, *stores})
    assert all(r.success for r in s.worker.get_finished())
    got = s.gpu_bytes()
    t = s.kv.tensors[0]
    page = t.page_size_bytes
    for src, dst in zip([0, 1, 2, 3], [20, 21, 22, 23], strict=True):
        a = t.ptr - s.gpu_base + src * t.row_stride_bytes
        b = t.ptr - s.gpu_base + dst * t.row_stride_bytes
        assert np.array_equal(got[b : b + page], g0[a : a + page]), (src, dst)
    # Row 3 got GPU block 23 as the load left it (block 3's bytes).
    row3 = s.handlers.cpu_views[0][3, :page].numpy()
    a = t.ptr - s.gpu_base + 3 * t.row_stride_bytes
    assert np.array_equal(row3, g0[a : a + page])


class _FakeEvent:
    """Stands for a CUDA event: the ordering table only uses event identity."""


def test_cross_direction_order_tracks_only_hazards() -> None:
    order = CrossDirectionOrder()
    e1, e2, e3 = _FakeEvent(), _FakeEvent(), _FakeEvent()
    order.add(True, [1, 2], [10, 11], e1)  # store: GPU 10, 11 -> rows 1, 2
    order.add(True, [3], [12], e2)
    assert order.hazards(True, [1, 2, 3], [10]) == []  # same direction: serialised elsewhere
    assert order.hazards(False, [2], [99]) == [e1]  # load reading row 2 (RAW)
    assert order.hazards(False, [50], [12]) == [e2]  # load overwriting GPU block 12 (WAR)
    assert set(map(id, order.hazards(False, [1, 3], [11]))) == {id(e1), id(e2)}
    order.add(True, [2], [13], e3)  # a later store takes row 2 over
    order.remove(True, [1, 2], [10, 11], e1)
    assert order.hazards(False, [1, 2], [10, 11]) == [e3]
    order.add(False, [7], [30], e1)  # load: row 7 -> GPU 30
    assert order.hazards(True, [7], []) == [e1] and order.hazards(True, [], [30]) == [e1]
    order.remove(False, [7], [30], e1)
    assert order.hazards(True, [7], [30]) == []


@pytest.mark.parametrize("path", PATHS)
def test_completions_are_fifo_and_wait_blocks_for_listed_jobs(
    path: str, setups: list[Setup]
) -> None:
    s = Setup(KVCacheLayout.BLOCKS_FIRST, CONFIGS[0], path)
    setups.append(s)
    ids = [
        s.submit(TransferSpec(GPULoadStoreSpec([b], [1], [0]), CPULoadStoreSpec([b])))
        for b in range(6)
    ]
    load_id = s.submit(TransferSpec(CPULoadStoreSpec([0]), GPULoadStoreSpec([20], [1], [0])))
    s.worker.wait({ids[2]})
    h = s.handlers.gpu_to_cpu_handler
    done = s.worker.get_finished()
    done_ids = [r.job_id for r in done]
    # Stores come out in submission order and include at least every job up to the waited one.
    store_done = [j for j in done_ids if j in ids]
    assert store_done == ids[: len(store_done)] and len(store_done) >= 3
    s.worker.wait(set(ids) | {load_id, 999})
    rest = [r.job_id for r in s.worker.get_finished()]
    assert sorted(done_ids + rest) == sorted([*ids, load_id])
    assert [j for j in rest if j in ids] == ids[len(store_done) :]
    assert s.worker.get_finished() == []
    assert repr(h).startswith("SingleDirectionOffloadingHandler(GPU->CPU")


# ---------------------------------------------------------------------------------------------
# Failures
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_bad_jobs_are_reported_failed_and_touch_nothing(path: str, setups: list[Setup]) -> None:
    s = Setup(KVCacheLayout.KV_FIRST, CONFIGS[2], path)  # groups k = (1, 2)
    setups.append(s)
    g0, c0 = s.gpu_bytes(), s.cpu_bytes()
    bad: list[TransferSpec] = [
        # CPU row out of range
        TransferSpec(GPULoadStoreSpec([1, 2, 3], [1, 2], [0, 0]), CPULoadStoreSpec([0, 16])),
        # GPU block out of range (load)
        TransferSpec(CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([1, 2, 40], [1, 2], [0, 0])),
        # too few CPU blocks for the GPU blocks of group 1
        TransferSpec(GPULoadStoreSpec([1, 2, 3, 4], [1, 3], [0, 0]), CPULoadStoreSpec([0, 1])),
        # too many CPU blocks
        TransferSpec(GPULoadStoreSpec([1, 2], [1, 1], [0, 0]), CPULoadStoreSpec([0, 1, 2])),
        # wrong number of groups
        TransferSpec(GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0])),
        # one GPU block loaded twice
        TransferSpec(CPULoadStoreSpec([0, 1]), GPULoadStoreSpec([5, 6, 6], [1, 2], [0, 0])),
        # one CPU row stored twice
        TransferSpec(
            GPULoadStoreSpec([1, 2, 3, 4, 5], [1, 4], [0, 0]), CPULoadStoreSpec([0, 4, 4])
        ),
        # GPU spec on both sides
        TransferSpec(GPULoadStoreSpec([1], [1, 0], [0, 0]), GPULoadStoreSpec([2], [1], [0])),
    ]
    ids = []
    for spec in bad:
        s.job_id += 1
        ids.append(s.job_id)
        assert s.worker.transfer_async(s.job_id, spec) is False
    good = s.submit(
        TransferSpec(GPULoadStoreSpec([1, 2, 3], [1, 2], [0, 0]), CPULoadStoreSpec([0, 1]))
    )
    s.worker.wait({good})
    results = {r.job_id: r for r in s.worker.get_finished()}
    assert set(results) == {*ids, good}
    assert not any(results[j].success for j in ids)
    assert results[good].success
    assert np.array_equal(s.gpu_bytes(), g0)
    expected = c0.copy()
    s.reference(
        GPULoadStoreSpec([1, 2, 3], [1, 2], [0, 0]), CPULoadStoreSpec([0, 1]), True, g0, expected
    )
    assert np.array_equal(s.cpu_bytes(), expected)


@pytest.mark.cuda
@needs_gpu
def test_cuda_copy_failure_is_reported_in_order(setups: list[Setup]) -> None:
    """A job whose copy call fails (kernel path over memory unpinned behind its back) is reported
    failed, in FIFO order, and the jobs around it still complete."""
    assert LIB is not None
    s = Setup(KVCacheLayout.BLOCKS_FIRST, CONFIGS[0], "kernel")
    setups.append(s)
    ptr = s.cpu_base  # the handlers pinned the one mapping the CPU views share
    first = s.submit(TransferSpec(GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([1])))
    s.worker.wait({first})
    LIB.host_unregister(DEV, ptr)
    try:
        failing = s.submit(TransferSpec(GPULoadStoreSpec([2], [1], [0]), CPULoadStoreSpec([2])))
    finally:
        assert LIB.host_register(DEV, ptr, s.cpu_mem.untyped_storage().nbytes(), 3)
    last = s.submit(TransferSpec(GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([3])))
    s.worker.wait({last})
    results = s.worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [
        (first, True),
        (failing, False),
        (last, True),
    ]


@pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")
def test_device_kv_cache_without_gpu_is_refused() -> None:
    fake = CanonicalKVCacheTensor(
        ptr=1 << 40, num_blocks=4, page_size_bytes=64, row_stride_bytes=64, device_index=0
    )
    kv = CanonicalKVCaches((fake,), ((CanonicalKVCacheRef(0, 64),),))
    with pytest.raises(RuntimeError, match="CUDA copy backend is unavailable"):
        CpuGpuOffloadingHandlers(kv, 1, 4)


def test_cpu_views_are_validated() -> None:
    kv = build_canonical_kv_caches(
        [torch.zeros(_layer_shape(KVCacheLayout.BLOCKS_FIRST), dtype=torch.float16)],
        KVCacheLayout.BLOCKS_FIRST,
    )
    page = kv.tensors[0].page_size_bytes
    with pytest.raises(ValueError, match="cannot hold"):
        CpuGpuOffloadingHandlers(kv, 2, cpu_views=[torch.zeros(4, page, dtype=torch.int8)])
    with pytest.raises(ValueError, match="int8"):
        CpuGpuOffloadingHandlers(kv, 1, cpu_views=[torch.zeros(4, page, dtype=torch.float32)])
    two = build_canonical_kv_caches(
        [
            torch.zeros(_layer_shape(KVCacheLayout.BLOCKS_FIRST), dtype=torch.float16)
            for _ in range(2)
        ],
        KVCacheLayout.BLOCKS_FIRST,
    )
    mem = torch.zeros(4 * 2 * page, dtype=torch.int8)
    overlapping = [
        torch.as_strided(mem, (4, page), (2 * page, 1), 0),
        torch.as_strided(mem, (4, page), (2 * page, 1), page // 2),
    ]
    with pytest.raises(ValueError, match="overlap"):
        CpuGpuOffloadingHandlers(two, 1, cpu_views=overlapping)
    interleaved = [
        torch.as_strided(mem, (4, page), (2 * page, 1), 0),
        torch.as_strided(mem, (4, page), (2 * page, 1), page),
    ]
    h = CpuGpuOffloadingHandlers(two, 1, cpu_views=interleaved)
    assert h.num_cpu_blocks == 4
    h.shutdown()
    # Views of different lengths tiling a row, the longer first (a group of larger pages before
    # one of smaller pages) are disjoint; one byte more and the second runs into the next row.
    mixed = build_canonical_kv_caches(
        [
            torch.zeros(_layer_shape(KVCacheLayout.BLOCKS_FIRST, bs), dtype=torch.float16)
            for bs in (2 * BLOCK_SIZE, BLOCK_SIZE)
        ],
        KVCacheLayout.BLOCKS_FIRST,
        [[0], [1]],
    )
    big, small = (t.page_size_bytes for t in mixed.tensors)
    assert big == 2 * small
    mem = torch.zeros(4 * (big + small), dtype=torch.int8)

    def views(row: int) -> list[torch.Tensor]:
        return [
            torch.as_strided(mem, (4, big), (row, 1), 0),
            torch.as_strided(mem, (4, small), (row, 1), big),
        ]

    h = CpuGpuOffloadingHandlers(mixed, 1, cpu_views=views(big + small))
    h.shutdown()
    with pytest.raises(ValueError, match="CPU views 0 and 1 overlap"):
        CpuGpuOffloadingHandlers(mixed, 1, cpu_views=views(big + small - 1))
    with pytest.raises(ValueError, match="factor"):
        CpuGpuOffloadingHandlers(two, [1, 2], 4)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        CpuGpuOffloadingHandlers(two, 1)


def test_groups_sharing_tensors_cannot_write_one_block_twice(setups: list[Setup]) -> None:
    s = Setup(KVCacheLayout.BLOCKS_FIRST, CONFIGS[3], "torch")  # both groups on every tensor
    setups.append(s)
    c0 = s.cpu_bytes()
    # Group 0 (k=2) and group 1 (k=4) would both write sub-blocks 0-1 of CPU row 3.
    store = TransferSpec(
        GPULoadStoreSpec([1, 2, 3, 4, 5, 6], [2, 4], [0, 0]), CPULoadStoreSpec([3, 3])
    )
    load = TransferSpec(
        CPULoadStoreSpec([3, 4]), GPULoadStoreSpec([7, 8, 9, 7, 10, 11], [2, 4], [0, 0])
    )
    s.job_id += 2
    assert s.worker.transfer_async(s.job_id - 1, store) is False
    assert s.worker.transfer_async(s.job_id, load) is False
    assert [r.success for r in s.worker.get_finished()] == [False, False]
    assert np.array_equal(s.cpu_bytes(), c0)


# ---------------------------------------------------------------------------------------------
# Per-group rows: every group's views from offset 0 of a row (RowLayout.PER_GROUP)
# ---------------------------------------------------------------------------------------------

DISJOINT = [c for c in CONFIGS if c.layer_groups is not None and c.unpadded is None]


def _group_extent(kv: CanonicalKVCaches, factors: Sequence[int], g: int) -> int:
    """Bytes of a row group ``g``'s views cover with per-group rows (from offset 0)."""
    return sum(kv.tensors[r.tensor_idx].page_size_bytes for r in kv.group_data_refs[g]) * factors[g]


@each_case(DISJOINT, PER_LAYER_LAYOUTS)
def test_per_group_rows_alias_one_offset_and_round_trip_through_a_region(
    layout: KVCacheLayout, config: Config, path: str, tmp_path: Path, setups: list[Setup]
) -> None:
    # The engine's path for a hybrid run: the spec sizes a worker's slot for the largest group
    # (OffloadingSpec.worker_page_bytes with RowLayout.PER_GROUP), and each group's views start
    # at the slot's offset 0.
    probe = Setup(layout, config, "torch")
    extents = [_group_extent(probe.kv, config.factors, g) for g in range(len(config.factors))]
    probe.close()
    with _region("kvo-test-per-group", max(extents), tmp_path, setups) as region:
        # The slot is the largest group's, not every group's (the row is then page-rounded).
        assert region.worker_page_bytes == max(extents) < sum(extents)
        s = Setup(layout, config, path, region=region, per_group_rows=True)
        setups.append(s)
        views = s.handlers.cpu_views
        for g, refs in enumerate(s.kv.group_data_refs):
            offsets = [views[r.tensor_idx].data_ptr() - s.cpu_base for r in refs]
            # Each group from offset 0, its tensors one after another, within its extent.
            assert offsets[0] == 0
            assert offsets == sorted(offsets)
            last = views[refs[-1].tensor_idx]
            assert offsets[-1] + last.shape[1] == extents[g]
            assert all(views[r.tensor_idx].stride(0) == region.row_bytes for r in refs)
        # The reference applies the documented rule over the whole mapping, so bytes of a row
        # outside its own group's views (another group's, the padding, other rows) must stay.
        _check_round_trip(s)


@pytest.mark.parametrize("path", PATHS)
def test_a_key_of_one_group_touches_only_its_groups_bytes_of_its_row(
    path: str, setups: list[Setup]
) -> None:
    config = CONFIGS[4]  # two disjoint groups, k = (1, 2), group 1's rows the longer
    s = Setup(KVCacheLayout.KV_FIRST, config, path, per_group_rows=True)
    setups.append(s)
    extents = [_group_extent(s.kv, config.factors, g) for g in range(2)]
    assert extents[0] < extents[1]
    gpu = s.gpu_bytes()
    for g, row, gpu_ids in ((1, 5, [7, 8]), (0, 6, [9])):
        before = s.cpu_bytes().reshape(16, s.row_bytes)
        counts = [len(gpu_ids) if h == g else 0 for h in range(2)]
        spec = TransferSpec(GPULoadStoreSpec(gpu_ids, counts, [0, 0]), CPULoadStoreSpec([row]))
        [res] = s.finish([s.submit(spec)])
        assert res.success
        after = s.cpu_bytes().reshape(16, s.row_bytes)
        changed_rows = np.flatnonzero((after != before).any(axis=1))
        assert changed_rows.tolist() == [row]
        changed = np.flatnonzero(after[row] != before[row])
        assert changed.max() < extents[g]  # only group g's bytes, from the row's start
        # Group g's views of that row now hold the GPU blocks' pages.
        for ref in s.kv.group_data_refs[g]:
            t, view = s.kv.tensors[ref.tensor_idx], s.handlers.cpu_views[ref.tensor_idx]
            for j, gpu_id in enumerate(gpu_ids):
                got = view[row, j * t.page_size_bytes : (j + 1) * t.page_size_bytes].numpy()
                at = t.ptr - s.gpu_base + gpu_id * t.row_stride_bytes
                assert np.array_equal(got, gpu[at : at + t.page_size_bytes])


def test_per_group_rows_refuse_a_tensor_that_two_groups_use() -> None:
    s = Setup(KVCacheLayout.BLOCKS_FIRST, CONFIGS[3], "torch")  # both groups on every tensor
    try:
        with pytest.raises(ValueError, match="per-group rows need every canonical tensor"):
            CpuGpuOffloadingHandlers(s.kv, CONFIGS[3].factors, 4, per_group_rows=True)
    finally:
        s.close()


def test_per_group_rows_never_store_two_groups_into_one_row(setups: list[Setup]) -> None:
    config = CONFIGS[2]  # two disjoint groups, k = (1, 2)
    aliased = Setup(KVCacheLayout.BLOCKS_FIRST, config, "torch", per_group_rows=True)
    setups.append(aliased)
    c0 = aliased.cpu_bytes()
    # Group 0's block and group 1's block both into CPU row 3: with aliased views their bytes
    # overlap whatever the sub-blocks, so the job is refused and nothing is written.
    both = TransferSpec(GPULoadStoreSpec([1, 2, 3], [1, 2], [0, 0]), CPULoadStoreSpec([3, 3]))
    aliased.job_id += 1
    assert aliased.worker.transfer_async(aliased.job_id, both) is False
    assert [r.success for r in aliased.worker.get_finished()] == [False]
    assert np.array_equal(aliased.cpu_bytes(), c0)
    # Other rows per group are fine, and so is one row read into both groups (a load writes
    # GPU blocks, of disjoint tensors).
    apart = TransferSpec(GPULoadStoreSpec([1, 2, 3], [1, 2], [0, 0]), CPULoadStoreSpec([3, 4]))
    [res] = aliased.finish([aliased.submit(apart)])
    assert res.success
    load = TransferSpec(CPULoadStoreSpec([3, 3]), GPULoadStoreSpec([5, 6, 7], [1, 2], [0, 0]))
    [res] = aliased.finish([aliased.submit(load)])
    assert res.success
    # With shared rows the same groups' bytes of a row are disjoint: the job is valid there.
    shared = Setup(KVCacheLayout.BLOCKS_FIRST, config, "torch")
    setups.append(shared)
    [res] = shared.finish([shared.submit(both)])
    assert res.success


def test_cpu_views_of_different_groups_may_alias_within_one_row() -> None:
    two = build_canonical_kv_caches(
        [
            torch.zeros(_layer_shape(KVCacheLayout.BLOCKS_FIRST), dtype=torch.float16)
            for _ in range(2)
        ],
        KVCacheLayout.BLOCKS_FIRST,
        [[0], [1]],
    )
    page = two.tensors[0].page_size_bytes
    mem = torch.zeros(4 * 2 * page, dtype=torch.int8)

    def view(stride: int, offset: int) -> torch.Tensor:
        return torch.as_strided(mem, (4, page), (stride, 1), offset)

    h = CpuGpuOffloadingHandlers(two, 1, cpu_views=[view(page, 0), view(page, 0)])
    h.shutdown()
    h = CpuGpuOffloadingHandlers(two, 1, cpu_views=[view(2 * page, 0), view(2 * page, page // 2)])
    h.shutdown()
    # Row c of the second view would reach into row c + 1 of the first.
    with pytest.raises(ValueError, match="CPU views 0 and 1 overlap"):
        CpuGpuOffloadingHandlers(two, 1, cpu_views=[view(page, 0), view(page, page // 2)])
    # Different row strides: rows of one alias several rows of the other.
    with pytest.raises(ValueError, match="CPU views 0 and 1 overlap"):
        CpuGpuOffloadingHandlers(two, 1, cpu_views=[view(page, 0), view(2 * page, 0)])
    # Tensors of one group never alias (the same key's pages).
    one_group = build_canonical_kv_caches(
        [
            torch.zeros(_layer_shape(KVCacheLayout.BLOCKS_FIRST), dtype=torch.float16)
            for _ in range(2)
        ],
        KVCacheLayout.BLOCKS_FIRST,
    )
    with pytest.raises(ValueError, match="CPU views 0 and 1 overlap"):
        CpuGpuOffloadingHandlers(one_group, 1, cpu_views=[view(page, 0), view(page, 0)])


# ---------------------------------------------------------------------------------------------
# Device binding, checked without a GPU
# ---------------------------------------------------------------------------------------------


class _RecordingLibrary:
    """Stands for the CUDA library over host memory: copies run at once (torch backend), events
    are always complete, and every call's device and calling thread are recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []
        self.methods: list[ops.CopyMethod] = []  # of each copy_blocks call
        self._handles = itertools.count(1)

    def _note(self, name: str, device: int) -> int:
        self.calls.append((name, device, threading.current_thread().name))
        return next(self._handles)

    def stream_create(self, device: int, priority: int = 0) -> int:
        return self._note("stream_create", device)

    def event_create(self, device: int, enable_timing: bool = True) -> int:
        return self._note("event_create", device)

    def copy_blocks(
        self,
        device: int,
        regions: np.ndarray,
        src: np.ndarray,
        dst: np.ndarray,
        method: ops.CopyMethod,
        max_ctas: int,
        stream: int,
    ) -> None:
        self._note("copy_blocks", device)
        self.methods.append(method)
        ops.copy_blocks(regions, src, dst, backend="torch")

    def host_register(self, device: int, ptr: int, nbytes: int, flags: int) -> bool:
        self._note("host_register", device)
        return True

    def event_query(self, device: int, event: int) -> bool:
        self._note("event_query", device)
        return True

    def event_elapsed_ms(self, device: int, start: int, end: int) -> float:
        self._note("event_elapsed_ms", device)
        return 0.5

    def dma_batch_fallbacks(self) -> tuple[int, str]:
        return 0, ""

    def __getattr__(self, name: str) -> object:
        # stream_wait_event, event_record, *_destroy, *_synchronize, host_unregister
        return lambda device, *args: self._note(name, device)


def _on_recording_library(
    monkeypatch: pytest.MonkeyPatch, setups: list[Setup], device: int, num_devices: int
) -> tuple[Setup, _RecordingLibrary, CanonicalKVCaches]:
    """A host-memory setup (k = 4) whose KV cache claims to be on ``cuda:<device>``, with the
    CUDA library replaced by a recording stand-in that sees ``num_devices`` GPUs."""
    host = Setup(KVCacheLayout.BLOCKS_FIRST, CONFIGS[1], "torch")
    setups.append(host)
    fake = _RecordingLibrary()
    monkeypatch.setattr(ops, "cuda_library", lambda: fake)
    monkeypatch.setattr(ops, "copy_backend", lambda: "cuda")
    monkeypatch.setattr(ops, "cuda_devices", lambda: ops.CudaDevices(num_devices, ""))
    kv = CanonicalKVCaches(
        tuple(dataclasses.replace(t, device_index=device) for t in host.kv.tensors),
        host.kv.group_data_refs,
    )
    return host, fake, kv


def test_handlers_bind_every_cuda_call_to_the_kv_cache_device(
    monkeypatch: pytest.MonkeyPatch, setups: list[Setup]
) -> None:
    """The KV cache says cuda:3: every library call names device 3, whichever thread makes it,
    and stores wait for the compute stream the caller gave."""
    host, fake, kv = _on_recording_library(monkeypatch, setups, device=3, num_devices=4)
    streams_asked: list[str] = []

    def compute_stream() -> int:
        streams_asked.append(threading.current_thread().name)
        return 77

    handlers = CpuGpuOffloadingHandlers(
        kv, 4, cpu_views=host.handlers.cpu_views, compute_stream=compute_stream
    )
    worker = OffloadingWorker()
    handlers.register(worker)
    assert handlers.gpu_to_cpu_handler.device == 3
    assert "cuda:3/auto (dma from 1048576 B" in repr(handlers.cpu_to_gpu_handler)
    store = TransferSpec(GPULoadStoreSpec(list(range(8)), [8], [0]), CPULoadStoreSpec([2, 5]))
    load = TransferSpec(CPULoadStoreSpec([2, 5]), GPULoadStoreSpec(list(range(30, 38)), [8], [0]))
    g0 = host.gpu_bytes()
    with ThreadPoolExecutor(1, thread_name_prefix="other") as pool:
        assert pool.submit(worker.transfer_async, 1, store).result()
    assert worker.transfer_async(2, load)
    worker.wait({1, 2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True), (2, True)]
    # Jobs of small pages take the SM-copy kernel (the host memory is pinned and mapped).
    assert fake.methods == [ops.CopyMethod.KERNEL, ops.CopyMethod.KERNEL]
    handlers.shutdown()
    assert {device for _, device, _ in fake.calls} == {3}
    threads = {thread for name, _, thread in fake.calls if name == "copy_blocks"}
    assert len(threads) == 2 and any(t.startswith("other") for t in threads)
    assert {"host_register", "host_unregister", "stream_create", "event_record"} <= {
        name for name, _, _ in fake.calls
    }
    assert len(streams_asked) == 1 and streams_asked[0].startswith("other")  # the store only
    t = kv.tensors[0]
    got = host.gpu_bytes()
    for m in range(8):
        a = t.ptr - host.gpu_base + m * t.row_stride_bytes
        b = t.ptr - host.gpu_base + (30 + m) * t.row_stride_bytes
        assert np.array_equal(got[b : b + t.page_size_bytes], g0[a : a + t.page_size_bytes])

    invisible = CanonicalKVCaches(
        tuple(dataclasses.replace(t, device_index=4) for t in host.kv.tensors),
        host.kv.group_data_refs,
    )
    with pytest.raises(ValueError, match="cuda:4 but the CUDA copy library sees 4 GPU"):
        CpuGpuOffloadingHandlers(invisible, 4, cpu_views=host.handlers.cpu_views)


def test_each_cuda_job_takes_the_path_its_chunk_size_and_direction_choose(
    monkeypatch: pytest.MonkeyPatch, setups: list[Setup]
) -> None:
    """With the CUDA library (a recording stand-in), each job's method comes from the handlers'
    policy: by direction, and DMA for every job when the host memory could not be pinned."""
    host, fake, kv = _on_recording_library(monkeypatch, setups, device=0, num_devices=1)
    store = TransferSpec(GPULoadStoreSpec(list(range(8)), [8], [0]), CPULoadStoreSpec([2, 5]))
    load = TransferSpec(CPULoadStoreSpec([2, 5]), GPULoadStoreSpec(list(range(30, 38)), [8], [0]))
    kernel, dma = ops.CopyMethod.KERNEL, ops.CopyMethod.DMA
    for copy_method, pin, expected in (
        (ops.CopyMethodPolicy(load_dma_min_chunk_bytes=0), True, [kernel, dma]),
        (ops.CopyMethodPolicy(store_dma_min_chunk_bytes=0), True, [dma, kernel]),
        (None, False, [dma, dma]),  # not pinned: no kernel
        (ops.CopyMethod.DMA_LOOP, True, [ops.CopyMethod.DMA_LOOP] * 2),
    ):
        fake.methods.clear()
        handlers = CpuGpuOffloadingHandlers(
            kv,
            4,
            cpu_views=host.handlers.cpu_views,
            copy_method=copy_method,
            pin_memory=pin,
            compute_stream=lambda: 77,
        )
        worker = OffloadingWorker()
        handlers.register(worker)
        assert worker.transfer_async(1, store) and worker.transfer_async(2, load)
        worker.wait({1, 2})
        assert [r.success for r in worker.get_finished()] == [True, True]
        handlers.shutdown()
        assert fake.methods == expected, copy_method


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks torch without CUDA")
def test_compute_stream_is_the_legacy_stream_without_torch_cuda() -> None:
    assert current_compute_stream() == 0 and current_compute_stream(3) == 0
