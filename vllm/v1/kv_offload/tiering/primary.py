# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The CPU primary tier of a tiering manager: the only tier that exchanges blocks with the GPU.

``CPUPrimaryTierOffloadingManager`` is the CPU tier (``CPUOffloadingManager``) over the
scheduler-side shared host region. Secondary tiers never see the GPU: they read and write the
primary's rows through the memoryview it lends them (``get_kv_memoryview()``), under the pins and
reservations the tiering manager takes with ``prepare_read`` / ``reserve_rows``.
"""

from __future__ import annotations

from collections.abc import Collection

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.reuse_filter import DEFAULT_MAX_TRACKER_SIZE
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU tier over the shared host region, as the primary tier of a tiering manager.

    Adds read/write aliases so that secondary-tier code paths read right: "load/store" is the
    GPU <-> CPU direction, "read/write" a secondary tier accessing primary rows.

    Ownership: the manager owns ``mmap_region`` from construction on and cleans it up in
    ``shutdown()``. The memoryview returned by ``get_kv_memoryview()`` is lent to secondary tiers,
    which must stop using it (and drop arrays made from it) in their own ``shutdown()``, which the
    tiering manager calls first.
    """

    def __init__(
        self,
        num_blocks: int,
        mmap_region: SharedOffloadRegion,
        cache_policy: str = "lru",
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    ) -> None:
        """Create the primary tier.

        Args:
            num_blocks: rows of the region (must equal ``mmap_region.num_blocks``).
            mmap_region: the scheduler-side shared region (required: tiers copy through it).
            cache_policy: eviction policy name.
            enable_events: record ``OffloadingEvent`` s (medium ``"CPU"``).
            store_threshold, max_tracker_size: the reuse filter of GPU -> CPU stores (see
                ``CPUOffloadingManager``); promotions (``reserve_rows``) are never filtered.

        Raises:
            ValueError: ``num_blocks`` disagrees with the region.
        """
        if num_blocks != mmap_region.num_blocks:
            raise ValueError(
                f"num_blocks={num_blocks} but the shared region has {mmap_region.num_blocks} rows"
            )
        super().__init__(
            num_blocks,
            cache_policy=cache_policy,
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
        )
        self._mmap_region = mmap_region
        # Shape (num_blocks, row_bytes), format "B": row b holds every worker's slice of block b.
        self._kv_memoryview: memoryview | None = mmap_region.create_kv_memoryview()

    def get_kv_memoryview(self) -> memoryview:
        """The primary rows: format ``"B"``, shape ``(num_blocks, row_bytes)``, C-contiguous.

        Valid until ``shutdown()``.
        """
        if self._kv_memoryview is None:
            raise RuntimeError("the primary tier is shut down")
        return self._kv_memoryview

    def prepare_read(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        """Pin ready blocks ``keys`` (ref_cnt += 1 each) so a tier can read their rows.

        Same as ``prepare_load``; release with ``complete_read``.
        """
        return self.prepare_load(keys, req_context)

    def complete_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Unpin blocks pinned by ``prepare_read``. Same as ``complete_load``."""
        self.complete_load(keys, req_context)

    def complete_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Make promoted rows readable (``success``) or free them. Same as ``complete_store``."""
        self.complete_store(keys, req_context, success)

    @override
    def shutdown(self) -> None:
        """Release the memoryview and clean up the shared region (idempotent)."""
        super().shutdown()
        self._kv_memoryview = None
        self._mmap_region.cleanup()
