# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""One direction of GPU <-> CPU transfers: submission, ordering and completion of jobs.

Execution: on device memory (CUDA library), every job runs on a stream from a pool, after the
previous job of its direction (jobs of a direction are serialised, in submission order); a store
also waits for the work enqueued so far on the model's compute stream, so it reads the KV the
model wrote; and a job waits for the in-flight jobs of the other direction that touch the same
memory (``CrossDirectionOrder``). Completions are reported in submission order. On host memory
(the CPU-only setup), the torch path copies synchronously inside ``transfer_async`` and reports
through the same queue.

Devices: the streams and events of a handler belong to the KV cache's device, and every library
call names that device, so a handler may be driven from any thread (not only the one that built
it), whatever device that thread has current.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from typing_extensions import override

from vllm import _custom_ops as ops
from vllm.logger import init_logger
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.transfer.compute_stream import ComputeStreamFn
from vllm.v1.kv_offload.cpu.transfer.planner import JobPlanner, TransferPlan
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    TransferResult,
    TransferSpec,
    TransferType,
)

logger = init_logger(__name__)


@dataclass
class _Transfer:
    """A submitted job until it is reported; CUDA resources go back to the pools then."""

    job_id: int
    num_bytes: int
    stream: ops.CudaStream | None = None
    start: ops.CudaEvent | None = None
    end: ops.CudaEvent | None = None
    elapsed_s: float | None = None
    error: str | None = None
    cpu_rows: list[int] | None = None
    gpu_blocks: list[int] | None = None


class CrossDirectionOrder:
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
        """End events of the other direction's in-flight jobs touching ``rows`` or ``blocks``."""
        other = 1 if store else 0
        found: dict[int, ops.CudaEvent] = {}
        for table, ids in ((self._rows[other], rows), (self._blocks[other], blocks)):
            for i in ids:
                event = table.get(i)
                if event is not None:
                    found[id(event)] = event
        return list(found.values())

    def add(self, store: bool, rows: list[int], blocks: list[int], end: ops.CudaEvent) -> None:
        """Record a submitted job of direction ``store`` (ending with ``end``)."""
        mine = 0 if store else 1
        for table, ids in ((self._rows[mine], rows), (self._blocks[mine], blocks)):
            for i in ids:
                table[i] = end

    def remove(self, store: bool, rows: list[int], blocks: list[int], end: ops.CudaEvent) -> None:
        """Forget a reported job (entries a later job took over stay)."""
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

    Not thread-safe: calls must not overlap, but may come from any thread (see the module
    docstring).

    Args:
        planner: plans this direction's jobs.
        store: True for GPU -> CPU, False for CPU -> GPU.
        lib: the CUDA copy library when the KV cache is device memory; None for the torch path.
        device: the KV cache's device ordinal (required with ``lib``).
        method: which CUDA copy path each job takes (``CopyMethodPolicy``: by the job's chunk
            size and direction, or one fixed method).
        kernel_available: whether the CPU memory is pinned and mapped, as the SM-copy kernel
            needs (without it every job takes DMA).
        max_ctas: CUDA kernel path only: most thread blocks (0: library default).
        compute_stream: the model's compute stream on ``device`` (stores wait for it).
        order: the hazard table shared with the other direction's handler.

    Raises:
        ValueError: ``lib`` without a ``device``.
    """

    def __init__(
        self,
        planner: JobPlanner,
        store: bool,
        lib: ops.CudaCopyLibrary | None,
        device: int | None,
        method: ops.CopyMethodPolicy,
        kernel_available: bool,
        max_ctas: int,
        compute_stream: ComputeStreamFn,
        order: CrossDirectionOrder,
    ) -> None:
        if lib is not None and device is None:
            raise ValueError("the CUDA path needs the KV cache's device")
        self._planner = planner
        self._store = store
        self._lib = lib
        self._device = device if device is not None else -1
        self._policy = method
        self._kernel_available = kernel_available
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
    def device(self) -> int | None:
        """The device ordinal jobs run on (None on the torch path)."""
        return self._device if self._lib is not None else None

    @property
    def copy_method(self) -> ops.CopyMethod | None:
        """The fixed CUDA copy method, or None on the torch path or when each job's method is
        chosen by its size (``copy_policy``)."""
        if self._lib is None:
            return None
        return self._policy.choose_fixed(self._kernel_available)

    @property
    def copy_policy(self) -> ops.CopyMethodPolicy:
        """How each job's CUDA copy method is chosen (unused on the torch path)."""
        return self._policy

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
            # The planner checked the job (its templates once, with the real extents; the ids
            # of every job): copy_blocks would only check it again.
            ops.host_copy(plan.regions, plan.src_ids, plan.dst_ids)
            self._queue.append(
                _Transfer(job_id, plan.num_bytes, elapsed_s=time.perf_counter() - t0)
            )
            return True
        self._submit_cuda(
            self._lib, job_id, plan, cpu_spec.block_ids.tolist(), gpu_spec.block_ids.tolist()
        )
        return True

    def _take_event(self, lib: ops.CudaCopyLibrary) -> ops.CudaEvent:
        return self._free_events.pop() if self._free_events else ops.CudaEvent(lib, self._device)

    def _submit_cuda(
        self,
        lib: ops.CudaCopyLibrary,
        job_id: int,
        plan: TransferPlan,
        rows: list[int],
        blocks: list[int],
    ) -> None:
        stream = (
            self._free_streams.pop() if self._free_streams else ops.CudaStream(lib, self._device)
        )
        start = end = None
        try:
            start, end = self._take_event(lib), self._take_event(lib)
            if self._store:
                # Read the KV only after the model's kernels enqueued so far have written it.
                if self._compute_event is None:
                    self._compute_event = ops.CudaEvent(lib, self._device, enable_timing=False)
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
        method = self._policy.choose(
            plan.regions,
            plan.src_ids,
            plan.dst_ids,
            store=self._store,
            kernel_available=self._kernel_available,
        )
        try:
            lib.copy_blocks(
                self._device,
                plan.regions,
                plan.src_ids,
                plan.dst_ids,
                method,
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

    def __repr__(self) -> str:
        path = (
            f"cuda:{self._device}/{self._policy.describe()}" if self._lib is not None else "torch"
        )
        return (
            f"SingleDirectionOffloadingHandler({self.transfer_type[0]}->{self.transfer_type[1]}, "
            f"{path}, pending={len(self._queue)})"
        )
