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

Job semantics (both directions), for a GPU spec with ``group_sizes`` ``n_g`` and ``block_indices``
``i_g`` and a CPU spec: GPU block ids are ordered by group; so are CPU block ids, group ``g`` taking
``ceil((s_g + n_g) / k_g)`` of them, where ``s_g = i_g % k_g`` sub-blocks of the group's first CPU
block are skipped (a load whose first offloaded block is only partly needed). GPU block ``m`` of
the group (0-based) pairs with sub-block ``(s_g + m) % k_g`` of the group's CPU block
``(s_g + m) // k_g``. Every layer (canonical tensor) of the group moves in the same job.

Execution: on device memory (CUDA library), every job runs on a stream from a pool, after the
previous job of its direction (jobs of a direction are serialised, in submission order); a store
also waits for the work enqueued so far on the model's compute stream, so it reads the KV the
model wrote. Completions are reported in submission order. On host memory (the CPU-only setup),
the torch path copies synchronously inside ``transfer_async`` and reports through the same queue.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
    TransferType,
)

logger = logging.getLogger(__name__)

ComputeStreamFn = Callable[[], int]
"""Returns the ``cudaStream_t`` handle (as an int; 0 = legacy default stream) of the stream the
model's compute runs on; stores are ordered after the work enqueued on it so far."""


def current_compute_stream() -> int:
    """torch's current CUDA stream if torch has CUDA, else the legacy default stream (0)."""
    if torch.cuda.is_available():
        return int(torch.cuda.current_stream().cuda_stream)
    return 0


# ---------------------------------------------------------------------------------------------
# Job planning: specs -> regions and id arrays
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    regions: ops.RegionArray
    src_ids: npt.NDArray[np.int64]
    dst_ids: npt.NDArray[np.int64]
    num_bytes: int


