"""``TieringOffloadingSpec``: a CPU primary tier over a shared host region, plus secondary tiers.

Selected with ``spec_name: "TieringOffloadingSpec"``; the tiers come from ``secondary_tiers``, in
lookup order.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from vllm.v1.kv_offload.config import OffloadingConfig, SecondaryTierConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

logger = logging.getLogger(__name__)


class TieringOffloadingSpec(OffloadingSpec):
    """Builds a ``TieringOffloadingManager``: CPU primary tier + configured secondary tiers.

    The scheduler side creates the shared region (``rank=None``) in ``config.shared_region_dir``,
    named after ``run.instance_id``; workers join the same file with their rank.

    Args:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        enable_events: whether the primary tier records ``OffloadingEvent`` s; also passed as
            ``enable_events=True`` to every tier whose constructor takes that keyword and whose
            config entry does not set it.
    """

    BLOCK_SIZE_ALIGNMENT = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    SCHEDULER_MAPS_REGION = True  # the secondary tiers copy whole rows through it

    def __init__(
        self, config: OffloadingConfig, run: KVCacheRunInfo, *, enable_events: bool = False
    ) -> None:
        super().__init__(config, run)
        self.enable_events = enable_events
        self._manager: TieringOffloadingManager | None = None

    @override
    def get_manager(self) -> TieringOffloadingManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager

    def _with_events(self, tier_config: SecondaryTierConfig) -> Mapping[str, Any]:
        """The tier's config entry, with ``enable_events`` filled in from the spec.

        Events are tier-owned: when the run publishes KV events, every tier whose constructor
        takes ``enable_events`` records its own, unless its config entry says otherwise.
        """
        entry: dict[str, Any] = {"type": tier_config.type, **tier_config.kwargs}
        if self.enable_events and "enable_events" not in entry:
            tier_cls = SecondaryTierFactory.get_tier_class(tier_config.type)
            if "enable_events" in inspect.signature(tier_cls).parameters:
                entry["enable_events"] = True
        return entry

    def _build_manager(self) -> TieringOffloadingManager:
        """Create region, primary and tiers in order; on failure undo in reverse order."""
        region = SharedOffloadRegion(
            instance_id=self.run.instance_id,
            num_blocks=self.num_primary_blocks,
            worker_page_bytes=self.worker_page_bytes,
            num_workers=self.run.world_size,
            rank=None,
            directory=self.config.shared_region_dir,
            join_timeout_s=self.config.shared_region_join_timeout_s,
            expect_scheduler=True,
        )
        try:
            assert region.row_bytes == self.row_bytes, (
                f"shared region rows of {region.row_bytes} bytes, spec expects {self.row_bytes}"
            )
            primary = CPUPrimaryTierOffloadingManager(
                self.num_primary_blocks,
                region,
                cache_policy=self.config.eviction_policy,
                enable_events=self.enable_events,
            )
        except BaseException:
            region.cleanup()
            raise
        tiers: list[SecondaryTierManager] = []
        try:
            view = primary.get_kv_memoryview()
            for tier_idx, tier_config in enumerate(self.config.secondary_tiers):
                tier = SecondaryTierFactory.create_secondary_tier(
                    self._with_events(tier_config), view, self
                )
                tiers.append(tier)
                logger.info("Created secondary tier #%d (%s)", tier_idx, tier_config.type)
            return TieringOffloadingManager(primary, tiers)
        except BaseException:
            for tier in reversed(tiers):
                try:
                    tier.shutdown()
                except Exception:
                    logger.exception("shutting down secondary tier %s failed", tier.tier_type)
            primary.shutdown()
            raise
