# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""How managers and tiers report metrics without knowing who collects them.

The connector's stats collector hands each manager a ``MetricsRecorder`` once per step
(``OffloadingManager.report_metrics``); the manager reports what it keeps (cumulative totals,
levels, samples taken per job) under the metric names of the connector's catalogue
(``metric_catalog``, documented in ``docs/metrics.md``). This module only names the interface and
the shared label spelling, so that medium-specific code never imports the connector.
"""

from __future__ import annotations

from typing import Protocol

from vllm.v1.kv_offload.base import TierStats

PRIMARY_TIER_LABEL = "0:primary"
"""The ``tier`` label of the CPU tier (upstream's spelling for the tiering primary)."""


def tier_label(tier_idx: int, tier_type: str) -> str:
    """The ``tier`` label of secondary tier ``tier_idx`` (0-based) of type ``tier_type``."""
    return f"{tier_idx + 1}:{tier_type}"


class MetricsRecorder(Protocol):
    """Where a manager reports its metrics during one collection."""

    def counter_total(self, name: str, total: float, labels: tuple[str, ...] = ()) -> None:
        """Counter ``name`` has reached the cumulative ``total`` (the recorder derives the
        increase; a total that went down counts as reset to zero)."""

    def count(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Counter ``name`` grew by ``value`` since the last collection."""

    def gauge(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Gauge ``name`` is at ``value`` now."""

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """One observation (a job, a call, a step) of histogram ``name``."""


def report_tier_stats(recorder: MetricsRecorder, label: str, report: TierStats) -> None:
    """Report a secondary tier's ``TierStats``: occupancy and capacity, and the counters it keeps
    under the fs tier's names (``blocks_written``, ``blocks_loaded``, ``store_failures``,
    ``load_failures``, ``corrupt_removed``, ``blocks_evicted``, ``blocks_skipped``,
    ``store_busy_us``, ``load_busy_us``); absent counters are not reported."""
    tier = (label,)
    recorder.gauge("vllm:kv_offload_tier_used_blocks", report.num_blocks, tier)
    recorder.gauge("vllm:kv_offload_tier_used_bytes", report.used_bytes, tier)
    if report.capacity_bytes is not None:
        recorder.gauge("vllm:kv_offload_tier_capacity_bytes", report.capacity_bytes, tier)
        if report.block_bytes:
            blocks = report.capacity_bytes // report.block_bytes
            recorder.gauge("vllm:kv_offload_tier_capacity_blocks", blocks, tier)
    c = report.counters
    cascade, promote = (f"CPU_to_{report.tier_type}",), (f"{report.tier_type}_to_CPU",)
    size = report.block_bytes
    total = recorder.counter_total
    for key, direction, moved_bytes in (
        ("blocks_written", cascade, "vllm:kv_offload_tiering_write_bytes"),
        ("blocks_loaded", promote, "vllm:kv_offload_tiering_read_bytes"),
    ):
        if key in c:
            total("vllm:kv_offload_transfer_blocks", c[key], direction)
            total("vllm:kv_offload_transfer_bytes", c[key] * size, direction)
            total(moved_bytes, c[key] * size, tier)
    corrupt = c.get("corrupt_removed", 0)
    total("vllm:kv_offload_transfer_failed_blocks", c.get("store_failures", 0), cascade)
    total("vllm:kv_offload_transfer_failed_blocks", c.get("load_failures", 0) + corrupt, promote)
    total("vllm:kv_offload_tier_corrupt_blocks", corrupt, tier)
    total("vllm:kv_offload_tier_evicted_blocks", c.get("blocks_evicted", 0), tier)
    total("vllm:kv_offload_tier_skipped_blocks", c.get("blocks_skipped", 0), tier)
    if "store_busy_us" in c:
        total("vllm:kv_offload_tiering_write_time", c["store_busy_us"] / 1e6, tier)
    if "load_busy_us" in c:
        total("vllm:kv_offload_tiering_read_time", c["load_busy_us"] / 1e6, tier)
