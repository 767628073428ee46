# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""GPU <-> CPU transfer handlers of the CPU primary tier.

``CpuGpuOffloadingHandlers`` builds one handler per direction over a worker's canonical GPU KV
caches (``CanonicalKVCaches``) and its CPU views:

* ``gpu_to_cpu_handler`` serves stores, ``(GPULoadStoreSpec, CPULoadStoreSpec)`` jobs;
* ``cpu_to_gpu_handler`` serves loads, ``(CPULoadStoreSpec, GPULoadStoreSpec)`` jobs.

CPU side: for canonical tensor ``t`` (GPU page ``P_t`` bytes) a CPU view of shape
``(num_cpu_blocks, P_t * K)``, stride ``(row_bytes, 1)``, int8, where ``K = max(block_size_factor)``
(taken from a ``SharedOffloadRegion`` with ``create_next_worker_view``, given by the caller, or
allocated). An offloaded block of group ``g`` holds ``k_g`` GPU blocks: GPU-sized sub-block ``j`` of
CPU row ``c`` is at ``view_t[c, j*P_t : j*P_t + p]``, ``p`` being the group's unpadded page size::

    CPU row c, worker slot:  | view_0: sub 0 | sub 1 | ... | view_1: sub 0 | sub 1 | ... | ...
                                    P_0       P_0             P_1       P_1

