# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``TieringOffloadingSpec``: a CPU primary tier over a shared host region, plus secondary tiers.

Selected with ``spec_name: "TieringOffloadingSpec"``; the tiers come from ``secondary_tiers``, in
lookup order.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any

from typing_extensions import override

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import TierStats
from vllm.v1.kv_offload.config import SecondaryTierConfig
from vllm.v1.kv_offload.cpu.spec import SharedRegionOffloadingSpec, open_shared_region
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

logger = init_logger(__name__)


class TieringOffloadingSpec(SharedRegionOffloadingSpec):
    """Builds a ``TieringOffloadingManager``: CPU primary tier + configured secondary tiers.

    The scheduler side creates the shared region (``rank=None``) in ``config.shared_region_dir``,
    named after ``run.instance_id``, and hands it to the primary tier, which owns it (cleans it
    up at shutdown); workers join the same file with their rank (``get_handlers``, the same
    GPU <-> CPU handlers as ``CPUOffloadingSpec``). Secondary tiers never touch GPU memory, so
    they have no worker side.

    Args:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        enable_events: whether the primary tier records ``OffloadingEvent`` s; also passed as
            ``enable_events=True`` to every tier whose constructor takes that keyword and whose
            config entry does not set it.
    """

    _manager: TieringOffloadingManager | None = None
    SCHEDULER_MAPS_REGION = True  # the secondary tiers copy whole rows through it

    @override
    def get_manager(self) -> TieringOffloadingManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager

    def _secondary_tiers(self) -> tuple[SecondaryTierManager, ...]:
        return () if self._manager is None else self._manager.secondary_tiers

    @override
    def get_tier_stats(self) -> list[TierStats]:
        reports = (tier.get_stats() for tier in self._secondary_tiers())
        return [report for report in reports if report is not None]

    @override
    def wait_for_tiers_ready(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for tier in self._secondary_tiers():
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not tier.wait_until_ready(left):
                return False
        return True

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
        region = open_shared_region(self, rank=None)
        try:
            primary = CPUPrimaryTierOffloadingManager(
                self.num_primary_blocks,
                region,
                cache_policy=self.config.eviction_policy,
                enable_events=self.enable_events,
                store_threshold=self.config.store_threshold,
                max_tracker_size=self.config.max_tracker_size,
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
