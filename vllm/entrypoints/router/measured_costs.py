# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What an instance measured of its own costs, as kv-aware routing scores with them.

An offloading connector with its load guard on (``docs/load_guard.md``) estimates, from its own
steps and loads, what one more prompt token costs a step and what a load costs per block beyond
the step it waits, per tier; it publishes both as gauges in its metrics
(``vllm:kv_offload_load_guard_compute_seconds_per_token``,
``vllm:kv_offload_load_guard_load_seconds_per_block{tier}``). ``from_connector_stats`` turns them
into seconds per token per routing ``Place``, so a router can score each instance with its own
costs (``RoutingCosts.from_seconds``) rather than with defaults. A load from storage goes through
the CPU tier, so its cost per token adds the CPU leg's.

Threading: ``from_connector_stats`` runs on the thread that owns the stats object (the engine
thread's step callback); a ``MeasuredCosts`` is immutable and may be handed to any thread.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.entrypoints.router.policies import RoutingCosts
from vllm.entrypoints.router.prefix_index import Place
from vllm.v1.kv_offload.metrics import PRIMARY_TIER_LABEL

COMPUTE_GAUGE = "vllm:kv_offload_load_guard_compute_seconds_per_token"
"""The load guard's estimate of what one more prompt token adds to a step, in seconds."""
LOAD_GAUGE = "vllm:kv_offload_load_guard_load_seconds_per_block"
"""Per ``tier`` label: the guard's estimate of a load's seconds per block beyond its step."""


@dataclass(frozen=True)
class MeasuredCosts:
    """What an instance measured of its own costs, per token.

    Attributes:
        compute_s_per_token: seconds one more prompt token adds to a step.
        load_s_per_token: per place the instance has loaded from, seconds per token of a load
            beyond its step (every leg: storage -> CPU -> GPU).
    """

    compute_s_per_token: float
    load_s_per_token: Mapping[Place, float]

    def costs(self) -> RoutingCosts:
        """The routing costs these figures give (places not measured keep the defaults)."""
        return RoutingCosts.from_seconds(self.compute_s_per_token, self.load_s_per_token)

    @classmethod
    def from_connector_stats(
        cls,
        stats: OffloadingConnectorStats,
        tokens_per_block: int,
        shared_tier_types: Container[str],
    ) -> MeasuredCosts | None:
        """The figures in one step's connector stats (None: no compute estimate yet, or one
        that is not positive).

        Args:
            stats: the connector's stats of a step (its gauges are levels now).
            tokens_per_block: tokens of an offloaded block.
            shared_tier_types: tier types every instance loads from (the others are local).
        """
        compute = stats.get(COMPUTE_GAUGE)
        if compute is None or compute <= 0:
            return None
        per_block = stats.labelled(LOAD_GAUGE)
        cpu = per_block.get((PRIMARY_TIER_LABEL,))
        load: dict[Place, float] = {}
        if cpu is not None:
            load[Place.CPU] = max(cpu, 0.0) / tokens_per_block
        for labels, seconds in per_block.items():
            if labels == (PRIMARY_TIER_LABEL,) or cpu is None:
                continue
            # Secondary tiers' labels are "<index>:<tier type>" (``tier_label``).
            tier_type = labels[0].partition(":")[2]
            place = Place.SHARED_STORAGE if tier_type in shared_tier_types else Place.LOCAL_STORAGE
            load[place] = (max(seconds, 0.0) + max(cpu, 0.0)) / tokens_per_block
        return cls(compute, load)