How a job's specs pair GPU blocks with CPU sub-blocks: ``planner``. How jobs are submitted,
ordered and reported (streams, events, the model's compute stream): ``handler``.
Both handlers run on the KV cache's device (``CanonicalKVCaches.device_index``) and may be called
from any thread.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Sequence

import torch

from vllm import _custom_ops as ops
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.transfer.compute_stream import ComputeStreamFn, current_compute_stream
from vllm.v1.kv_offload.cpu.transfer.handler import (
    CrossDirectionOrder,
    SingleDirectionOffloadingHandler,
)
from vllm.v1.kv_offload.cpu.transfer.planner import JobPlanner
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, OffloadingWorker

__all__ = [
    "ComputeStreamFn",
    "CpuGpuOffloadingHandlers",
    "SingleDirectionOffloadingHandler",
    "current_compute_stream",
]

logger = init_logger(__name__)


class CpuGpuOffloadingHandlers:
    """The store and load handlers of one worker, over shared CPU views.

    Args:
        kv_caches: the worker's canonical GPU KV caches.
        block_size_factor: GPU blocks per offloaded block, one int for every group or one per
            group (``k_g >= 1``).
        num_cpu_blocks: CPU rows; default: from ``region`` or ``cpu_views``. Required otherwise.
        region: the worker's ``SharedOffloadRegion``; views are taken from it in tensor order.
        cpu_views: the CPU views, one per canonical tensor (int8, ``(num_cpu_blocks, >= P_t*K)``,
            stride ``(row_bytes, 1)``), e.g. from a region created elsewhere. Without ``region``
            and ``cpu_views``, zeroed views are allocated in one private mapping, laid out like a
            one-worker region.
        copy_method: CUDA path only: ``DMA`` (default) or ``KERNEL`` (or ``DMA_LOOP``).
        max_ctas: CUDA kernel path only: most thread blocks (0: the library default).
        compute_stream: returns the model's compute stream handle on the KV cache's device
            (default: torch's current stream there, ``current_compute_stream``).
        pin_memory: register the CPU memory with CUDA (``cudaHostRegister``, mapped) when the KV
            cache is on the device. A failure only warns: DMA still works, unpinned and slower;
            the kernel path then falls back to DMA.

    Ownership: the handlers own the pinning they did and the views they allocated; ``shutdown``
    waits for in-flight jobs, then unpins. The caller keeps ``region`` (and cleans it up after
    ``shutdown``).

    Devices and threads: on the CUDA path everything (pinning, streams, events, copies) runs on
    the KV cache's device, ``kv_caches.device_index``, named in every library call; so the
    handlers may be built on one thread and driven from another, one call at a time.

    Raises:
        ValueError: inconsistent geometry (views, factors, blocks), or a device the CUDA library
            does not see.
        RuntimeError: the KV cache is on the device but the CUDA library is unavailable.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        block_size_factor: int | Sequence[int],
        num_cpu_blocks: int | None = None,
        *,
        region: SharedOffloadRegion | None = None,
        cpu_views: Sequence[torch.Tensor] | None = None,
        copy_method: ops.CopyMethod = ops.CopyMethod.DMA,
        max_ctas: int = 0,
        compute_stream: ComputeStreamFn | None = None,
        pin_memory: bool = True,
    ) -> None:
        self._registered: list[int] = []
        self._lib: ops.CudaCopyLibrary | None = None
        self._device = -1
        factors = (
            (int(block_size_factor),) * kv_caches.num_groups
            if isinstance(block_size_factor, int)
            else tuple(int(f) for f in block_size_factor)
        )
        if len(factors) != kv_caches.num_groups or min(factors) < 1:
            raise ValueError(
                f"block_size_factor {block_size_factor!r}: need one factor >= 1 per group "
                f"({kv_caches.num_groups})"
            )
        self.block_size_factors = factors
        max_factor = max(factors)
        pages = [t.page_size_bytes * max_factor for t in kv_caches.tensors]
        if region is not None and cpu_views is not None:
            raise ValueError("pass region or cpu_views, not both")
        if region is not None:
            num_cpu_blocks = region.num_blocks if num_cpu_blocks is None else num_cpu_blocks
            views = [region.create_next_worker_view(p) for p in pages]
        elif cpu_views is not None:
            views = list(cpu_views)
            if num_cpu_blocks is None:
                num_cpu_blocks = min((int(v.shape[0]) for v in views), default=0)
        else:
            if num_cpu_blocks is None:
                raise ValueError("num_cpu_blocks is required without region or cpu_views")
            if num_cpu_blocks < 1:
                raise ValueError(f"num_cpu_blocks={num_cpu_blocks} must be >= 1")
            views = _allocate_views(pages, num_cpu_blocks)
        if num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks} must be >= 1")
        _check_cpu_views(views, pages, num_cpu_blocks)
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_views: list[torch.Tensor] = views
        self.kv_caches = kv_caches

        lib = None
        method = copy_method
        device = kv_caches.device_index
        if device is not None:
            lib = ops.cuda_library()
            if lib is None or ops.copy_backend() != "cuda":
                raise RuntimeError(
                    "the KV cache is in device memory but the CUDA copy backend is unavailable "
                    f"(backend {ops.copy_backend()!r}: {ops.cuda_devices().problem})"
                )
            visible = ops.cuda_devices().count
            if device >= visible:
                raise ValueError(
                    f"the KV cache is on cuda:{device} but the CUDA copy library sees {visible} "
                    "GPU(s)"
                )
            self._lib = lib
            self._device = device
            pinned = pin_memory and self._pin(lib, device, region, views)
            if method is ops.CopyMethod.KERNEL and not pinned:
                logger.warning("CPU KV memory is not pinned and mapped: using DMA, not the kernel")
                method = ops.CopyMethod.DMA
        logger.info(
            "GPU<->CPU offload handlers: %s, %d tensors, %d groups, factors %s, %d CPU blocks",
            f"CUDA {method.name} on cuda:{device}" if lib is not None else "torch (host memory)",
            len(kv_caches.tensors),
            kv_caches.num_groups,
            list(factors),
            num_cpu_blocks,
        )
        compute = compute_stream or functools.partial(current_compute_stream, device)
        order = CrossDirectionOrder()

        def handler(store: bool) -> SingleDirectionOffloadingHandler:
            planner = JobPlanner(kv_caches, views, factors, num_cpu_blocks, store=store)
            return SingleDirectionOffloadingHandler(
                planner, store, lib, device, method, max_ctas, compute, order
            )

        self.gpu_to_cpu_handler = handler(store=True)
        self.cpu_to_gpu_handler = handler(store=False)

    def _pin(
        self,
        lib: ops.CudaCopyLibrary,
        device: int,
        region: SharedOffloadRegion | None,
        views: Sequence[torch.Tensor],
    ) -> bool:
        """Pin (and map) the CPU memory; True if all of it is pinned."""
        if region is not None:
            ranges = [(region.base_ptr, region.total_bytes)]
        else:
            storages = {}
            for v in views:
                s = v.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            ranges = sorted(storages.items())
        flags = ops.HOST_REGISTER_PORTABLE | ops.HOST_REGISTER_MAPPED
        for ptr, nbytes in ranges:
            try:
                if lib.host_register(device, ptr, nbytes, flags):
                    self._registered.append(ptr)
            except (ops.CudaCopyError, ops.CopyArgumentError) as e:
                logger.warning(
                    "cudaHostRegister of %d bytes failed (%s): transfers unpinned", nbytes, e
                )
                return False
        return True

    @property
    def handlers(self) -> tuple[SingleDirectionOffloadingHandler, SingleDirectionOffloadingHandler]:
        """``(gpu_to_cpu_handler, cpu_to_gpu_handler)``."""
        return self.gpu_to_cpu_handler, self.cpu_to_gpu_handler

    def handler_specs(
        self,
    ) -> list[tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]]:
        """``(src spec class, dst spec class, handler)`` for each direction, for registration."""
        return [
            (GPULoadStoreSpec, CPULoadStoreSpec, self.gpu_to_cpu_handler),
            (CPULoadStoreSpec, GPULoadStoreSpec, self.cpu_to_gpu_handler),
        ]

    def register(self, worker: OffloadingWorker) -> None:
        """Register both handlers with ``worker`` (GPU -> CPU and CPU -> GPU)."""
        for src_cls, dst_cls, handler in self.handler_specs():
            worker.register_handler(src_cls, dst_cls, handler)

    def shutdown(self) -> None:
        """Wait for in-flight jobs, release streams and events, then unpin the CPU memory."""
        self.gpu_to_cpu_handler.shutdown()
        self.cpu_to_gpu_handler.shutdown()
        if self._lib is not None:
            for ptr in self._registered:
                try:
                    self._lib.host_unregister(self._device, ptr)
                except ops.CudaCopyError as e:
                    logger.warning("cudaHostUnregister(%#x) failed: %s", ptr, e)
            fallbacks, reason = self._lib.dma_batch_fallbacks()
            if fallbacks:
                # The copies were still made (by the loop), only slower: worth a word, not more.
                logger.warning("%d DMA job(s) ran as a cudaMemcpyAsync loop: %s", fallbacks, reason)
        self._registered.clear()


def _allocate_views(pages: Sequence[int], num_cpu_blocks: int) -> list[torch.Tensor]:
    """Zeroed CPU views laid out like a one-worker shared region (row = every tensor's page).

    Backed by a private anonymous mapping: page-aligned and shared with no other allocation, so
    pinning it can neither collide with nor outlive anyone else's registration.
    """
    row_bytes = sum(pages)
    base = torch.frombuffer(mmap.mmap(-1, num_cpu_blocks * row_bytes), dtype=torch.int8)
    views, offset = [], 0
    for page in pages:
        views.append(torch.as_strided(base, (num_cpu_blocks, page), (row_bytes, 1), offset))
        offset += page
    return views


def _check_cpu_views(
    views: Sequence[torch.Tensor], pages: Sequence[int], num_cpu_blocks: int
) -> None:
    if len(views) != len(pages):
        raise ValueError(f"need one CPU view per canonical tensor ({len(pages)}), got {len(views)}")
    spans = []
    for i, (v, page) in enumerate(zip(views, pages, strict=True)):
        if v.dtype != torch.int8 or v.dim() != 2 or v.device.type != "cpu":
            raise ValueError(f"CPU view {i} must be a 2-D int8 CPU tensor, got {v.dtype} {v.shape}")
        if v.shape[0] < num_cpu_blocks or v.shape[1] < page or v.stride(1) != 1:
            raise ValueError(
                f"CPU view {i}: shape {tuple(v.shape)} stride {v.stride()} cannot hold "
                f"{num_cpu_blocks} rows of {page} contiguous bytes"
            )
        if num_cpu_blocks > 1 and v.stride(0) < page:
            raise ValueError(f"CPU view {i}: row stride {v.stride(0)} < page {page} bytes")
        spans.append((v.data_ptr(), int(v.stride(0)), page))
    # Views whose extents intersect must interleave: share a row stride (as the shared region's
    # do) and each take a fixed byte range of every row. With the earlier view at ``p0`` (``l0``
    # bytes) and the later at ``p1`` (``l1``), rows stay disjoint iff the later starts after the
    # earlier ends and itself ends before the earlier's next row starts: ``p0 + l0 <= p1`` and
    # ``p1 + l1 <= p0 + stride``. It is the later view's length that must fit before the next
    # row, not the longer one's: views of different lengths (groups of different page sizes)
    # packed in a row, the longer first, are disjoint. (Conservative for views more than a row
    # apart, which no layout here produces.)
    for a in range(len(spans)):
        for b in range(a + 1, len(spans)):
            pa, sa, la = spans[a]
            pb, sb, lb = spans[b]
            end_a = pa + (num_cpu_blocks - 1) * sa + la
            end_b = pb + (num_cpu_blocks - 1) * sb + lb
            if pa >= end_b or pb >= end_a:
                continue
            (p0, l0), (p1, l1) = sorted(((pa, la), (pb, lb)))
            if sa != sb or p0 + l0 > p1 or p1 + l1 > p0 + sa:
                raise ValueError(f"CPU views {a} and {b} overlap")
