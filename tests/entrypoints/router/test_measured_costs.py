# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What an instance measured of its own costs, read from its connector's published gauges."""

from __future__ import annotations

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.entrypoints.router.measured_costs import COMPUTE_GAUGE, LOAD_GAUGE, MeasuredCosts
from vllm.entrypoints.router.prefix_index import Place
from vllm.v1.kv_offload.metrics import PRIMARY_TIER_LABEL, tier_label


def _stats(compute: float | None, per_block: dict[str, float]) -> OffloadingConnectorStats:
    stats = OffloadingConnectorStats()
    if compute is not None:
        stats.set_gauge(COMPUTE_GAUGE, compute)
    for label, seconds in per_block.items():
        stats.set_gauge(LOAD_GAUGE, seconds, (label,))
    return stats


def test_storage_loads_add_the_cpu_leg_per_token() -> None:
    stats = _stats(
        2e-4,
        {PRIMARY_TIER_LABEL: 1.6e-4, tier_label(0, "fs"): 1.6e-3, tier_label(1, "redis"): 3.2e-3},
    )
    measured = MeasuredCosts.from_connector_stats(stats, 16, ("redis",))
    assert measured is not None
    assert measured.compute_s_per_token == 2e-4
    assert measured.load_s_per_token[Place.CPU] == pytest.approx(1e-5)
    assert measured.load_s_per_token[Place.LOCAL_STORAGE] == pytest.approx(1.1e-4)
    assert measured.load_s_per_token[Place.SHARED_STORAGE] == pytest.approx(2.1e-4)
    costs = measured.costs()
    assert costs.load_cost[Place.LOCAL_STORAGE] == pytest.approx(0.55)
    assert costs.load_cost[Place.GPU] == 0.0


def test_nothing_without_a_compute_estimate_and_no_storage_without_the_cpu_leg() -> None:
    assert MeasuredCosts.from_connector_stats(_stats(None, {}), 16, ()) is None
    assert MeasuredCosts.from_connector_stats(_stats(0.0, {}), 16, ()) is None
    only_fs = MeasuredCosts.from_connector_stats(_stats(1e-4, {tier_label(0, "fs"): 1e-3}), 16, ())
    assert only_fs == MeasuredCosts(1e-4, {})
    # A negative fit (the guard's line through noisy loads) counts as free, not as a gain.
    negative = MeasuredCosts.from_connector_stats(_stats(1e-4, {PRIMARY_TIER_LABEL: -1e-5}), 16, ())
    assert negative == MeasuredCosts(1e-4, {Place.CPU: 0.0})
