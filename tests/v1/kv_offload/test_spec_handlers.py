# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingSpec.get_handlers`` of the built-in specs: working handlers, owned by the caller.

Each test builds the real handlers of a spec over a rank's real (host-memory) KV caches, moves
bytes GPU -> CPU -> GPU through an ``OffloadingWorker`` and checks them, then releases the
handlers the way the connector does (shut down, then ``close``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.v1.kv_offload.utils import make_run_info
from vllm import _custom_ops as ops
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.worker import canonical_kv_caches
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec, open_shared_region
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec, RowLayout, WorkerHandlers
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingWorker, TransferSpec

NUM_GPU_BLOCKS = 16
NUM_CPU_ROWS = 8


def _engine_config(**overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(
        num_layers=2,
        num_kv_heads=2,
        head_size=16,
        dtype="float16",
        gpu_block_sizes=(16,),
        num_gpu_blocks=NUM_GPU_BLOCKS,
    )
    settings.update(overrides)
    return EngineConfig(**settings)


def _run_and_caches(config: EngineConfig) -> tuple[KVCacheRunInfo, list[CanonicalKVCaches]]:
    """The run info of ``config`` and each rank's canonical KV caches (no offloading)."""
    with EngineCore(config) as engine:
        return engine.run_info(), [canonical_kv_caches(w.kv_caches) for w in engine.workers]


def _spec(
    cls: type[OffloadingSpec], run: KVCacheRunInfo, tmp_path: Path, **extra: Any
) -> OffloadingSpec:
    probe = cls(OffloadingConfig(cpu_bytes_to_use=1 << 30), run)
    config = OffloadingConfig(
        cpu_bytes_to_use=NUM_CPU_ROWS * probe.row_bytes, shared_region_dir=str(tmp_path), **extra
    )
    spec = cls(config, run)
    assert spec.num_primary_blocks == NUM_CPU_ROWS
    return spec


def _fill_random(caches: CanonicalKVCaches, blocks: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in caches.tensors:
        assert t.tensor is not None
        shape = (len(blocks), t.page_size_bytes)
        t.tensor[blocks] = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


def _pages(caches: CanonicalKVCaches, blocks: list[int]) -> list[np.ndarray]:
    out = []
    for t in caches.tensors:
        assert t.tensor is not None
        out.append(t.tensor[blocks].numpy().copy())
    return out


def _register(handlers: WorkerHandlers) -> OffloadingWorker:
    worker = OffloadingWorker()
    for src, dst, handler in handlers.registrations:
        worker.register_handler(src, dst, handler)
    return worker


def _run_job(worker: OffloadingWorker, job_id: int, spec: TransferSpec) -> None:
    assert worker.transfer_async(job_id, spec)
    worker.wait({job_id})
    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(job_id, True)]


def _release(worker: OffloadingWorker, handlers: WorkerHandlers) -> None:
    """What the connector's worker half does at shutdown."""
    worker.shutdown()
    handlers.registrations.clear()
    handlers.close()


def _round_trip(worker: OffloadingWorker, caches: CanonicalKVCaches, seed: int) -> list[int]:
    """Store GPU blocks 1, 2, 3 to CPU rows 4, 0, 6; load the rows back into GPU blocks 9, 10,
    11; check the bytes. Returns the rows."""
    src_blocks, rows, dst_blocks = [1, 2, 3], [4, 0, 6], [9, 10, 11]
    _fill_random(caches, src_blocks, seed)
    expected = _pages(caches, src_blocks)
    _run_job(
        worker, 1, TransferSpec(GPULoadStoreSpec(src_blocks, [3], [0]), CPULoadStoreSpec(rows))
    )
    _run_job(
        worker, 2, TransferSpec(CPULoadStoreSpec(rows), GPULoadStoreSpec(dst_blocks, [3], [0]))
    )
    for got, want in zip(_pages(caches, dst_blocks), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    return rows


def test_cpu_spec_handlers_round_trip_and_release_the_region(tmp_path: Path) -> None:
    run, (caches,) = _run_and_caches(_engine_config())
    spec = _spec(CPUOffloadingSpec, run, tmp_path)
    handlers = spec.get_handlers(caches, 0)
    assert [(s, d) for s, d, _ in handlers.registrations] == [
        (GPULoadStoreSpec, CPULoadStoreSpec),
        (CPULoadStoreSpec, GPULoadStoreSpec),
    ]
    path = SharedOffloadRegion.region_path(run.instance_id, tmp_path)
    # The only participant (one rank; this spec's scheduler side maps nothing) has joined, so the
    # name is already gone: from here on even a SIGKILL leaves nothing in the directory.
    assert not os.path.exists(path)
    worker = _register(handlers)
    _round_trip(worker, caches, seed=1)
    _release(worker, handlers)
    assert list(tmp_path.iterdir()) == []


def test_tiering_spec_workers_copy_through_the_schedulers_region(tmp_path: Path) -> None:
    """Two ranks join the region the scheduler side created; what each stores is in its slot of
    the rows the scheduler's primary tier (and thus every secondary tier) sees."""
    run, caches = _run_and_caches(_engine_config(tensor_parallel_size=2))
    spec = _spec(TieringOffloadingSpec, run, tmp_path)
    manager = spec.get_manager()  # the scheduler side creates the region first
    try:
        rows_view = np.asarray(manager.primary_tier.get_kv_memoryview())
        assert rows_view.shape == (NUM_CPU_ROWS, spec.row_bytes)
        built = [spec.get_handlers(rank_caches, rank) for rank, rank_caches in enumerate(caches)]
        # Every participant (the scheduler side and both ranks) has joined: the name is gone, so
        # from here on even a SIGKILL of every process leaves nothing in the directory.
        assert not os.path.exists(SharedOffloadRegion.region_path(run.instance_id, tmp_path))
        workers = [_register(h) for h in built]
        stored: list[tuple[int, slice, np.ndarray]] = []
        for rank, (worker, rank_caches) in enumerate(zip(workers, caches, strict=True)):
            rows = _round_trip(worker, rank_caches, seed=10 + rank)
            # Factor 1: a rank's slot of a row is its canonical pages of the block, in order.
            slot = slice(rank * spec.worker_page_bytes, (rank + 1) * spec.worker_page_bytes)
            for row, gpu_block in zip(rows, [1, 2, 3], strict=True):
                pages = np.concatenate([p[0] for p in _pages(rank_caches, [gpu_block])])
                assert len(pages) == spec.worker_page_bytes
                np.testing.assert_array_equal(rows_view[row, slot].view(np.int8), pages)
                stored.append((row, slot, pages))
        for worker, handlers in zip(workers, built, strict=True):
            _release(worker, handlers)
        # The workers' close() left the scheduler's mapping alone: its primary tier owns it.
        for row, slot, pages in stored:
            np.testing.assert_array_equal(rows_view[row, slot].view(np.int8), pages)
        del rows_view
    finally:
        manager.shutdown()
    assert not os.path.exists(SharedOffloadRegion.region_path(run.instance_id, tmp_path))


@pytest.mark.parametrize("cls", [CPUOffloadingSpec, TieringOffloadingSpec])
def test_get_handlers_rejects_a_bad_rank(cls: type[OffloadingSpec], tmp_path: Path) -> None:
    run, (caches,) = _run_and_caches(_engine_config())
    spec = _spec(cls, run, tmp_path)
    with pytest.raises(ValueError, match="rank"):
        spec.get_handlers(caches, 1)
    assert not os.listdir(tmp_path)


def test_get_handlers_releases_the_region_when_the_caches_do_not_fit(tmp_path: Path) -> None:
    """Caches of a bigger model than the spec's: nothing is left behind."""
    run, _ = _run_and_caches(_engine_config())
    _, (big_caches,) = _run_and_caches(_engine_config(num_layers=4))
    spec = _spec(CPUOffloadingSpec, run, tmp_path)
    with pytest.raises(ValueError, match="overruns"):
        spec.get_handlers(big_caches, 0)
    assert not os.listdir(tmp_path)


def test_open_shared_region_is_the_same_region_on_both_sides(tmp_path: Path) -> None:
    run, _ = _run_and_caches(_engine_config(tensor_parallel_size=2))
    spec = _spec(TieringOffloadingSpec, run, tmp_path)  # its scheduler side maps the region
    scheduler_side = open_shared_region(spec, None)
    worker_side = open_shared_region(spec, 1)
    try:
        assert scheduler_side.path == worker_side.path
        assert scheduler_side.row_bytes == worker_side.row_bytes == spec.row_bytes
        assert scheduler_side.num_blocks == worker_side.num_blocks == spec.num_primary_blocks
        assert worker_side.worker_page_bytes == spec.worker_page_bytes
    finally:
        worker_side.cleanup()
        scheduler_side.cleanup()


def test_open_shared_region_rejects_rows_the_spec_sized_differently(tmp_path: Path) -> None:
    class OddAlignmentSpec(CPUOffloadingSpec):
        BLOCK_SIZE_ALIGNMENT = 3 * SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT

    run, _ = _run_and_caches(_engine_config())
    spec = _spec(OddAlignmentSpec, run, tmp_path)
    with pytest.raises(ValueError, match="BLOCK_SIZE_ALIGNMENT"):
        open_shared_region(spec, 0)
    assert not os.listdir(tmp_path)


def test_the_spec_gives_its_handlers_the_configured_copy_path_choice(tmp_path: Path) -> None:
    """``copy_dma_min_chunk_bytes`` reaches both directions' handlers as their policy (which
    the CUDA path applies to each job; tests/test_custom_ops.py checks its choices)."""
    run, (caches,) = _run_and_caches(_engine_config())
    for extra, expected in (
        ({}, ops.CopyMethodPolicy()),
        (
            {"copy_dma_min_chunk_bytes": {"store": "256KiB", "load": "64KiB"}},
            ops.CopyMethodPolicy(256 << 10, 64 << 10),
        ),
    ):
        spec = _spec(CPUOffloadingSpec, run, tmp_path, **extra)
        handlers = spec.get_handlers(caches, 0)
        try:
            policies = [h.copy_policy for _, _, h in handlers.registrations]  # type: ignore[attr-defined]
            assert policies == [expected, expected]
        finally:
            _release(_register(handlers), handlers)


def _hybrid_run(group_bytes: tuple[int, ...]) -> KVCacheRunInfo:
    """Two workers of a hybrid model: groups of 16- and 8-token GPU blocks (``group_bytes``
    each, or not known per group when empty)."""
    return make_run_info(
        sum(group_bytes) or 3072,
        model_name="m",
        kv_layout="kv_first",
        num_layers=4,
        num_kv_heads=2,
        gpu_block_sizes=(16, 8),
        tensor_parallel_size=2,
        group_kv_bytes_per_block=group_bytes,
    )


def test_group_block_bytes_are_a_keys_bytes_on_every_worker(tmp_path: Path) -> None:
    config = OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=16)
    spec = CPUOffloadingSpec(config, _hybrid_run((2048, 1024)))
    # Group 1's GPU blocks hold 8 tokens: two of them per offloaded block.
    assert spec.group_block_bytes == (2048 * 2, 1024 * 2 * 2)
    # Not known per group: every group counts a whole block id's bytes (the old sizing).
    spec = CPUOffloadingSpec(config, _hybrid_run(()))
    assert spec.group_block_bytes == (3072 * 2, 3072 * 2 * 2)
    with pytest.raises(ValueError, match="group_kv_bytes_per_block"):
        dataclasses.replace(_hybrid_run((2048, 1024)), group_kv_bytes_per_block=(2048, 1000))


def test_rows_are_sized_per_group_when_the_groups_bytes_are_known() -> None:
    config = OffloadingConfig(cpu_bytes_to_use=1 << 20, block_size=16)
    spec = CPUOffloadingSpec(config, _hybrid_run((2048, 1024)))
    # A row holds one key: the largest group's block (group 0: 2048; group 1: 2 x 1024).
    assert spec.row_layout is RowLayout.PER_GROUP
    assert spec.worker_page_bytes == 2048
    assert spec.row_bytes == 2 * 2048  # two workers, page-aligned already
    # Not known per group (groups may share tensors): every group's bytes, as before.
    spec = CPUOffloadingSpec(config, _hybrid_run(()))
    assert spec.row_layout is RowLayout.SHARED
    assert spec.worker_page_bytes == 3072 * 2
    # One group: the layout and sizes of before, whatever the run says per group.
    one = dataclasses.replace(
        _hybrid_run(()), gpu_block_sizes=(16,), group_kv_bytes_per_block=(3072,)
    )
    spec = CPUOffloadingSpec(config, one)
    assert spec.row_layout is RowLayout.SHARED and spec.worker_page_bytes == 3072


def test_hybrid_ranks_store_each_groups_block_at_the_start_of_their_slot(tmp_path: Path) -> None:
    """The engine's hybrid run, two ranks: a key of either group fills the start of each rank's
    slot of its row with that group's pages, and nothing else of the region."""
    run, caches = _run_and_caches(
        _engine_config(tensor_parallel_size=2, gpu_block_sizes=(16, 16), sliding_windows=(None, 32))
    )
    spec = _spec(TieringOffloadingSpec, run, tmp_path)
    assert spec.row_layout is RowLayout.PER_GROUP
    assert spec.worker_page_bytes == run.group_kv_bytes_per_block[0]
    manager = spec.get_manager()
    try:
        rows_view = np.asarray(manager.primary_tier.get_kv_memoryview())
        built = [spec.get_handlers(rank_caches, rank) for rank, rank_caches in enumerate(caches)]
        workers = [_register(h) for h in built]
        expected = np.zeros_like(rows_view)
        for rank, (worker, rank_caches) in enumerate(zip(workers, caches, strict=True)):
            _fill_random(rank_caches, [3, 5], seed=20 + rank)
            slot = rank * spec.worker_page_bytes
            # Group 0's GPU block 3 into row 6, group 1's GPU block 5 into row 2.
            for job_id, (g, gpu_block, row) in enumerate(((0, 3, 6), (1, 5, 2)), start=1):
                counts = [1 if h == g else 0 for h in range(2)]
                spec_g = GPULoadStoreSpec([gpu_block], counts, [0, 0])
                _run_job(worker, job_id, TransferSpec(spec_g, CPULoadStoreSpec([row])))
                gpu_pages = _pages(rank_caches, [gpu_block])
                refs = rank_caches.group_data_refs[g]
                pages = np.concatenate([gpu_pages[r.tensor_idx][0] for r in refs])
                assert len(pages) == spec.worker_page_bytes
                expected[row, slot : slot + len(pages)] = pages.view(np.uint8)
        np.testing.assert_array_equal(rows_view, expected)
        for worker, handlers in zip(workers, built, strict=True):
            _release(worker, handlers)
        del rows_view
    finally:
        manager.shutdown()
