# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""GPU <-> CPU transfer handlers of the CPU primary tier.

``CpuGpuOffloadingHandlers`` builds one handler per direction over a worker's canonical GPU KV
caches (``CanonicalKVCaches``) and its CPU views:

* ``gpu_to_cpu_handler`` serves stores, ``(GPULoadStoreSpec, CPULoadStoreSpec)`` jobs;
* ``cpu_to_gpu_handler`` serves loads, ``(CPULoadStoreSpec, GPULoadStoreSpec)`` jobs.

CPU side: for canonical tensor ``t`` (GPU page ``P_t`` bytes) a CPU view of shape
``(num_cpu_blocks, P_t * K)``, stride ``(row_bytes, 1)``, int8, where ``K = max(block_size_factor)``
(taken from a ``SharedOffloadRegion``, given by the caller, or allocated). An offloaded block of
group ``g`` holds ``k_g`` GPU blocks: GPU-sized sub-block ``j`` of CPU row ``c`` is at
``view_t[c, j*P_t : j*P_t + p]``, ``p`` being the group's unpadded page size. Two row layouts
(``RowLayout``)::

    shared rows (the views one after another in the slot):
    CPU row c, worker slot:  | view_0: sub 0 | sub 1 | ... | view_1: sub 0 | sub 1 | ... | ...
                                    P_0       P_0             P_1       P_1

    per-group rows (``per_group_rows=True``; tensor t of group g: ``P_t * k_g`` bytes):
    CPU row c, worker slot:  | group 0: view_a | view_b | ...          |
                             | group 1: view_c | view_d | ... |  (aliases group 0's bytes)

A key belongs to one group and has a row of its own, so with per-group rows row ``c`` holds
group ``g``'s block in group ``g``'s views only; the bytes other groups' views give that row are
not the key's, and no job of another group touches the row while the key holds it.

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
        region: the worker's ``SharedOffloadRegion``; views are taken from the worker's slot, in
            tensor order or per group (``per_group_rows``).
        cpu_views: the CPU views, one per canonical tensor (int8, ``(num_cpu_blocks, >= P_t*K)``,
            or ``>= P_t*k_g`` with ``per_group_rows``; stride ``(row_bytes, 1)``), e.g. from a
            region created elsewhere. Without ``region`` and ``cpu_views``, zeroed views are
            allocated in one private mapping, laid out like a one-worker region.
        copy_method: CUDA path only: how each job's copy method is chosen
            (``CopyMethodPolicy``; default: the SM-copy kernel for chunks under 1 MiB, batched
            DMA from 1 MiB, per direction), or one method for every job (``DMA``, ``KERNEL``,
            ``DMA_LOOP``).
        max_ctas: CUDA kernel path only: most thread blocks (0: the library default).
        compute_stream: returns the model's compute stream handle on the KV cache's device
            (default: torch's current stream there, ``current_compute_stream``).
        pin_memory: register the CPU memory with CUDA (``cudaHostRegister``, mapped) when the KV
            cache is on the device. A failure only warns: DMA still works, unpinned and slower;
            the kernel path then falls back to DMA.
        per_group_rows: lay the CPU rows out per group (``RowLayout.PER_GROUP``, the spec's
            choice for a run whose groups use disjoint tensors): each group's views start at
            offset 0 of the row (of the worker's slot with ``region``), group ``g``'s view of
            tensor ``t`` being ``P_t * k_g`` bytes, so the views of different groups alias.
            False: the views follow one another, ``P_t * K`` bytes each. In either layout,
            ``cpu_views`` of different groups may alias (same row stride, inside one row).

    Ownership: the handlers own the pinning they did and the views they allocated; ``shutdown``
    waits for in-flight jobs, then unpins. The caller keeps ``region`` (and cleans it up after
    ``shutdown``).

    Devices and threads: on the CUDA path everything (pinning, streams, events, copies) runs on
    the KV cache's device, ``kv_caches.device_index``, named in every library call; so the
    handlers may be built on one thread and driven from another, one call at a time.

    Raises:
        ValueError: inconsistent geometry (views, factors, blocks), ``per_group_rows`` with a
            canonical tensor that two groups use, or a device the CUDA library does not see.
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
        copy_method: ops.CopyMethod | ops.CopyMethodPolicy | None = None,
        max_ctas: int = 0,
        compute_stream: ComputeStreamFn | None = None,
        pin_memory: bool = True,
        per_group_rows: bool = False,
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
        if region is not None and cpu_views is not None:
            raise ValueError("pass region or cpu_views, not both")
        # Per tensor: its CPU page and where in a row (of the worker's slot) it starts.
        pages, offsets = _view_placement(kv_caches, factors, per_group_rows)
        if region is not None:
            num_cpu_blocks = region.num_blocks if num_cpu_blocks is None else num_cpu_blocks
            views = [region.create_worker_view(o, p) for o, p in zip(offsets, pages, strict=True)]
        elif cpu_views is not None:
            views = list(cpu_views)
            if num_cpu_blocks is None:
                num_cpu_blocks = min((int(v.shape[0]) for v in views), default=0)
        else:
            if num_cpu_blocks is None:
                raise ValueError("num_cpu_blocks is required without region or cpu_views")
            if num_cpu_blocks < 1:
                raise ValueError(f"num_cpu_blocks={num_cpu_blocks} must be >= 1")
            views = _allocate_views(pages, offsets, num_cpu_blocks)
        if num_cpu_blocks < 1:
            raise ValueError(f"num_cpu_blocks={num_cpu_blocks} must be >= 1")
        _check_cpu_views(views, pages, num_cpu_blocks, _tensor_groups(kv_caches))
        self.per_group_rows = per_group_rows
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_views: list[torch.Tensor] = views
        self.kv_caches = kv_caches

        lib = None
        if copy_method is None:
            policy = ops.CopyMethodPolicy()
        elif isinstance(copy_method, ops.CopyMethod):
            policy = ops.CopyMethodPolicy(method=copy_method)
        else:
            policy = copy_method
        pinned = False
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
            if policy.method in (None, ops.CopyMethod.KERNEL) and not pinned:
                logger.warning("CPU KV memory is not pinned and mapped: using DMA, not the kernel")
        logger.info(
            "GPU<->CPU offload handlers: %s, %d tensors, %d groups, factors %s, %d CPU blocks%s",
            f"CUDA {policy.describe()} on cuda:{device}"
            if lib is not None
            else "torch (host memory)",
            len(kv_caches.tensors),
            kv_caches.num_groups,
            list(factors),
            num_cpu_blocks,
            ", rows per group" if per_group_rows else "",
        )
        compute = compute_stream or functools.partial(current_compute_stream, device)
        order = CrossDirectionOrder()

        def handler(store: bool) -> SingleDirectionOffloadingHandler:
            planner = JobPlanner(kv_caches, views, factors, num_cpu_blocks, store=store)
            return SingleDirectionOffloadingHandler(
                planner, store, lib, device, policy, pinned, max_ctas, compute, order
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


def _tensor_groups(kv_caches: CanonicalKVCaches) -> list[frozenset[int]]:
    """Per canonical tensor, the groups that use it."""
    users: list[set[int]] = [set() for _ in kv_caches.tensors]
    for g, refs in enumerate(kv_caches.group_data_refs):
        for ref in refs:
            users[ref.tensor_idx].add(g)
    return [frozenset(u) for u in users]


def _view_placement(
    kv_caches: CanonicalKVCaches, factors: tuple[int, ...], per_group_rows: bool
) -> tuple[list[int], list[int]]:
    """``(pages, offsets)``: per canonical tensor, its CPU page in bytes and its byte offset in
    a row (of a worker's slot), for the layout ``per_group_rows`` selects (module docstring).

    Raises:
        ValueError: ``per_group_rows`` and a tensor that two groups (or none) use.
    """
    if not per_group_rows:
        max_factor = max(factors)
        pages = [t.page_size_bytes * max_factor for t in kv_caches.tensors]
        offsets = [sum(pages[:i]) for i in range(len(pages))]
        return pages, offsets
    users = _tensor_groups(kv_caches)
    for i, groups in enumerate(users):
        if len(groups) != 1:
            # A shared tensor's page holds bytes of several groups' keys at once, which one
            # row per key cannot: such caches need shared rows (the spec chooses those when the
            # run does not give its bytes per group).
            raise ValueError(
                f"per-group rows need every canonical tensor used by exactly one group; tensor "
                f"{i} is used by groups {sorted(groups)}"
            )
    pages = [0] * len(kv_caches.tensors)
    offsets = [0] * len(kv_caches.tensors)
    for g, refs in enumerate(kv_caches.group_data_refs):
        offset = 0
        for ref in refs:
            page = kv_caches.tensors[ref.tensor_idx].page_size_bytes * factors[g]
            pages[ref.tensor_idx], offsets[ref.tensor_idx] = page, offset
            offset += page
    return pages, offsets


def _allocate_views(
    pages: Sequence[int], offsets: Sequence[int], num_cpu_blocks: int
) -> list[torch.Tensor]:
    """Zeroed CPU views laid out like a one-worker shared region (a row is as long as the
    furthest view reaches; ``offsets`` place each view in it).

    Backed by a private anonymous mapping: page-aligned and shared with no other allocation, so
    pinning it can neither collide with nor outlive anyone else's registration.
    """
    row_bytes = max(o + p for o, p in zip(offsets, pages, strict=True))
    base = torch.frombuffer(mmap.mmap(-1, num_cpu_blocks * row_bytes), dtype=torch.int8)
    return [
        torch.as_strided(base, (num_cpu_blocks, page), (row_bytes, 1), offset)
        for page, offset in zip(pages, offsets, strict=True)
    ]


def _check_cpu_views(
    views: Sequence[torch.Tensor],
    pages: Sequence[int],
    num_cpu_blocks: int,
    tensor_groups: Sequence[frozenset[int]],
) -> None:
    """Check the CPU views: one per tensor, large enough, and overlapping only as allowed.

    ``tensor_groups[i]`` names the groups that use tensor ``i``: views of tensors whose group
    sets are disjoint may alias (per-group rows), provided they share a row stride and fit in
    one row together, so that row ``c`` of one aliases row ``c`` of the other and no other row.

    Raises:
        ValueError: naming the first view or pair of views at fault.
    """
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
    # apart, which no layout here produces.) Views of different groups' tensors may instead
    # alias: a row is one key's, of one group, so only the row's own group reads or writes it;
    # they must still fit in one row together (``max end - min start <= stride``), or row ``c``
    # of one would reach into row ``c + 1`` of the other.
    for a in range(len(spans)):
        for b in range(a + 1, len(spans)):
            pa, sa, la = spans[a]
            pb, sb, lb = spans[b]
            end_a = pa + (num_cpu_blocks - 1) * sa + la
            end_b = pb + (num_cpu_blocks - 1) * sb + lb
            if pa >= end_b or pb >= end_a:
                continue
            (p0, l0), (p1, l1) = sorted(((pa, la), (pb, lb)))
            if sa == sb and p0 + l0 <= p1 and p1 + l1 <= p0 + sa:
                continue
            if (
                tensor_groups[a].isdisjoint(tensor_groups[b])
                and sa == sb
                and max(pa + la, pb + lb) - p0 <= sa
            ):
                continue
            raise ValueError(f"CPU views {a} and {b} overlap")
