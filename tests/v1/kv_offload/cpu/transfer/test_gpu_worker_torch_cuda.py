# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The GPU <-> CPU handlers over torch CUDA tensors, end to end (needs a GPU; skipped otherwise).

The KV cache is what a model would allocate (torch CUDA tensors in every layout); the tests check
that it registers with its device, that stores wait for the model's writes on torch's current
stream, that a store + load round trip is bit-exact for every copy method and block-size factor,
and that the handlers work when driven from a thread that never used CUDA."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.cuda_helpers import torch_cuda_problem
from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.transfer.gpu_worker import (
    CpuGpuOffloadingHandlers,
    current_compute_stream,
)
from vllm.v1.kv_offload.worker.canonical import KVCacheLayout, build_canonical_kv_caches
from vllm.v1.kv_offload.worker.worker import OffloadingWorker, TransferSpec

PROBLEM = torch_cuda_problem()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(bool(PROBLEM), reason=PROBLEM or "runs")]

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 32, 16, 2, 64  # 4 KiB per K or V page
CPU_BLOCKS = 8
# GPU cycles spent before the model's write lands: long enough (tens of ms) that a store not
# ordered after the compute stream would read the old bytes.
SLOW_WRITE_CYCLES = 50_000_000


def _layers(layout: KVCacheLayout, device: torch.device) -> list[torch.Tensor]:
    """Random fp16 KV tensors in ``layout`` (bits from int16, so NaNs compare bit-exactly)."""
    tail = (BLOCK_SIZE, HEADS, HEAD_DIM)
    if layout is KVCacheLayout.CROSS_LAYER:
        shapes = [(BLOCKS, LAYERS, 2, *tail)]
    elif layout is KVCacheLayout.KV_FIRST:
        shapes = [(2, BLOCKS, *tail)] * LAYERS
    else:
        shapes = [(BLOCKS, 2, *tail)] * LAYERS
    return [
        torch.randint(-(1 << 15), 1 << 15, s, dtype=torch.int16, device=device).view(torch.float16)
        for s in shapes
    ]


def _block_dim(layout: KVCacheLayout) -> int:
    return 1 if layout is KVCacheLayout.KV_FIRST else 0


