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
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.entrypoints.cli.main import main as cli_main
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


def _timed(
    label: str, fn: Callable[..., Any], cpu: defaultdict[str, float], calls: Counter[str]
) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            cpu[label] += time.thread_time() - start
            calls[label] += 1

    return wrapper


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", nargs="*", help="the vllm-kv-offload arguments (after --)")
    args = p.parse_args(argv)
    cpu: defaultdict[str, float] = defaultdict(float)
    calls: Counter[str] = Counter()
    targets: list[tuple[type, str, str]] = [(OffloadingConnector, h, h) for h in HOOKS]
    targets += [
        (JobPlanner, "plan", "  planner (in start_load_kv)"),
        (SingleDirectionOffloadingHandler, "transfer_async", "  handler (in start_load_kv)"),
    ]
    for cls, name, label in targets:
        setattr(cls, name, _timed(label, getattr(cls, name), cpu, calls))
    rc = cli_main(args.command or DEFAULT_RUN)
    print(f"\n{'callable':34s} {'thread CPU':>11s} {'calls':>8s} {'per call':>10s}")
    for label, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        per_call = 1e6 * seconds / calls[label]
        print(f"{label:34s} {seconds:9.3f} s {calls[label]:8d} {per_call:7.1f} us")
    return rc


if __name__ == "__main__":
    sys.exit(main())
