# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``CPUOffloadingSpec``: single-tier offloading to the CPU (no secondary tiers).

Also the two helpers every spec with a CPU primary tier builds on:

* ``open_shared_region``: the single place that maps a spec to its ``SharedOffloadRegion`` (the
  scheduler side creates or joins it with ``rank=None``, each worker with its rank);
* ``cpu_worker_handlers``: a worker rank's GPU <-> CPU handlers over its slot of every row of that
  region, as ``OffloadingSpec.get_handlers`` returns them.
"""

from __future__ import annotations

from typing_extensions import override

from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.transfer.gpu_worker import CpuGpuOffloadingHandlers
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec, RowLayout, WorkerHandlers
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches


def open_shared_region(spec: OffloadingSpec, rank: int | None) -> SharedOffloadRegion:
    """Create or join the run's shared host region, with the geometry and location of ``spec``.

    The region is named after ``spec.run.instance_id`` and lives in
    ``spec.config.shared_region_dir``; it has ``spec.num_primary_blocks`` rows of one
    ``spec.worker_page_bytes`` slot per worker. Whichever process of the engine instance arrives
    first creates the file; the others join it (see ``SharedOffloadRegion``).

    Args:
        spec: the run's spec.
        rank: None on the scheduler side (which maps and pre-faults the whole region), else the
            worker's rank (which writes only its own slot of each row).

    Returns:
        The region, owned by the caller: it calls ``cleanup()`` once nothing reads or writes the
        memory any more (after unregistering it from the CUDA driver, if it registered it).

    Raises:
        ValueError: ``rank`` is outside ``[0, spec.run.world_size)``, or the region's rows would
            not be ``spec.row_bytes`` long (the spec's ``BLOCK_SIZE_ALIGNMENT`` differs from the
            region's); nothing is left open.
        OSError, TimeoutError: as ``SharedOffloadRegion``.
    """
    region = SharedOffloadRegion(
        instance_id=spec.run.instance_id,
        num_blocks=spec.num_primary_blocks,
        worker_page_bytes=spec.worker_page_bytes,
        num_workers=spec.run.world_size,
        rank=rank,
        directory=spec.config.shared_region_dir,
        join_timeout_s=spec.config.shared_region_join_timeout_s,
        expect_scheduler=spec.SCHEDULER_MAPS_REGION,
    )
    if region.row_bytes != spec.row_bytes:
        region.cleanup()
        raise ValueError(
            f"the shared region's rows are {region.row_bytes} bytes but {type(spec).__name__} "
            f"sized them as {spec.row_bytes} (BLOCK_SIZE_ALIGNMENT {spec.BLOCK_SIZE_ALIGNMENT} "
            f"vs the region's {SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT})"
        )
    return region


def cpu_worker_handlers(
    spec: OffloadingSpec, kv_caches: CanonicalKVCaches, rank: int
) -> WorkerHandlers:
    """Worker ``rank``'s GPU <-> CPU handlers over its slot of every row of the shared region.

    Joins (or creates, if it comes first) the region with ``open_shared_region``, takes one view
    per canonical tensor from the rank's slot (laid out as ``spec.row_layout`` says), and
    registers ``GPU -> CPU`` (stores) and
    ``CPU -> GPU`` (loads). The returned ``close`` shuts the handlers down (again, which is a no-op
    for handlers already shut down; it also unpins the memory) and then cleans this rank's mapping
    of the region up.

    Args:
        spec: the run's spec; its ``block_size_factors`` tell how many GPU blocks an offloaded
            block holds, per group.
        kv_caches: the rank's canonical KV caches (borrowed).
        rank: the worker's rank.

    Raises:
        As ``open_shared_region`` and ``CpuGpuOffloadingHandlers`` (e.g. ``ValueError`` when the
        caches' pages do not fit ``spec.worker_page_bytes``, or per-group rows over caches whose
        groups share a tensor); the region is cleaned up first.
    """
    region = open_shared_region(spec, rank)
    try:
        store_threshold, load_threshold = spec.config.copy_dma_min_chunk_bytes
        policy = ops.CopyMethodPolicy(store_threshold, load_threshold)
        cpu_gpu = CpuGpuOffloadingHandlers(
            kv_caches,
            spec.block_size_factors,
            region=region,
            copy_method=policy,
            per_group_rows=spec.row_layout is RowLayout.PER_GROUP,
        )
    except BaseException:
        region.cleanup()
        raise

    owned = [cpu_gpu]

    def close() -> None:
        try:
            while owned:
                owned.pop().shutdown()
        finally:
            region.cleanup()

    return WorkerHandlers(
        registrations=[
            (GPULoadStoreSpec, CPULoadStoreSpec, cpu_gpu.gpu_to_cpu_handler),
            (CPULoadStoreSpec, GPULoadStoreSpec, cpu_gpu.cpu_to_gpu_handler),
        ],
        close=close,
    )


class SharedRegionOffloadingSpec(OffloadingSpec):
    """Base of the specs whose primary tier is the rows of the run's shared host region.

    It owns the worker side: every rank's handlers copy GPU <-> CPU through the rank's slot of
    every row (``cpu_worker_handlers``), whatever the scheduler side keeps about those rows.
    Subclasses build the scheduler-side manager (``get_manager``).

    Args:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        enable_events: whether the managers record ``OffloadingEvent`` s (KV cache events).
    """

    BLOCK_SIZE_ALIGNMENT = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT

    def __init__(
        self, config: OffloadingConfig, run: KVCacheRunInfo, *, enable_events: bool = False
    ) -> None:
        super().__init__(config, run)
        self.enable_events = enable_events

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        """The rank's GPU <-> CPU handlers over its slot of the shared region (see
        ``cpu_worker_handlers``)."""
        return cpu_worker_handlers(self, kv_caches, rank)


class CPUOffloadingSpec(SharedRegionOffloadingSpec):
    """Offload GPU KV blocks to ``num_primary_blocks`` rows of host memory.

    The scheduler-side manager is a ``CPUOffloadingManager`` with ``config.eviction_policy`` (pure
    bookkeeping: it maps no memory). Each worker's handlers copy through the rank's slot of the
    shared host region (``cpu_worker_handlers``); the first rank to arrive creates the region.

    Args:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        enable_events: whether the manager records ``OffloadingEvent`` s (KV cache events).
    """

    _manager: CPUOffloadingManager | None = None

    @override
    def get_manager(self) -> CPUOffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                self.num_primary_blocks,
                cache_policy=self.config.eviction_policy,
                enable_events=self.enable_events,
                store_threshold=self.config.store_threshold,
                max_tracker_size=self.config.max_tracker_size,
            )
        return self._manager
