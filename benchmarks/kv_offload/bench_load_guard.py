# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The load guard against a tier made slow on purpose: TTFT with and without it.

Each repetition runs, in this process and in rotating order, the baseline (no connector), the
offloaded engine with the load guard and the offloaded engine without it over
``SlowTier`` (the example tier reporting every load ``--delay`` seconds after its submission;
``tests/v1/kv_connector/unit/offloading_connector/slow_tier.py``). Each stores ``--prompts``
prompts, drops the CPU tier and the GPU prefix cache, and serves the prompts again one at a
time: every hit is in the slow tier. Printed: the second pass's TTFT median and p90, its wall
time and engine-thread CPU, each as a ratio to the baseline's, and the guard's skips.

    PYTHONPATH=. python benchmarks/kv_offload/bench_load_guard.py --preset tiny --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from tests.v1.kv_connector.unit.offloading_connector.slow_tier import (
    SLOW_TIER,
    TwoPassResult,
    serve_two_passes,
)

VARIANTS = {"baseline": (False, True), "guard": (True, True), "no guard": (True, False)}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", help="the transformer's preset")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--delay", type=float, default=0.25, help="seconds per slow load")
    args = parser.parse_args()
    results: dict[str, list[TwoPassResult]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for name in names[rep % 3 :] + names[: rep % 3]:
                offload, guard = VARIANTS[name]
                results[name].append(
                    serve_two_passes(
                        Path(tmp) / f"{rep}-{name.replace(' ', '-')}",
                        offload,
                        guard,
                        num_prompts=args.prompts,
                        prompt_tokens=args.prompt_tokens,
                        delay_s=args.delay,
                        preset=args.preset,
                    )
                )
    figures = {}
    for name, runs in results.items():
        ttfts = [t for r in runs for t in r.ttfts_s]
        figures[name] = (
            statistics.median(ttfts) * 1e3,
            _quantile(ttfts, 0.9) * 1e3,
            sum(r.wall_s for r in runs) / len(runs),
            sum(r.cpu_s for r in runs) / len(runs),
        )
    base = figures["baseline"]
    print(
        f"preset {args.preset}, {args.prompts} prompts of {args.prompt_tokens} tokens, slow tier "
        f"{args.delay * 1e3:.0f} ms per load, {args.reps} reps (means of the reps' second passes)"
    )
    print("| run | TTFT median (ms) | TTFT p90 (ms) | wall (s) | engine thread CPU (s) |")
    print("|---|---:|---:|---:|---:|")
    for name, (median, p90, wall, cpu) in figures.items():
        ratio = "" if name == "baseline" else f" ({median / base[0]:.2f}x)"
        print(
            f"| {name} | {median:,.1f}{ratio} | {p90:,.1f} | {wall:.2f} ({wall / base[2]:.2f}x) "
            f"| {cpu:.2f} ({cpu / base[3]:.2f}x) |"
        )
    prefix = f"load_guard.{SLOW_TIER}."
    guarded = results["guard"]
    skipped = sum(r.stats.get(prefix + "skipped_hits", 0) for r in guarded)
    decisions = sum(r.stats.get(prefix + "decisions", 0) for r in guarded)
    probes = sum(r.stats.get(prefix + "probes", 0) for r in guarded)
    print(f"guard: {skipped} of {decisions} slow-tier hits computed, {probes} probes")


if __name__ == "__main__":
    main()
