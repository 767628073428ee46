# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingSpec.get_handlers`` of the built-in specs: working handlers, owned by the caller.

Each test builds the real handlers of a spec over a rank's real (host-memory) KV caches, moves
bytes GPU -> CPU -> GPU through an ``OffloadingWorker`` and checks them, then releases the
handlers the way the connector does (shut down, then ``close``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.worker import canonical_kv_caches
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec, open_shared_region
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec, WorkerHandlers
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