class _JobPlanner:
    """Turns a job's specs into one ``copy_blocks`` call for one direction.

    Region templates (everything but the pair range) are built once per group; a job only fills
    in pair ranges and id arrays, so planning costs O(blocks of the job + regions).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_views: Sequence[torch.Tensor],
        factors: tuple[int, ...],
        num_cpu_blocks: int,
        store: bool,
    ) -> None:
        self._factors = factors
        self._max_factor = max(factors)
        self._num_cpu_blocks = num_cpu_blocks
        self._store = store
        self._templates: list[ops.RegionArray] = []
        self._group_bytes: list[int] = []
        self._num_gpu_blocks: list[int] = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            regions = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx]
                view = cpu_views[ref.tensor_idx]
                gpu = ops.BlockSide(
                    base=t.ptr,
                    block_stride=t.row_stride_bytes,
                    num_blocks=t.num_blocks,
                    sub_stride=t.page_size_bytes,
                )
                cpu = ops.BlockSide(
                    base=view.data_ptr(),
                    block_stride=int(view.stride(0)),
                    num_blocks=num_cpu_blocks,
                    sub_blocks=factors[g],
                    sub_stride=t.page_size_bytes,
                )
                src, dst = (gpu, cpu) if store else (cpu, gpu)
                regions.append(ops.CopyRegion(src, dst, ref.page_size_bytes, 0, 0))
            template = ops.make_regions(regions)
            # Validates everything but ids once, with the real extents.
            ops.check_copy_blocks(template, np.zeros(0, np.int64), np.zeros(0, np.int64))
            self._templates.append(template)
            self._group_bytes.append(sum(ref.page_size_bytes for ref in refs))
            self._num_gpu_blocks.append(
                min(kv_caches.tensors[r.tensor_idx].num_blocks for r in refs)
            )
        # Groups sharing a tensor can write the same bytes: their destinations are checked for
        # collisions together (connected components of "shares a tensor").
        parent = list(range(kv_caches.num_groups))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        first_user: dict[int, int] = {}
        for g, refs in enumerate(kv_caches.group_data_refs):
            for ref in refs:
                other = first_user.setdefault(ref.tensor_idx, g)
                parent[find(g)] = find(other)
        self._cluster = [find(g) for g in range(kv_caches.num_groups)]

    def plan(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec) -> _Plan:
        num_groups = len(self._templates)
        if len(gpu_spec.group_sizes) != num_groups:
            raise ValueError(
                f"the GPU spec has {len(gpu_spec.group_sizes)} groups, the KV cache has "
                f"{num_groups}"
            )
        gpu_ids, cpu_ids = gpu_spec.block_ids, cpu_spec.block_ids
        gpu_parts: list[npt.NDArray[np.int64]] = []
        cpu_parts: list[npt.NDArray[np.int64]] = []
        region_parts: list[ops.RegionArray] = []
        dst_keys: dict[int, list[npt.NDArray[np.int64]]] = {}
        gpu_off = cpu_off = pairs = num_bytes = 0
        for g, n in enumerate(gpu_spec.group_sizes):
            if n == 0:
                continue
            k = self._factors[g]
            skip = gpu_spec.block_indices[g] % k
            n_cpu = -(-(skip + n) // k)
            cpu_g = cpu_ids[cpu_off : cpu_off + n_cpu]
            if len(cpu_g) != n_cpu:
                raise ValueError(
                    f"group {g}: {n} GPU blocks starting at sub-block {skip} need {n_cpu} CPU "
                    f"blocks, the CPU spec has {len(cpu_ids) - cpu_off} left"
                )
            if int(cpu_g.max()) >= self._num_cpu_blocks:
                raise ValueError(
                    f"group {g}: CPU block {int(cpu_g.max())} is outside "
                    f"[0, {self._num_cpu_blocks})"
                )
            gpu_g = gpu_ids[gpu_off : gpu_off + n]
            if int(gpu_g.max()) >= self._num_gpu_blocks[g]:
                raise ValueError(
                    f"group {g}: GPU block {int(gpu_g.max())} is outside "
                    f"[0, {self._num_gpu_blocks[g]})"
                )
            if k == 1:
                sub = cpu_g
            else:
                sub = (cpu_g[:, None] * k + np.arange(k, dtype=np.int64)).ravel()[skip : skip + n]
            gpu_parts.append(gpu_g)
            cpu_parts.append(sub)
            template = self._templates[g].copy()
            template["pair_begin"] = pairs
            template["pair_count"] = n
            region_parts.append(template)
            # Destination slots in a group-independent numbering, to catch two groups of one
            # cluster writing the same page.
            key = gpu_g if not self._store else (sub // k) * self._max_factor + sub % k
            dst_keys.setdefault(self._cluster[g], []).append(key)
            num_bytes += n * self._group_bytes[g]
            pairs += n
            gpu_off += n
            cpu_off += n_cpu
        if cpu_off != len(cpu_ids):
            raise ValueError(f"the CPU spec has {len(cpu_ids)} blocks, the job uses {cpu_off}")
        for keys in dst_keys.values():
            flat = np.concatenate(keys) if len(keys) > 1 else keys[0]
            uniq, counts = np.unique(flat, return_counts=True)
            if len(uniq) != len(flat):
                dup = [int(x) for x in uniq[counts > 1][:4]]
                k_max = self._max_factor
                where = (
                    [f"CPU row {d // k_max} sub-block {d % k_max}" for d in dup]
                    if self._store
                    else [f"GPU block {d}" for d in dup]
                )
                raise ValueError(f"the job writes more than once to: {', '.join(where)}")
        if not region_parts:
            empty = np.zeros(0, dtype=np.int64)
            return _Plan(np.zeros(0, dtype=ops.REGION_DTYPE), empty, empty, 0)
        gpu_all = np.concatenate(gpu_parts)
        cpu_all = np.concatenate(cpu_parts)
        src, dst = (gpu_all, cpu_all) if self._store else (cpu_all, gpu_all)
        return _Plan(np.concatenate(region_parts), src, dst, num_bytes)


# ---------------------------------------------------------------------------------------------
# Single-direction handler
# ---------------------------------------------------------------------------------------------


@dataclass
class _Transfer:
    job_id: int
    num_bytes: int
    stream: ops.CudaStream | None = None
    start: ops.CudaEvent | None = None
    end: ops.CudaEvent | None = None
    elapsed_s: float | None = None
    error: str | None = None
    cpu_rows: list[int] | None = None
    gpu_blocks: list[int] | None = None


class _CrossDirectionOrder:
    """Which in-flight CUDA job of each direction last touched each CPU row and GPU block.

    Jobs of one direction are serialised by their handler; this orders a job after the in-flight
    jobs of the *other* direction that touch the same memory: a load after a store writing the
    rows it reads (or reading the GPU blocks it overwrites), a store after a load reading the
    rows it overwrites (or writing the GPU blocks it reads). Only hazards are waited for, so loads
    and stores of unrelated blocks still overlap. Entries live from submission until the job is
    reported: O(blocks of in-flight jobs).
    """

    def __init__(self) -> None:
        # [direction][id] -> end event of the last in-flight job of that direction touching it;
        # direction 0 = store, 1 = load.
        self._rows: tuple[dict[int, ops.CudaEvent], dict[int, ops.CudaEvent]] = ({}, {})
        self._blocks: tuple[dict[int, ops.CudaEvent], dict[int, ops.CudaEvent]] = ({}, {})

    def hazards(self, store: bool, rows: list[int], blocks: list[int]) -> list[ops.CudaEvent]:
        other = 1 if store else 0
        found: dict[int, ops.CudaEvent] = {}
        for table, ids in ((self._rows[other], rows), (self._blocks[other], blocks)):
            for i in ids:
                event = table.get(i)
                if event is not None:
                    found[id(event)] = event
        return list(found.values())

    def add(self, store: bool, rows: list[int], blocks: list[int], end: ops.CudaEvent) -> None:
        mine = 0 if store else 1
        for table, ids in ((self._rows[mine], rows), (self._blocks[mine], blocks)):
            for i in ids:
                table[i] = end

    def remove(self, store: bool, rows: list[int], blocks: list[int], end: ops.CudaEvent) -> None:
        mine = 0 if store else 1
        for table, ids in ((self._rows[mine], rows), (self._blocks[mine], blocks)):
            for i in ids:
                # A later job of this direction may have taken the entry over: keep it then.
                if table.get(i) is end:
                    del table[i]


class SingleDirectionOffloadingHandler(OffloadingHandler):
    """Moves blocks in one direction between the GPU KV cache and the CPU views.

    Jobs are serialised in submission order and reported in that order (FIFO); a job is also
    ordered after in-flight jobs of the other direction that touch the same CPU rows or GPU
    blocks. A job's blocks must not be reused by the caller until it is reported; on the torch
    path the copy is done when ``transfer_async`` returns. A job that failed is reported (as
    failed) only once whatever it had enqueued has finished, so its blocks can be reused at once.
    """

    def __init__(
        self,
        planner: _JobPlanner,
        store: bool,
        lib: ops.CudaCopyLibrary | None,
        method: ops.CopyMethod,
        max_ctas: int,
        compute_stream: ComputeStreamFn,
        order: _CrossDirectionOrder,
    ) -> None:
        self._planner = planner
        self._store = store
        self._lib = lib
        self._method = method
        self._max_ctas = max_ctas
        self._compute_stream = compute_stream
        self._order = order
        self.transfer_type: TransferType = ("GPU", "CPU") if store else ("CPU", "GPU")
        self._queue: deque[_Transfer] = deque()
        self._free_streams: list[ops.CudaStream] = []
        self._free_events: list[ops.CudaEvent] = []
        self._compute_event: ops.CudaEvent | None = None
        self._last_end: ops.CudaEvent | None = None
        self._closed = False

    @property
    def uses_cuda(self) -> bool:
        """Whether jobs run through the CUDA library (else the synchronous torch path)."""
        return self._lib is not None

    @property
    def copy_method(self) -> ops.CopyMethod | None:
        """The CUDA copy method, or None on the torch path."""
        return self._method if self._lib is not None else None

    def _split(self, spec: TransferSpec) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
        src, dst = spec
        gpu, cpu = (src, dst) if self._store else (dst, src)
        if not isinstance(gpu, GPULoadStoreSpec) or not isinstance(cpu, CPULoadStoreSpec):
            raise TypeError(
                f"{self.transfer_type[0]} -> {self.transfer_type[1]} handler got "
                f"{type(src).__name__} -> {type(dst).__name__}"
            )
        return gpu, cpu

    @override
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self._closed:
            raise RuntimeError("the handler is shut down")
        gpu_spec, cpu_spec = self._split(spec)
        plan = self._planner.plan(gpu_spec, cpu_spec)
        if self._lib is None:
            t0 = time.perf_counter()
            ops.copy_blocks(plan.regions, plan.src_ids, plan.dst_ids, backend="torch")
            self._queue.append(
                _Transfer(job_id, plan.num_bytes, elapsed_s=time.perf_counter() - t0)
            )
            return True
        self._submit_cuda(
            self._lib, job_id, plan, cpu_spec.block_ids.tolist(), gpu_spec.block_ids.tolist()
        )
        return True

    def _take_event(self, lib: ops.CudaCopyLibrary) -> ops.CudaEvent:
        return self._free_events.pop() if self._free_events else ops.CudaEvent(lib)

    def _submit_cuda(
        self,
        lib: ops.CudaCopyLibrary,
        job_id: int,
        plan: _Plan,
        rows: list[int],
        blocks: list[int],
    ) -> None:
        stream = self._free_streams.pop() if self._free_streams else ops.CudaStream(lib)
        start = end = None
        try:
            start, end = self._take_event(lib), self._take_event(lib)
            if self._store:
                # Read the KV only after the model's kernels enqueued so far have written it.
                if self._compute_event is None:
                    self._compute_event = ops.CudaEvent(lib, enable_timing=False)
                self._compute_event.record(self._compute_stream())
                stream.wait_event(self._compute_event)
            if self._last_end is not None:
                stream.wait_event(self._last_end)
            for event in self._order.hazards(self._store, rows, blocks):
                stream.wait_event(event)
            start.record(stream.handle)
        except Exception:
            # Nothing was copied: hand the resources back and let the job fail at submission.
            self._free_streams.append(stream)
            self._free_events += [e for e in (start, end) if e is not None]
            raise
        error = None
        try:
            lib.copy_blocks(
                plan.regions,
                plan.src_ids,
                plan.dst_ids,
                self._method,
                self._max_ctas,
                stream.handle,
            )
        except (ops.CudaCopyError, ops.CopyArgumentError) as e:
            # Part of the job may be enqueued: it stays in the queue behind its end event, so
            # later jobs are still ordered after it, and it is reported (failed) once drained.
            error = str(e)
            logger.error("job %d (%s): %s", job_id, "store" if self._store else "load", e)
        # If recording fails the CUDA context is unusable; the exception fails the submission.
        end.record(stream.handle)
        self._queue.append(
            _Transfer(job_id, plan.num_bytes, stream, start, end, None, error, rows, blocks)
        )
        self._order.add(self._store, rows, blocks, end)
        self._last_end = end

    @override
    def get_finished(self) -> list[TransferResult]:
        results = []
        while self._queue:
            t = self._queue[0]
            if t.end is not None:
                try:
                    if not t.end.query():
                        break
                except ops.CudaCopyError as e:
                    t.error = t.error or str(e)
            self._queue.popleft()
            results.append(self._finish(t))
        return results

    def _finish(self, t: _Transfer) -> TransferResult:
        elapsed = t.elapsed_s
        if t.error is None and t.start is not None and t.end is not None:
            try:
                elapsed = t.start.elapsed_ms(t.end) / 1000.0
            except ops.CudaCopyError:
                elapsed = None
        self._recycle(t)
        if t.error is not None:
            return TransferResult(t.job_id, False, transfer_type=self.transfer_type)
        return TransferResult(t.job_id, True, t.num_bytes, elapsed, self.transfer_type)

    def _recycle(self, t: _Transfer) -> None:
        if t.end is not None:
            self._order.remove(self._store, t.cpu_rows or [], t.gpu_blocks or [], t.end)
            if t.end is self._last_end:
                self._last_end = None
        if t.stream is not None:
            self._free_streams.append(t.stream)
        self._free_events += [e for e in (t.start, t.end) if e is not None]
        t.stream = t.start = t.end = None

    @override
    def wait(self, job_ids: Collection[int]) -> None:
        ids = set(job_ids)
        for t in self._queue:
            if t.job_id in ids and t.end is not None:
                try:
                    t.end.synchronize()
                except ops.CudaCopyError as e:
                    t.error = t.error or str(e)

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        while self._queue:
            t = self._queue.popleft()
            if t.end is not None:
                try:
                    t.end.synchronize()
                except ops.CudaCopyError as e:
                    logger.warning("job %d failed during shutdown: %s", t.job_id, e)
            self._recycle(t)
        for res in [*self._free_streams, *self._free_events, self._compute_event]:
            if res is not None:
                try:
                    res.close()
                except ops.CudaCopyError as e:
                    logger.warning("releasing %r failed: %s", res, e)
        self._free_streams.clear()
        self._free_events.clear()
        self._compute_event = None

    @override
    def __repr__(self) -> str:
        path = f"cuda/{self._method.name.lower()}" if self._lib is not None else "torch"
        return (
            f"SingleDirectionOffloadingHandler({self.transfer_type[0]}->{self.transfer_type[1]}, "
            f"{path}, pending={len(self._queue)})"
        )


# ---------------------------------------------------------------------------------------------
# Both directions
# ---------------------------------------------------------------------------------------------


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
        compute_stream: returns the model's compute stream handle (default
            ``current_compute_stream``).
        pin_memory: register the CPU memory with CUDA (``cudaHostRegister``, mapped) when the KV
            cache is on the device. A failure only warns: DMA still works, unpinned and slower;
            the kernel path then falls back to DMA.

    Ownership: the handlers own the pinning they did and the views they allocated; ``shutdown``
    waits for in-flight jobs, then unpins. The caller keeps ``region`` (and cleans it up after
    ``shutdown``).

    Raises:
        ValueError: inconsistent geometry (views, factors, blocks).
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
        if kv_caches.on_device:
            lib = ops.cuda_library()
            if lib is None or ops.copy_backend() != "cuda":
                raise RuntimeError(
                    "the KV cache is in device memory but the CUDA copy backend is unavailable "
                    f"(backend {ops.copy_backend()!r})"
                )
            self._lib = lib
            pinned = pin_memory and self._pin(lib, region, views)
            if method is ops.CopyMethod.KERNEL and not pinned:
                logger.warning("CPU KV memory is not pinned and mapped: using DMA, not the kernel")
                method = ops.CopyMethod.DMA
        logger.info(
            "GPU<->CPU offload handlers: %s, %d tensors, %d groups, factors %s, %d CPU blocks",
            f"CUDA {method.name}" if lib is not None else "torch (host memory)",
            len(kv_caches.tensors),
            kv_caches.num_groups,
            list(factors),
            num_cpu_blocks,
        )
        compute = compute_stream or current_compute_stream
        order = _CrossDirectionOrder()
        self.gpu_to_cpu_handler = SingleDirectionOffloadingHandler(
            _JobPlanner(kv_caches, views, factors, num_cpu_blocks, store=True),
            True,
            lib,
            method,
            max_ctas,
            compute,
            order,
        )
        self.cpu_to_gpu_handler = SingleDirectionOffloadingHandler(
            _JobPlanner(kv_caches, views, factors, num_cpu_blocks, store=False),
            False,
            lib,
            method,
            max_ctas,
            compute,
            order,
        )

    def _pin(
        self,
        lib: ops.CudaCopyLibrary,
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
                if lib.host_register(ptr, nbytes, flags):
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
                    self._lib.host_unregister(ptr)
                except ops.CudaCopyError as e:
                    logger.warning("cudaHostUnregister(%#x) failed: %s", ptr, e)
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
    # Views sharing a row stride (as the shared region's do) must use disjoint byte ranges of a
    # row; views with other strides must not overlap at all.
    for a in range(len(spans)):
        for b in range(a + 1, len(spans)):
            pa, sa, la = spans[a]
            pb, sb, lb = spans[b]
            end_a = pa + (num_cpu_blocks - 1) * sa + la
            end_b = pb + (num_cpu_blocks - 1) * sb + lb
            if pa >= end_b or pb >= end_a:
                continue
            if sa != sb or not (pa + la <= pb or pb + lb <= pa) or abs(pa - pb) + max(la, lb) > sa:
                raise ValueError(f"CPU views {a} and {b} overlap")
