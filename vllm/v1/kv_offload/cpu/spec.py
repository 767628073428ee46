"""``CPUOffloadingSpec``: single-tier offloading to the CPU (no secondary tiers)."""

from __future__ import annotations

from typing_extensions import override

from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec


class CPUOffloadingSpec(OffloadingSpec):
    """Offload GPU KV blocks to ``num_primary_blocks`` rows of host memory.

    The scheduler-side manager is a ``CPUOffloadingManager`` with ``config.eviction_policy``.

    Args:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        enable_events: whether the manager records ``OffloadingEvent`` s (KV cache events).
    """

    def __init__(
        self, config: OffloadingConfig, run: KVCacheRunInfo, *, enable_events: bool = False
    ) -> None:
        super().__init__(config, run)
        self.enable_events = enable_events
        self._manager: CPUOffloadingManager | None = None

    @override
    def get_manager(self) -> CPUOffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                self.num_primary_blocks,
                cache_policy=self.config.eviction_policy,
                enable_events=self.enable_events,
            )
        return self._manager
