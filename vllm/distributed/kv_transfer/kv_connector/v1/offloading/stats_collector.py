# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``SchedulerStatsCollector``: builds the scheduler side's ``OffloadingConnectorStats``.

Counting stays cheap where it happens: the connector, the managers and the tiers keep plain
cumulative integers (``OffloadingSchedulerMetrics``, the managers' ``get_stats()``,
``TieringStats``, ``TierStats.counters``), and histogram samples are taken once per job, lookup
call or step, never per key. Once per step ``collect`` turns all of it into one
``OffloadingConnectorStats``: counters as the increments since the previous ``collect``, gauges
as their current level, histograms as the samples taken since. The workers' stats received in
between (``add_worker_stats``) are folded in.

Metric names are those of ``metric_catalog``; which source feeds which metric is listed in
``docs/metrics.md``.
"""

from __future__ import annotations

import functools
import time

from typing_extensions import override

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.load_guard import CPU_TIER, LoadGuard
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    MAX_PENDING_SAMPLES,
    OffloadingConnectorStats,
    OffloadingSchedulerMetrics,
)
from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.metrics import (
    PRIMARY_TIER_LABEL,
    CounterSet,
    MetricsRecorder,
    tier_label,
)
from vllm.v1.kv_offload.spec import OffloadingSpec

_GPU_TO_CPU = ("GPU_to_CPU",)
_CPU_TO_GPU = ("CPU_to_GPU",)
_PRIMARY = (PRIMARY_TIER_LABEL,)
_MAX_UNMERGED = 64

# Metric names (see metric_catalog for their meaning).
TRANSFER_JOBS = "vllm:kv_offload_transfer_jobs"
TRANSFER_BLOCKS = "vllm:kv_offload_transfer_blocks"
TRANSFER_BYTES = "vllm:kv_offload_transfer_bytes"
TRANSFER_FAILED_BLOCKS = "vllm:kv_offload_transfer_failed_blocks"
TRANSFER_FAILED_JOBS = "vllm:kv_offload_transfer_failed_jobs"
TRANSFER_LATENCY = "vllm:kv_offload_transfer_latency_seconds"
TRANSFER_SIZE = "vllm:kv_offload_transfer_size_bytes"
SCHEDULER_STEP_SECONDS = "vllm:kv_offload_scheduler_step_seconds"
SCHEDULER_STEP_CPU_SECONDS = "vllm:kv_offload_scheduler_step_cpu_seconds"

# The connector's own counters, in the order ``collect`` reports their totals.
_CONNECTOR_COUNTERS: CounterSet = (
    (TRANSFER_BLOCKS, _GPU_TO_CPU),
    (TRANSFER_BLOCKS, _CPU_TO_GPU),
    (TRANSFER_FAILED_BLOCKS, _GPU_TO_CPU),
    (TRANSFER_FAILED_BLOCKS, _CPU_TO_GPU),
    (TRANSFER_FAILED_JOBS, _GPU_TO_CPU),
    (TRANSFER_FAILED_JOBS, _CPU_TO_GPU),
    ("vllm:kv_offload_allocation_failure", ()),
    ("vllm:kv_offload_flushed_jobs", ()),
    ("vllm:kv_offload_lookup_deferrals", ()),
)
# The CPU tier's counters from the manager's get_stats(), in the order _collect_primary
# reports them.
_PRIMARY_COUNTERS: CounterSet = (
    ("vllm:kv_offload_tiering_chunk_queries", _PRIMARY),
    ("vllm:kv_offload_tiering_chunk_hits", _PRIMARY),
    ("vllm:kv_offload_tier_evicted_blocks", _PRIMARY),
    ("vllm:kv_offload_stores_skipped", ()),
)


@functools.cache
def _guard_counters(labels: tuple[str, ...]) -> CounterSet:
    """The load guard's counters of the tier labelled ``labels``."""
    return (
        ("vllm:kv_offload_load_guard_skipped_hits", labels),
        ("vllm:kv_offload_load_guard_skipped_tokens", labels),
        ("vllm:kv_offload_load_guard_probes", labels),
    )


