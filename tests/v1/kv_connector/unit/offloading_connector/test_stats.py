# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingConnectorStats``: msgspec round trips, aggregation over ranks, and what the
connector's ``get_kv_connector_stats()`` reports through a real engine run (TP=2, CPU and fs
tiers), cross-checked against the connector's own counters."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from tests.v1.kv_connector.unit.offloading_connector.utils import (
    Chaos,
    chaos_factory,
    make_config,
    run_multi_turn,
    with_handlers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metric_catalog import BY_NAME
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
    OffloadingSchedulerMetrics,
    record_worker_transfer,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.stats_collector import (
    SchedulerStatsCollector,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.metrics import CounterSet, MetricsRecorder
from vllm.v1.outputs import KVConnectorOutput

_DIRECTIONS = [("GPU", "CPU"), ("CPU", "GPU")]


def _round_trip(stats: OffloadingConnectorStats) -> OffloadingConnectorStats:
    """Through msgpack as worker -> scheduler IPC would carry it, rebuilt from ``data`` alone."""
    wire = msgspec.msgpack.encode(stats.data)
    return OffloadingConnectorStats(data=msgspec.msgpack.decode(wire))


def _worker_stats(rng: random.Random, n_jobs: int) -> OffloadingConnectorStats:
    stats = OffloadingConnectorStats()
    for _ in range(n_jobs):
        record_worker_transfer(
            stats, rng.choice(_DIRECTIONS), rng.randrange(1, 1 << 20), rng.random() / 100
        )
    stats.set_gauge("vllm:kv_offload_jobs_in_flight", rng.randrange(10))
    return stats


def test_msgspec_round_trip_keeps_every_value_and_label() -> None:
    stats = _worker_stats(random.Random(0), 7)
    stats.increase_counter("vllm:kv_offload_tier_evicted_blocks", 3, ("1:fs",))
    back = _round_trip(stats)
    assert back.data == stats.data
    assert back.items() == stats.items()
    assert back.reduce() == stats.reduce()
    # Also inside the worker's output as a whole, the way the engine hands it over.
    out = KVConnectorOutput(kv_connector_stats=stats)
    assert not out.is_empty()


def test_aggregate_across_two_workers_equals_the_sum() -> None:
    rng = random.Random(1)
    rank0, rank1 = _worker_stats(rng, 5), _worker_stats(rng, 9)
    expected0, expected1 = rank0.reduce(), rank1.reduce()
    samples0 = {k: list(v) for k, v in rank0.data["data"]["vllm:kv_offload_store_size"].items()}
    total = _round_trip(rank0).aggregate(_round_trip(rank1))

    reduced = total.reduce()
    for name, kind in total.types().items():
        metric = BY_NAME[name]
        assert metric.type is kind
    for key in set(expected0) | set(expected1):
        if "jobs_in_flight" in key:
            # A gauge: the later report wins.
            assert reduced[key] == expected1[key]
        else:
            assert reduced[key] == pytest.approx(expected0.get(key, 0) + expected1.get(key, 0))
    # Histograms keep every observation of both ranks, rank 0's first.
    store_sizes = total.get("vllm:kv_offload_store_size")
    assert store_sizes[: len(samples0[()])] == samples0[()]
    assert len(store_sizes) == expected0.get("vllm:kv_offload_store_size_count", 0) + expected1.get(
        "vllm:kv_offload_store_size_count", 0
    )


def test_clone_and_reset_hands_out_everything_once() -> None:
    stats = _worker_stats(random.Random(2), 3)
    before = stats.reduce()
    clone = stats.clone_and_reset()
    assert clone.reduce() == before
    assert stats.is_empty() and not clone.is_empty()
    stats.increase_counter("vllm:kv_offload_flushed_jobs", 1)
    assert clone.get("vllm:kv_offload_flushed_jobs") is None


def test_reduce_names_labels_and_histogram_summaries() -> None:
    stats = OffloadingConnectorStats()
    stats.observe_histogram("vllm:kv_offload_transfer_latency_seconds", 0.5, ("CPU_to_fs",))
    stats.observe_histogram("vllm:kv_offload_transfer_latency_seconds", 1.5, ("CPU_to_fs",))
    stats.increase_counter("vllm:kv_offload_load_bytes", 10)
    assert stats.reduce() == {
        'vllm:kv_offload_transfer_latency_seconds_count{transfer_type="CPU_to_fs"}': 2,
        'vllm:kv_offload_transfer_latency_seconds_sum{transfer_type="CPU_to_fs"}': 2.0,
        "vllm:kv_offload_load_bytes": 10,
    }


def test_a_name_cannot_change_type() -> None:
    a, b = OffloadingConnectorStats(), OffloadingConnectorStats()
    a.increase_counter("x", 1)
    b.set_gauge("x", 1)
    with pytest.raises(AssertionError, match="counter"):
        a.aggregate(b)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_run_stats_match_the_connector_counters(
    tmp_path: Path, async_scheduling: bool
) -> None:
    """Two worker ranks, CPU and fs tiers: the sum of every step's stats equals the connector's
    cumulative counters; the workers' bytes arrive summed over ranks. With async scheduling
    too (the last step in flight is applied, and its stats collected, by an extra step)."""
    collected: list[OffloadingConnectorStats] = []
    config = make_config(
        tmp_path,
        cpu_blocks=16,
        fs=True,
        tensor_parallel_size=2,
        num_gpu_blocks=24,
        async_scheduling=async_scheduling,
    )
    with EngineCore(config) as engine:
        engine.kv_connector_stats_sink = collected.append
        run_multi_turn(engine, num_sessions=6, turns=3)
        assert not engine.has_pending_work()
        counters = engine.connector_stats()
        tiers = engine.tier_stats()
    total = OffloadingConnectorStats()
    for step in collected:
        total.aggregate(_round_trip(step))
    r = total.reduce()

    def get(name: str) -> float:
        return r.get(name, 0)

    gpu_to_cpu = 'vllm:kv_offload_transfer_{}{{transfer_type="GPU_to_CPU"}}'
    cpu_to_gpu = 'vllm:kv_offload_transfer_{}{{transfer_type="CPU_to_GPU"}}'
    assert get(gpu_to_cpu.format("blocks")) == counters["store_blocks"] > 0
    assert get(cpu_to_gpu.format("blocks")) == counters["load_blocks"] > 0
    assert get(gpu_to_cpu.format("bytes")) == counters["transfer.GPU_to_CPU.bytes"]
    assert get("vllm:kv_offload_store_bytes") == counters["transfer.GPU_to_CPU.bytes"]
    assert get("vllm:kv_offload_load_bytes") == counters["transfer.CPU_to_GPU.bytes"]
    # One job observation per job and rank.
    assert get(gpu_to_cpu.format("jobs")) == 2 * counters["store_jobs"]
    assert get("vllm:kv_offload_store_size_count") == 2 * counters["store_jobs"]
    (fs,) = tiers
    written = fs.counters["blocks_written"]
    assert get('vllm:kv_offload_transfer_blocks{transfer_type="CPU_to_fs"}') == written > 0
    assert get('vllm:kv_offload_tiering_write_bytes{tier="1:fs"}') == written * fs.block_bytes
    assert (
        get('vllm:kv_offload_tiering_cascade_jobs{tier="1:fs"}')
        == counters["manager.tiering_cascades_submitted"]
    )
    assert get('vllm:kv_offload_tiering_chunk_hits{tier="0:primary"}') == counters["manager.hits"]
    # Every primary miss asks the fs tier (its only secondary tier).
    misses = counters["manager.misses"]
    assert get('vllm:kv_offload_tiering_chunk_queries{tier="0:primary"}') == (
        counters["manager.hits"] + misses
    )
    assert get('vllm:kv_offload_tiering_chunk_queries{tier="1:fs"}') == misses > 0
    assert 0 < get('vllm:kv_offload_tiering_chunk_hits{tier="1:fs"}') <= misses
    assert get("vllm:kv_offload_schedule_end_seconds_count") == counters["schedule_ends"]
    assert get("vllm:kv_offload_jobs_in_flight") == 0
    assert (
        get('vllm:kv_offload_transfer_blocks{transfer_type="fs_to_CPU"}')
        == fs.counters["blocks_loaded"]
    )
    # Every deferred lookup is one step some request waited; each wait ended (resolved or the
    # request finished) and was observed once.
    assert get("vllm:kv_offload_lookup_wait_steps_sum") == counters["deferred_lookups"] > 0
    assert get("vllm:kv_offload_lookup_deferrals") == counters["deferred_lookups"]


_TIER_COUNTERS: CounterSet = (
    ("vllm:kv_offload_tier_evicted_blocks", ("1:fs",)),
    ("vllm:kv_offload_tier_skipped_blocks", ("1:fs",)),
)


class _CounterSetManager:
    """Stands in for a manager: keeps no CPU-tier counters and reports each of ``reports`` (a
    set of counters and their totals) in one ``counter_totals`` call."""

    secondary_tiers = ()

    def __init__(self) -> None:
        self.reports: list[tuple[CounterSet, tuple[int, ...]]] = []

    def get_stats(self) -> dict[str, int]:
        return {}

    def report_metrics(self, recorder: MetricsRecorder) -> None:
        for counters, totals in self.reports:
            recorder.counter_totals(counters, totals)


def _collector(manager: _CounterSetManager) -> SchedulerStatsCollector:
    spec = cast(Any, SimpleNamespace(row_bytes=4096))
    return SchedulerStatsCollector(spec, cast(Any, manager), OffloadingSchedulerMetrics())


def test_counters_reported_together_emit_what_grew_since_the_last_collection() -> None:
    manager = _CounterSetManager()
    collector = _collector(manager)

    def increments(totals: tuple[int, int]) -> dict[str, Any]:
        manager.reports = [(_TIER_COUNTERS, totals)]
        stats = collector.collect(jobs_in_flight=0)
        assert stats is not None  # the gauges are always there
        values = {name: stats.get(name, labels) for name, labels in _TIER_COUNTERS}
        return {name: value for name, value in values.items() if value is not None}

    evicted, skipped = (name for name, _ in _TIER_COUNTERS)
    assert increments((3, 0)) == {evicted: 3}  # from zero; a zero total emits nothing
    assert increments((3, 0)) == {}  # nothing moved
    assert increments((5, 2)) == {evicted: 2, skipped: 2}
    assert increments((1, 2)) == {evicted: 1}  # went down: reset, counted from zero
    # What the manager does not keep (its get_stats() is empty) never appears.
    stats = collector.collect(jobs_in_flight=0)
    assert stats is not None
    assert stats.get("vllm:kv_offload_tiering_chunk_hits", ("0:primary",)) is None


def test_two_sources_totals_of_one_counter_add_up() -> None:
    """Two fs tiers each keep their own total of the ``CPU_to_fs`` blocks: both count."""
    blocks = ("vllm:kv_offload_transfer_blocks", ("CPU_to_fs",))
    first: CounterSet = (blocks, ("vllm:kv_offload_tier_evicted_blocks", ("1:fs",)))
    second: CounterSet = (blocks, ("vllm:kv_offload_tier_evicted_blocks", ("2:fs",)))
    manager = _CounterSetManager()
    collector = _collector(manager)
    per_step = []
    for totals_first, totals_second in (((10, 0), (4, 1)), ((12, 0), (4, 1)), ((12, 0), (9, 1))):
        manager.reports = [(first, totals_first), (second, totals_second)]
        stats = collector.collect(jobs_in_flight=0)
        assert stats is not None
        per_step.append(stats.get(*blocks))
    assert per_step == [14, 2, 5]


def test_counters_never_decrease_across_reset_cache(tmp_path: Path) -> None:
    """``reset_cache`` zeroes the CPU manager's counters: the stats count on from zero rather
    than emitting negative increments."""
    collected: list[OffloadingConnectorStats] = []
    config = make_config(tmp_path, cpu_blocks=128, num_gpu_blocks=24)
    with EngineCore(config) as engine:
        engine.kv_connector_stats_sink = collected.append
        hits_before_reset: list[int] = []

        def reset_after_turn_1(e: EngineCore, turn: int) -> None:
            if turn == 1:
                hits_before_reset.append(int(e.connector_stats()["manager.hits"]))
                e.reset_prefix_cache()

        run_multi_turn(engine, num_sessions=6, turns=4, between_turns=reset_after_turn_1)
        hits_after_last_reset = engine.connector_stats()["manager.hits"]
    increments = [
        (name, value)
        for step in collected
        for name, kind, _, value in step.items()
        if kind.value == "counter"
    ]
    assert increments and all(value >= 0 for _, value in increments)
    total = OffloadingConnectorStats()
    for step in collected:
        total.aggregate(step)
    hits = total.get("vllm:kv_offload_tiering_chunk_hits", ("0:primary",))
    # The counter kept what it had counted before the reset and went on from there.
    assert hits == hits_before_reset[0] + hits_after_last_reset
    assert hits_before_reset[0] > 0 and hits_after_last_reset > 0


def test_failed_transfers_are_counted_per_direction(tmp_path: Path) -> None:
    """Real handlers failing a share of the jobs: the failure metrics equal the connector's
    failure counters, and failed jobs are neither in the moved blocks nor in the histograms."""
    collected: list[OffloadingConnectorStats] = []
    config = with_handlers(
        make_config(tmp_path, cpu_blocks=128, num_gpu_blocks=24),
        chaos_factory(Chaos(failure_rate=0.3), seed=3),
    )
    with EngineCore(config) as engine:
        engine.kv_connector_stats_sink = collected.append
        run_multi_turn(engine, num_sessions=6, turns=3)
        counters = engine.connector_stats()
    total = OffloadingConnectorStats()
    for step in collected:
        total.aggregate(step)
    r = total.reduce()
    for direction, op in (("GPU_to_CPU", "store"), ("CPU_to_GPU", "load")):
        label = f'{{transfer_type="{direction}"}}'
        failed = counters[f"failed_{op}_blocks"]
        assert r.get(f"vllm:kv_offload_transfer_failed_blocks{label}", 0) == failed
        assert (
            r.get(f"vllm:kv_offload_transfer_failed_jobs{label}", 0)
            == (counters[f"failed_{op}_jobs"])
        )
        moved = r.get(f"vllm:kv_offload_transfer_blocks{label}", 0)
        assert moved == counters[f"{op}_blocks"] - failed
        assert r.get(f"vllm:kv_offload_transfer_jobs{label}", 0) == (
            counters[f"{op}_jobs"] - counters[f"failed_{op}_jobs"]
        )
    assert counters["failed_store_blocks"] > 0


def test_per_step_time_of_both_connector_sides_wall_and_thread_cpu(tmp_path: Path) -> None:
    """Every step records both connector sides' wall and thread CPU time; the scheduler side's
    pair reaches the histograms once per step (a step's sample with the next collection)."""
    collected: list[OffloadingConnectorStats] = []
    config = make_config(tmp_path, cpu_blocks=16, fs=True, num_gpu_blocks=24)
    with EngineCore(config) as engine:
        engine.kv_connector_stats_sink = collected.append
        run_multi_turn(engine, num_sessions=4, turns=2)
        records = engine.stats.step_records
    busy = [r for r in records if r.num_scheduled_tokens > 0]
    assert busy
    # Per step, thread CPU cannot exceed wall time but for the clocks' jitter (up to ~0.2 ms
    # seen on this shared VM); over the run it is bounded tightly.
    slack = 1e-3
    for r in records:
        assert 0 <= r.connector_cpu_seconds <= r.connector_seconds + slack
        assert 0 <= r.worker_connector_cpu_seconds <= r.worker_connector_seconds + slack
    for cpu, wall in (
        (sum(r.connector_cpu_seconds for r in records), sum(r.connector_seconds for r in records)),
        (
            sum(r.worker_connector_cpu_seconds for r in records),
            sum(r.worker_connector_seconds for r in records),
        ),
    ):
        assert 0 < cpu <= wall * 1.05
    assert all(r.connector_cpu_seconds > 0 and r.worker_connector_cpu_seconds > 0 for r in busy)
    walls: list[float] = []
    cpus: list[float] = []
    for step in collected:
        walls += step.get("vllm:kv_offload_scheduler_step_seconds") or []
        cpus += step.get("vllm:kv_offload_scheduler_step_cpu_seconds") or []
    # The last step's sample is still pending, unless a step applying the step in flight (async
    # scheduling) collected it.
    n = len(walls)
    assert len(cpus) == n and len(records) - 1 <= n <= len(records)
    assert walls == [r.connector_seconds for r in records[:n]]
    assert cpus == [r.connector_cpu_seconds for r in records[:n]]
