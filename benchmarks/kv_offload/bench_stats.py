# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Cost of the connector's per-step stats collection, against the connector's own per-step time.

Runs a multi-turn workload through a real engine with the CPU and fs tiers (the CLI's setup),
recording every step's ``OffloadingConnectorStats`` and the engine's per-step scheduler-side
connector time. Then, on the warm engine (tiers populated, so ``get_stats()`` reports real
figures), it times:

* ``collect``: ``OffloadingConnector.get_kv_connector_stats()`` on an idle step: the connector's
  counters turned into increments, the manager's ``get_stats()`` and ``report_metrics`` (the
  tiering counters and the fs tier's ``get_stats()``);
* ``observe``: ``OffloadPromMetrics.observe`` (what the CLI's exporter does every step) of the
  median step's stats and of the busiest step's (most values);

each as the best and the median of ``--reps`` repetitions of ``--calls`` calls, and reports
them against the median per-step scheduler-side connector time of the run (``StepRecord``).

It also prints, over the run's busy steps, the median and p99 of both connector sides' time per
step, wall and thread CPU (``StepRecord.connector_*seconds``: one read of ``perf_counter`` and of
``thread_time`` before and after each hook), and what one such pair of reads costs.

Usage::

    PYTHONPATH=. python benchmarks/kv_offload/bench_stats.py    # ~20 s on 2 cores
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.prometheus import (
    OffloadPromMetrics,
)
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore


def _config(root: Path) -> EngineConfig:
    return EngineConfig(
        gpu_block_sizes=(16,),
        num_gpu_blocks=96,
        num_layers=4,
        num_kv_heads=2,
        head_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        record_steps=True,
        kv_connector_extra_config={
            "cpu_bytes_to_use": 64 * 16 * 4 * 2 * 2 * 32 * 2,  # 64 rows
            "shared_region_dir": str(root),
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs", "root_dir": str(root / "fs")}],
        },
    )


def _workload(engine: EngineCore, sessions: int, turns: int) -> None:
    rng = random.Random(0)
    history = {s: [rng.randrange(32000) for _ in range(200 + 16 * s)] for s in range(sessions)}
    for turn in range(turns):
        out = engine.generate({f"s{s}-t{turn}": list(h) for s, h in history.items()}, 4)
        for s in history:
            history[s] += out[f"s{s}-t{turn}"] + [rng.randrange(32000) for _ in range(32)]


def _time(fn: object, calls: int, reps: int) -> tuple[float, float]:
    """(best, median) microseconds per call."""
    per_call = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()  # type: ignore[operator]
        per_call.append((time.perf_counter() - start) / calls * 1e6)
    return min(per_call), statistics.median(per_call)


def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _clock_pair() -> None:
    time.perf_counter()
    time.thread_time()
    time.thread_time()
    time.perf_counter()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()

    steps: list[OffloadingConnectorStats] = []
    with tempfile.TemporaryDirectory() as tmp, EngineCore(_config(Path(tmp))) as engine:
        engine.kv_connector_stats_sink = steps.append
        _workload(engine, args.sessions, args.turns)
        records = [r for r in engine.stats.step_records if r.num_scheduled_tokens > 0]
        step_us = statistics.median(r.connector_seconds for r in records) * 1e6
        connector = engine.connector
        assert connector is not None
        collect = _time(connector.get_kv_connector_stats, args.calls, args.reps)

    registry = CollectorRegistry()
    prom = OffloadPromMetrics(registry, ("model_name", "engine", "run"))

    def size(stats: OffloadingConnectorStats) -> int:
        return sum(len(v) if isinstance(v, list) else 1 for *_, v in stats.items())

    by_size = sorted(steps, key=size)
    typical, busiest = by_size[len(by_size) // 2], by_size[-1]
    labels = ("toy", "0", "offload")
    observe = _time(lambda: prom.observe(typical, labels), args.calls, args.reps)
    observe_max = _time(lambda: prom.observe(busiest, labels), args.calls, args.reps)
    clock = _time(_clock_pair, args.calls * 10, args.reps)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"load average: {load}")
    print("per busy step, median / p99 (µs):")
    for name, values in (
        ("scheduler side, wall", [r.connector_seconds for r in records]),
        ("scheduler side, thread CPU", [r.connector_cpu_seconds for r in records]),
        ("worker side, wall", [r.worker_connector_seconds for r in records]),
        ("worker side, thread CPU", [r.worker_connector_cpu_seconds for r in records]),
    ):
        us = [v * 1e6 for v in values]
        print(f"  {name:28s} {statistics.median(us):8.1f} / {_percentile(us, 0.99):8.1f}")
    print(f"one hook's clock reads (perf_counter + thread_time, twice): {clock[0]:.2f} µs best")
    print(
        f"busy steps: {len(records)}; scheduler-side connector per busy step, "
        f"median: {step_us:.1f} µs"
    )
    print(
        f"values per step's stats: median {size(typical)}, max {size(busiest)} "
        "(counters and gauges count 1, histograms their observations)"
    )
    for name, (best, med) in (
        ("collect", collect),
        ("observe", observe),
        ("observe busiest", observe_max),
    ):
        print(
            f"{name:16s} best {best:7.1f} µs  median {med:7.1f} µs  "
            f"= {best / step_us:.1%} / {med / step_us:.1%} of the connector's step time"
        )


if __name__ == "__main__":
    main()
