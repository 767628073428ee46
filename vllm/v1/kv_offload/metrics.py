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

import functools
from typing import Protocol, TypeAlias

from vllm.v1.kv_offload.base import TierStats

CounterSet: TypeAlias = tuple[tuple[str, tuple[str, ...]], ...]
"""Counters reported together (``MetricsRecorder.counter_totals``): each one's name and label
values. Build one once per source (it is compared and hashed by value) and keep its order."""

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

    def counter_totals(self, counters: CounterSet, totals: tuple[float, ...]) -> None:
        """``counter_total`` of each of ``counters`` at the matching element of ``totals``, in
        one call. Most steps move few of a source's counters: the recorder compares the whole
        tuple with what the same ``counters`` reported last and skips the lot when nothing
        moved, where one ``counter_total`` per counter would cost a call each. Each set is
        diffed on its own: two sources may report their own totals of one counter in their
        own sets (two tiers of one type: ``CPU_to_fs`` blocks), and the increments add up."""

    def count(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Counter ``name`` grew by ``value`` since the last collection."""

    def gauge(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Gauge ``name`` is at ``value`` now."""

    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """One observation (a job, a call, a step) of histogram ``name``."""


@functools.cache
def _tier_counters(label: str, tier_type: str) -> CounterSet:
    """The counters ``report_tier_stats`` reports for one tier, in the order of its totals."""
    tier = (label,)
    cascade, promote = (f"CPU_to_{tier_type}",), (f"{tier_type}_to_CPU",)
    return (
        ("vllm:kv_offload_transfer_blocks", cascade),
        ("vllm:kv_offload_transfer_bytes", cascade),
        ("vllm:kv_offload_tiering_write_bytes", tier),
        ("vllm:kv_offload_transfer_blocks", promote),
        ("vllm:kv_offload_transfer_bytes", promote),
        ("vllm:kv_offload_tiering_read_bytes", tier),
        ("vllm:kv_offload_transfer_failed_blocks", cascade),
        ("vllm:kv_offload_transfer_failed_blocks", promote),
        ("vllm:kv_offload_tier_corrupt_blocks", tier),
        ("vllm:kv_offload_tier_evicted_blocks", tier),
        ("vllm:kv_offload_tier_skipped_blocks", tier),
        ("vllm:kv_offload_tiering_write_time", tier),
        ("vllm:kv_offload_tiering_read_time", tier),
    )


def report_tier_stats(recorder: MetricsRecorder, label: str, report: TierStats) -> None:
    """Report a secondary tier's ``TierStats``: occupancy and capacity, and the counters it keeps
    under the fs tier's names (``blocks_written``, ``blocks_loaded``, ``store_failures``,
    ``load_failures``, ``corrupt_removed``, ``blocks_evicted``, ``blocks_skipped``,
    ``store_busy_us``, ``load_busy_us``). An absent counter is reported as zero, which emits
    nothing (a counter appears once it grows)."""
    tier = (label,)
    recorder.gauge("vllm:kv_offload_tier_used_blocks", report.num_blocks, tier)
    recorder.gauge("vllm:kv_offload_tier_used_bytes", report.used_bytes, tier)
    if report.capacity_bytes is not None:
        recorder.gauge("vllm:kv_offload_tier_capacity_bytes", report.capacity_bytes, tier)
        if report.block_bytes:
            blocks = report.capacity_bytes // report.block_bytes
            recorder.gauge("vllm:kv_offload_tier_capacity_blocks", blocks, tier)
    get = report.counters.get
    size = report.block_bytes
    written = get("blocks_written", 0)
    loaded = get("blocks_loaded", 0)
    corrupt = get("corrupt_removed", 0)
    recorder.counter_totals(
        _tier_counters(label, report.tier_type),
        (
            written,
            written * size,
            written * size,
            loaded,
            loaded * size,
            loaded * size,
            get("store_failures", 0),
            get("load_failures", 0) + corrupt,
            corrupt,
            get("blocks_evicted", 0),
            get("blocks_skipped", 0),
            get("store_busy_us", 0) / 1e6,
            get("load_busy_us", 0) / 1e6,
        ),
    )
