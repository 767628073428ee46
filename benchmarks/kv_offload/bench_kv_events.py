# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What publishing KV events on ZeroMQ costs the engine thread.

Runs the same multi-turn workload on an ``EngineCore`` with offloading (CPU tier) in this
thread, in interleaved rounds of three variants:

* ``null``: events collected, handed to a ``NullEventPublisher`` (the baseline);
* ``zmq``: handed to a ``ZmqEventPublisher`` on loopback, with an ``EventFeed`` (the router's
  subscriber) reading every batch in the same process, as a fleet's front end does;
* ``off``: events not collected at all (for scale).

Reports, per variant, the median engine-thread CPU seconds (``time.thread_time``) and wall
seconds, and the ratio to ``null`` of the same round (the order of the variants rotates from
round to round); then the engine-thread CPU spent inside ``ZmqEventPublisher.publish`` itself
as a share of the run's engine-thread CPU (the direct figure, free of run-to-run noise); the
feed's batches and lost count show that every batch arrived. Usage::

    python benchmarks/kv_offload/bench_kv_events.py [--rounds 5] [--sessions 24]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm.distributed.kv_event_publisher import ZmqEventPublisher
from vllm.distributed.kv_events import KVEventBatch, NullEventPublisher
from vllm.entrypoints.router.event_feed import EventFeed
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore

LOOPBACK = "tcp://127.0.0.1:*"


def _config(tmp: Path, events: bool) -> EngineConfig:
    return EngineConfig(
        num_gpu_blocks=256,
        max_num_seqs=8,
        enable_kv_events=events,
        verify_kv=False,
        freeze_gc_heap=False,
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 24, "shared_region_dir": str(tmp)},
    )


def _workload(engine: EngineCore, sessions: int, seed: int) -> None:
    rng = random.Random(seed)
    history = {f"s{i}": [rng.randrange(32000) for _ in range(400)] for i in range(sessions)}
    for turn in range(3):
        prompts = {f"{s}-{turn}": list(h) for s, h in history.items()}
        outputs = engine.generate(prompts, max_tokens=8)
        for s, h in history.items():
            h += outputs[f"{s}-{turn}"] + [rng.randrange(32000) for _ in range(64)]


def _one(
    tmp: Path, events: bool, sink: Callable[[KVEventBatch], None] | None, sessions: int
) -> tuple[float, float]:
    with EngineCore(_config(tmp, events), event_sink=sink) as engine:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        _workload(engine, sessions, seed=7)
        return time.thread_time() - cpu0, time.perf_counter() - wall0


class TimedSink:
    """Wraps a sink, adding up the engine-thread CPU seconds spent inside it."""

    def __init__(self, sink: Callable[[KVEventBatch], None]) -> None:
        self.sink = sink
        self.cpu_s = 0.0

    def __call__(self, batch: KVEventBatch) -> None:
        t0 = time.thread_time()
        self.sink(batch)
        self.cpu_s += time.thread_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=24)
    args = parser.parse_args()
    publisher = ZmqEventPublisher(endpoint=None, also_bind=[(LOOPBACK, LOOPBACK)])
    feed = EventFeed([(publisher.endpoints.pub[0], publisher.endpoints.replay[0])])
    null = NullEventPublisher()
    cpu: dict[str, list[float]] = {"off": [], "null": [], "zmq": []}
    wall: dict[str, list[float]] = {"off": [], "null": [], "zmq": []}
    ratios: dict[str, list[float]] = {"off": [], "zmq": []}
    inside: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds + 1):  # round 0 warms up
            timed = TimedSink(publisher.publish)
            variants: list[tuple[str, bool, Callable[[KVEventBatch], None] | None]] = [
                ("null", True, null.publish),
                ("zmq", True, timed),
                ("off", False, None),
            ]
            shift = r % len(variants)
            row: dict[str, tuple[float, float]] = {}
            for name, events, sink in variants[shift:] + variants[:shift]:
                row[name] = _one(Path(d), events, sink, args.sessions)
            if r == 0:
                continue
            for name, (c, w) in row.items():
                cpu[name].append(c)
                wall[name].append(w)
            for name in ("off", "zmq"):
                ratios[name].append(row[name][0] / row["null"][0])
            inside.append(timed.cpu_s / row["zmq"][0])
    assert publisher.wait_sent(10.0)
    feed.wait_for(0, publisher.sent_batches, 10.0)
    stats = feed.stats
    feed.stop()
    publisher.shutdown()
    print(f"rounds {args.rounds}, {args.sessions} sessions x 3 turns, engine thread")
    print(f"{'variant':8} {'cpu s':>8} {'wall s':>8} {'cpu / null':>11}")
    for name in ("null", "zmq", "off"):
        ratio = "1.000" if name == "null" else f"{statistics.median(ratios[name]):.3f}"
        print(
            f"{name:8} {statistics.median(cpu[name]):8.3f} {statistics.median(wall[name]):8.3f} "
            f"{ratio:>11}"
        )
    print(
        f"engine-thread CPU inside publish(): {statistics.median(inside) * 100:.2f}% of the "
        f"run's (median; max {max(inside) * 100:.2f}%)"
    )
    print(
        f"zmq: {publisher.sent_batches} batches sent, {publisher.dropped_batches} dropped; "
        f"feed received {stats.batches[0]} ({stats.replayed[0]} by replay), lost {stats.lost[0]}, "
        f"mean lag {stats.lag_sum_s[0] / max(1, stats.batches[0]) * 1000:.2f} ms"
    )


if __name__ == "__main__":
    main()
