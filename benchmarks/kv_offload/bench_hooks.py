# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Thread CPU of each connector hook over one ``vllm-kv-offload run``, and of the worker's copy.

Runs the command in this process (its arguments after ``--``; default: the hash model, no
verification, the default workload) with every public hook of ``OffloadingConnector`` and the
CPU path's job planner and handler wrapped in a pair of ``time.thread_time()`` reads, then prints
per callable: total thread CPU, calls, and CPU per call. The baseline run has no connector, so
the totals are the offload run's: what each hook costs the engine thread (where the hooks run),
summed over the run. ``get_kv_connector_stats`` counts both roles' calls (the scheduler's and
each worker's).

A run's engine-thread CPU and wall time vary by 10-20 % from run to run on a shared 2-core
machine; these totals vary less, so they are the figures to compare two trees with
(``PYTHONPATH=<other tree> python <this file> ...`` runs the other tree's code with this
script), alternating the trees in one session. Example::

    python benchmarks/kv_offload/bench_hooks.py -- run --model hash --verify none \\
        --no-progress --fs-root /dev/shm/bench-hooks

``--slowest PCT`` also prints, per side (scheduler: the scheduler-side hooks and the stats
collection; worker: the worker-side hooks), the mean thread CPU of each callable in that side's
slowest ``PCT`` percent of engine steps, beside the same in the 40 steps around the median:
what a report's per-step p99 is made of. Steps are those of the offload run (the baseline has
no connector); ``get_kv_connector_stats`` is split by the connector's role.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.entrypoints.cli.main import main as cli_main
from vllm.entrypoints.cli.report.figures import percentile
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.cpu.transfer.handler import SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.cpu.transfer.planner import JobPlanner

HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
    "get_kv_connector_stats",
    "start_load_kv",
    "wait_for_save",
    "get_finished",
)
DEFAULT_RUN = ["run", "--model", "hash", "--verify", "none", "--no-progress"]


WORKER_HOOKS = frozenset({"start_load_kv", "wait_for_save", "get_finished"})
SIDES = ("scheduler", "worker")


class _Steps:
    """Thread CPU per callable in each engine step (``--slowest``)."""

    def __init__(self) -> None:
        # (side, label) -> seconds in the step under way.
        self.current: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.steps: list[dict[tuple[str, str], float]] = []

    def end_step(self) -> None:
        if self.current:  # a step of the offload run
            self.steps.append(dict(self.current))
            self.current.clear()

    def report(self, pct: float) -> None:
        for side in SIDES:
            rows = [{k[1]: v for k, v in s.items() if k[0] == side} for s in self.steps]
            # Labels indented under a hook are part of that hook's time.
            totals = [sum(v for k, v in r.items() if not k.startswith(" ")) for r in rows]
            order = sorted(range(len(rows)), key=totals.__getitem__)
            n = len(order)
            if n < 50:
                print(f"\n{side} side: {n} steps, too few to tell the slowest from the median")
                continue
            slow = order[n - max(1, round(n * pct / 100)) :]
            mid = order[n // 2 - 20 : n // 2 + 20]
            # The report's percentiles (connector_thread_cpu_us and its worker twin).
            p99, median = percentile(totals, 99), percentile(totals, 50)
            print(
                f"\n{side} side, {n} steps: p99 {1e6 * p99:.0f} us, median {1e6 * median:.0f} us;"
                " mean thread CPU per step"
            )
            print(f"{'callable':34s} {f'slowest {pct:g}%':>13s} {'median steps':>13s}")
            labels = sorted(
                {k for r in rows for k in r}, key=lambda k: -sum(r.get(k, 0.0) for r in rows)
            )
            for label in labels:
                a = 1e6 * sum(rows[i].get(label, 0.0) for i in slow) / len(slow)
                b = 1e6 * sum(rows[i].get(label, 0.0) for i in mid) / len(mid)
                print(f"{label:34s} {a:10.0f} us {b:10.0f} us")


def _side(label: str, args: tuple[Any, ...]) -> str:
    if label == "get_kv_connector_stats":
        worker = getattr(args[0], "role", None) is KVConnectorRole.WORKER
        return SIDES[worker]
    return SIDES[label in WORKER_HOOKS or label.startswith("  ")]


def _timed(
    label: str,
    fn: Callable[..., Any],
    cpu: defaultdict[str, float],
    calls: Counter[str],
    steps: _Steps,
) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.thread_time() - start
            cpu[label] += elapsed
            calls[label] += 1
            steps.current[(_side(label, args), label)] += elapsed

    return wrapper


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="*", help="the vllm-kv-offload arguments (after --)")
    p.add_argument(
        "--slowest",
        type=float,
        metavar="PCT",
        help="also break down each side's slowest PCT%% of steps (e.g. 3)",
    )
    args = p.parse_args(argv)
    if args.slowest is not None and not 0 < args.slowest <= 50:
        p.error("--slowest takes a percentage in (0, 50]")
    steps = _Steps()
    cpu: defaultdict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    targets: list[tuple[type, str, str]] = [(OffloadingConnector, h, h) for h in HOOKS]
    targets += [
        (JobPlanner, "plan", "  planner (in start_load_kv)"),
        (SingleDirectionOffloadingHandler, "transfer_async", "  handler (in start_load_kv)"),
    ]
    for cls, name, label in targets:
        setattr(cls, name, _timed(label, getattr(cls, name), cpu, calls, steps))
    step = EngineCore.step

    def counted_step(self: EngineCore) -> Any:
        try:
            return step(self)
        finally:
            steps.end_step()

    EngineCore.step = counted_step  # type: ignore[method-assign]
    rc = cli_main(args.command or DEFAULT_RUN)
    print(f"\n{'callable':34s} {'thread CPU':>11s} {'calls':>8s} {'per call':>10s}")
    for label, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        per_call = 1e6 * seconds / calls[label]
        print(f"{label:34s} {seconds:9.3f} s {calls[label]:8d} {per_call:7.1f} us")
    if args.slowest is not None:
        steps.report(args.slowest)
    return rc


if __name__ == "__main__":
    sys.exit(main())