class SchedulerStatsCollector:
    """Per-step stats of one scheduler-side connector (scheduler thread only).

    Args:
        spec: the offloading spec (``row_bytes`` sizes the primary tier's blocks).
        manager: the connector's manager: its ``get_stats()`` keys feed the CPU tier's metrics,
            and its ``report_metrics`` anything more (a tiering manager: every secondary tier).
        metrics: the connector's cumulative counters.
        load_guard: the connector's load guard (None: off); its decisions and estimates.
    """

    def __init__(
        self,
        spec: OffloadingSpec,
        manager: OffloadingManager,
        metrics: OffloadingSchedulerMetrics,
        load_guard: LoadGuard | None = None,
    ) -> None:
        self._manager = manager
        self._metrics = metrics
        self._load_guard = load_guard
        # The guard's tier names (CPU_TIER, secondary tier types) -> the metrics' tier labels;
        # a type that several tiers share takes the first one's.
        self._guard_labels: dict[str, tuple[str, ...]] = {CPU_TIER: _PRIMARY}
        for i, tier in enumerate(getattr(manager, "secondary_tiers", ())):
            self._guard_labels.setdefault(tier.tier_type, (tier_label(i, tier.tier_type),))
        self._row_bytes: int = spec.row_bytes
        self._pending = OffloadingConnectorStats()
        self._worker_stats: list[OffloadingConnectorStats] = []
        # Counters reported together -> their cumulative totals already emitted as increments.
        self._emitted: dict[CounterSet, tuple[float, ...]] = {}
        self._lookup_seconds: list[float] = []
        # req_id -> (deferred lookups so far, perf_counter() of the first one).
        self._waits: dict[str, tuple[int, float]] = {}

    # -----------------------------------------------------------------------------------------
    # Inputs between two collections
    # -----------------------------------------------------------------------------------------

    def add_worker_stats(self, stats: KVConnectorStats) -> None:
        """Fold in the workers' stats of one step (already aggregated over ranks)."""
        assert isinstance(stats, OffloadingConnectorStats), (
            f"unexpected connector stats {type(stats).__name__}"
        )
        # Merged at collection, off update_connector_output's path (folded early only when
        # nobody collects, to bound memory).
        self._worker_stats.append(stats)
        if len(self._worker_stats) >= _MAX_UNMERGED:
            for step in self._worker_stats:
                self._pending.aggregate(step)
            self._worker_stats = []

    def on_lookup(self, req_id: str, deferred: bool, seconds: float) -> None:
        """One ``get_num_new_matched_tokens`` call took ``seconds``; ``deferred``: it answered
        "ask again next step". A request's wait ends with its first non-deferred answer."""
        if len(self._lookup_seconds) < MAX_PENDING_SAMPLES:
            self._lookup_seconds.append(seconds)
        if deferred:
            wait = self._waits.get(req_id)
            self._waits[req_id] = (
                (1, time.perf_counter()) if wait is None else (wait[0] + 1, wait[1])
            )
        elif self._waits:
            self._end_wait(req_id)

    def on_request_finished(self, req_id: str) -> None:
        """The request finished; a wait still open ends here (upstream's async delay does too)."""
        if self._waits:
            self._end_wait(req_id)

    def _end_wait(self, req_id: str) -> None:
        wait = self._waits.pop(req_id, None)
        if wait is not None:
            steps, start = wait
            self._pending.observe_histogram("vllm:kv_offload_lookup_wait_steps", steps)
            self._pending.observe_histogram(
                "vllm:kv_offload_lookup_async_delay_seconds", time.perf_counter() - start
            )

    def observe_step(self, wall_seconds: float, cpu_seconds: float) -> None:
        """The whole scheduler-side connector took ``wall_seconds`` in one engine step, of which
        ``cpu_seconds`` on the engine thread's CPU (the engine measures both around every
        connector call)."""
        self._pending.observe_histogram(SCHEDULER_STEP_SECONDS, wall_seconds)
        self._pending.observe_histogram(SCHEDULER_STEP_CPU_SECONDS, cpu_seconds)

    # -----------------------------------------------------------------------------------------
    # Collection
    # -----------------------------------------------------------------------------------------

    def _count_all(
        self, stats: OffloadingConnectorStats, counters: CounterSet, totals: tuple[float, ...]
    ) -> None:
        """Emit the increase of each of ``counters`` since the last call for the same
        ``counters`` (the matching element of cumulative ``totals``); nothing when no total
        moved (most steps). A total that went down was reset (``reset_cache`` zeroes the
        managers' counters): it counts from zero."""
        last = self._emitted.get(counters)
        if last == totals:
            return
        self._emitted[counters] = totals
        if last is None:
            last = (0,) * len(totals)
        for (name, labels), total, previous in zip(counters, totals, last, strict=True):
            if total != previous:
                delta = total - previous if total > previous else total  # lower: a reset
                if delta:
                    stats.increase_counter(name, delta, labels)

    def collect(self, jobs_in_flight: int) -> OffloadingConnectorStats | None:
        """Everything since the previous call, as one stats object. It always holds the gauges
        (levels now), so the None of vLLM's interface is never returned here."""
        stats, self._pending = self._pending, OffloadingConnectorStats()
        worker_stats, self._worker_stats = self._worker_stats, []
        for step in worker_stats:
            stats.aggregate(step)
        m = self._metrics
        self._count_all(
            stats,
            _CONNECTOR_COUNTERS,
            (
                m.stored_blocks,
                m.loaded_blocks,
                m.failed_store_blocks,
                m.failed_load_blocks,
                m.failed_store_jobs,
                m.failed_load_jobs,
                m.deferred_stores,
                m.flushed_jobs,
                m.deferred_lookups,
            ),
        )
        samples, m.schedule_end_seconds = m.schedule_end_seconds, []
        stats.observe_many("vllm:kv_offload_schedule_end_seconds", samples)
        samples, self._lookup_seconds = self._lookup_seconds, []
        stats.observe_many("vllm:kv_offload_lookup_sync_delay_seconds", samples)
        stats.set_gauge("vllm:kv_offload_jobs_in_flight", jobs_in_flight)
        self._collect_primary(stats)
        if self._load_guard is not None:
            self._collect_load_guard(stats, self._load_guard)
        self._manager.report_metrics(_Recorder(self, stats))
        return None if stats.is_empty() else stats

    def _collect_load_guard(self, stats: OffloadingConnectorStats, guard: LoadGuard) -> None:
        """The load guard's decisions per tier, and its estimates (gauges, where measured)."""
        stats.set_gauge("vllm:kv_offload_load_guard_step_seconds", guard.step_overhead_s())
        per_token = guard.compute_s(1)
        if per_token is not None:
            stats.set_gauge("vllm:kv_offload_load_guard_compute_seconds_per_token", per_token)
        for tier, tier_stats in guard.stats.items():
            self._count_all(
                stats,
                _guard_counters(self._guard_labels.get(tier, (tier,))),
                (tier_stats.skipped_hits, tier_stats.skipped_tokens, tier_stats.probes),
            )
        for tier, fit in guard.loads.items():
            params = fit.params()
            if params is None:
                continue
            labels = self._guard_labels.get(tier, (tier,))
            stats.set_gauge("vllm:kv_offload_load_guard_load_latency_seconds", params[0], labels)
            stats.set_gauge("vllm:kv_offload_load_guard_load_seconds_per_block", params[1], labels)

    def _collect_primary(self, stats: OffloadingConnectorStats) -> None:
        """The CPU (primary) tier, from the manager's ``get_stats()`` keys, where present."""
        ms = self._manager.get_stats() or {}
        # A key the manager does not keep counts as zero: it emits nothing.
        get = ms.get
        hits = get("hits", 0)
        self._count_all(
            stats,
            _PRIMARY_COUNTERS,
            (hits + get("misses", 0), hits, get("evictions", 0), get("stores_skipped", 0)),
        )
        if "num_blocks" in ms and "used_blocks" in ms:
            total, used = ms["num_blocks"], ms["used_blocks"]
            stats.set_gauge("vllm:kv_offload_tier_used_blocks", used, _PRIMARY)
            stats.set_gauge("vllm:kv_offload_tier_used_bytes", used * self._row_bytes, _PRIMARY)
            stats.set_gauge("vllm:kv_offload_tier_capacity_blocks", total, _PRIMARY)
            stats.set_gauge(
                "vllm:kv_offload_tier_capacity_bytes", total * self._row_bytes, _PRIMARY
            )
            stats.set_gauge("vllm:kv_offload_cpu_cache_usage_perc", used / total if total else 0.0)


class _Recorder(MetricsRecorder):
    """The ``MetricsRecorder`` a manager reports to during one ``collect``."""

    def __init__(self, collector: SchedulerStatsCollector, stats: OffloadingConnectorStats) -> None:
        self._collector = collector
        self._stats = stats

    @override
    def counter_total(self, name: str, total: float, labels: tuple[str, ...] = ()) -> None:
        self._collector._count_all(self._stats, ((name, labels),), (total,))

    @override
    def counter_totals(self, counters: CounterSet, totals: tuple[float, ...]) -> None:
        self._collector._count_all(self._stats, counters, totals)

    @override
    def count(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        if value:
            self._stats.increase_counter(name, value, labels)

    @override
    def gauge(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self._stats.set_gauge(name, value, labels)

    @override
    def observe(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        self._stats.observe_histogram(name, value, labels)