def _blocks(t: torch.Tensor, layout: KVCacheLayout, ids: list[int]) -> torch.Tensor:
    """The int16 bits of blocks ``ids`` of one layer tensor, blocks first (a copy)."""
    index = torch.tensor(ids, device=t.device)
    return (
        t.view(torch.int16).index_select(_block_dim(layout), index).movedim(_block_dim(layout), 0)
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_cuda_kv_caches_register_with_their_device() -> None:
    device = _device()
    kv = build_canonical_kv_caches(_layers(KVCacheLayout.KV_FIRST, device), KVCacheLayout.KV_FIRST)
    assert kv.device_index == device.index and kv.on_device
    assert all(t.device_index == device.index for t in kv.tensors)
    handlers = CpuGpuOffloadingHandlers(kv, 1, CPU_BLOCKS)
    try:
        worker = OffloadingWorker()
        handlers.register(worker)
        for h in handlers.handlers:
            assert h.uses_cuda and h.device == device.index
            # Each job's path is chosen by its chunk size (no fixed method).
            assert h.copy_method is None and h.copy_policy == ops.CopyMethodPolicy()
        # private: host registration is the handlers' own resource; nothing public reports it.
        assert handlers._registered, "the CPU views were not pinned"
    finally:
        handlers.shutdown()
    host = torch.zeros(BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.float16)
    mixed = [_layers(KVCacheLayout.BLOCKS_FIRST, device)[0], host]
    with pytest.raises(ValueError, match="one device or all on the host"):
        build_canonical_kv_caches(mixed, KVCacheLayout.BLOCKS_FIRST)


def test_current_compute_stream_is_torchs_current_stream() -> None:
    device = _device()
    assert current_compute_stream() == torch.cuda.current_stream().cuda_stream
    side = torch.cuda.Stream(device)
    assert side.cuda_stream != torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.stream(side):
        assert current_compute_stream() == side.cuda_stream
        assert current_compute_stream(device.index) == side.cuda_stream
    assert current_compute_stream(device.index) == torch.cuda.current_stream(device).cuda_stream


@pytest.mark.parametrize("factor", [1, 4])
@pytest.mark.parametrize(
    "method", [ops.CopyMethod.DMA, ops.CopyMethod.KERNEL], ids=["dma", "kernel"]
)
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=[x.value for x in KVCacheLayout])
def test_round_trip_through_handlers_is_bit_exact(
    layout: KVCacheLayout, method: ops.CopyMethod, factor: int
) -> None:
    """A model write on torch's current stream, slowed down, then at once a store of the written
    blocks (no synchronisation in between), then a load of them into other blocks."""
    device = _device()
    layers = _layers(layout, device)
    kv = build_canonical_kv_caches(layers, layout)
    handlers = CpuGpuOffloadingHandlers(kv, factor, CPU_BLOCKS, copy_method=method)
    worker = OffloadingWorker()
    handlers.register(worker)
    n = 2 * factor  # two CPU rows of `factor` GPU blocks each
    stored, loaded, untouched = list(range(3, 3 + n)), list(range(20, 20 + n)), [0, 1, 2]
    try:
        assert handlers.gpu_to_cpu_handler.copy_method is method
        before = [_blocks(t, layout, untouched) for t in layers]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # private: torch's only way to keep a stream busy for a set time on the GPU.
            torch.cuda._sleep(SLOW_WRITE_CYCLES)
            written = []
            for t in layers:
                shape = list(_blocks(t, layout, stored).shape)
                new = torch.randint(
                    -(1 << 15), 1 << 15, shape, dtype=torch.int16, device=device
                ).movedim(0, _block_dim(layout))
                index = [slice(None)] * t.dim()
                index[_block_dim(layout)] = torch.tensor(stored, device=device)
                t.view(torch.int16)[tuple(index)] = new
                written.append(new.movedim(_block_dim(layout), 0))
            store = TransferSpec(GPULoadStoreSpec(stored, [n], [0]), CPULoadStoreSpec([6, 1]))
            assert worker.transfer_async(1, store)  # ordered after `side`, the current stream
        worker.wait({1})
        load = TransferSpec(CPULoadStoreSpec([6, 1]), GPULoadStoreSpec(loaded, [n], [0]))
        assert worker.transfer_async(2, load)
        worker.wait({2})
        results = worker.get_finished()
        assert [(r.job_id, r.success) for r in results] == [(1, True), (2, True)]
        torch.cuda.synchronize(device)
        for t, new, old in zip(layers, written, before, strict=True):
            assert torch.equal(_blocks(t, layout, loaded), new), "loaded blocks differ"
            assert torch.equal(_blocks(t, layout, stored), new)
            assert torch.equal(_blocks(t, layout, untouched), old), "a block outside the jobs"
        lib = ops.cuda_library()
        assert lib is not None
        count, reason = lib.dma_batch_fallbacks()
        assert count == 0, f"DMA batch calls fell back to the loop: {reason}"
    finally:
        handlers.shutdown()


def test_handlers_driven_from_a_thread_that_never_used_cuda() -> None:
    device = _device()
    layers = _layers(KVCacheLayout.CROSS_LAYER, device)
    kv = build_canonical_kv_caches(layers, KVCacheLayout.CROSS_LAYER)
    handlers = CpuGpuOffloadingHandlers(kv, 1, CPU_BLOCKS)
    worker = OffloadingWorker()
    handlers.register(worker)
    torch.cuda.synchronize(device)
    expected = _blocks(layers[0], KVCacheLayout.CROSS_LAYER, [4, 5])
    errors: list[BaseException] = []

    def store() -> None:
        try:
            spec = TransferSpec(GPULoadStoreSpec([4, 5], [2], [0]), CPULoadStoreSpec([0, 3]))
            assert worker.transfer_async(1, spec)
            worker.wait({1})
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    try:
        thread = threading.Thread(target=store, name="fresh")
        thread.start()
        thread.join()
        assert not errors, errors
        load = TransferSpec(CPULoadStoreSpec([0, 3]), GPULoadStoreSpec([30, 31], [2], [0]))
        assert worker.transfer_async(2, load)
        worker.wait({2})
        assert [r.success for r in worker.get_finished()] == [True, True]
        torch.cuda.synchronize(device)
        assert torch.equal(_blocks(layers[0], KVCacheLayout.CROSS_LAYER, [30, 31]), expected)
    finally:
        handlers.shutdown()
