# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Hit rates of the CPU tier's cache policies against the offline optimum (Belady's MIN).

Every trace of ``traces.py`` is replayed through a ``CPUOffloadingManager`` per policy, with the
calls the connector makes for a request (the stores complete at once; nothing is in flight):

1. ``touch`` of the request's lookup keys (``--touch all``, the connector's order: it touches a
   waiting request's keys before looking them up), or only when the lookup hits
   (``--touch hits``: ``touch`` of the lookup keys after a lookup with at least one hit);
2. ``lookup`` of the keys in order until the first miss: the request's hits;
3. ``prepare_load`` / ``complete_load`` of the hits;
4. ``prepare_store`` of the rest of the request's blocks (its output's included), then
   ``complete_store`` of the keys it returned.

Policies: ``lru``, ``arc``, and each with the reuse filter (``store_threshold=2``: a block is
stored from its second offer on). The optimum is Belady's MIN with bypass at the same capacity:
on a miss it stores a block only if some resident block is needed later than it (evicting the one
needed last), and never stores a block that is not needed again. It maximises the hits of any
cache that fills only from requested blocks; ties are broken by evicting the deeper block of a
request first, which keeps its cache prefix-closed (a block's next use is never earlier than its
parent's), so its per-block hits are prefix hits too. The table gives MIN's hit rate (hits per
block looked up) and every policy's hits as a fraction of MIN's.

The capacity is a fraction of each trace's footprint (the distinct blocks it stores). "stored"
counts blocks written to the tier (its write traffic), and "skipped" the stores the reuse filter
declined.

Usage::

    python benchmarks/kv_offload/bench_hit_rate.py            # every trace (~5 min on 2 cores)
    python benchmarks/kv_offload/bench_hit_rate.py --quick    # shorter traces
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from traces import Trace, cli_trace, multi_turn_trace, scan_trace, zipf_trace

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

DEFAULT_TRACE = "cli-mix"
"""The main job's default workload: the trace the >= 0.9-of-MIN goal is held to."""
ARC_GOAL = 0.9


@dataclass(frozen=True)
class Variant:
    """A policy configuration to replay."""

    name: str
    policy: str
    store_threshold: int = 0


VARIANTS = (
    Variant("lru", "lru"),
    Variant("arc", "arc"),
    Variant("lru+reuse2", "lru", 2),
    Variant("arc+reuse2", "arc", 2),
)


@dataclass
class Outcome:
    """What one replay measured."""

    hits: int
    lookups: int
    stored: int
    skipped: int = 0
    arc_target: float | None = None


def replay(trace: Trace, capacity: int, variant: Variant, touch: str) -> Outcome:
    """Replay ``trace`` through a fresh manager (see the module docstring for the calls)."""
    # The reuse filter's keyword only when it is used: the script also runs on checkouts that
    # predate the filter (for before/after hit rates of the plain policies).
    kwargs = {"store_threshold": variant.store_threshold} if variant.store_threshold else {}
    manager = CPUOffloadingManager(capacity, cache_policy=variant.policy, **kwargs)
    ctx = ReqContext("trace")
    lookup = manager.lookup
    hits = 0
    for request in trace.requests:
        keys = request.lookup
        if touch == "all":
            manager.touch(keys, ctx)
        n = 0
        for key in keys:
            if lookup(key, ctx) is not True:
                break
            n += 1
        if n:
            hit_keys = keys[:n]
            manager.prepare_load(hit_keys, ctx)
            manager.complete_load(hit_keys, ctx)
            if touch == "hits":
                manager.touch(keys, ctx)
        hits += n
        out = manager.prepare_store(request.store[n:], ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
    stats = manager.get_stats()
    policy = manager.policy
    return Outcome(
        hits=hits,
        lookups=trace.num_lookups,
        stored=int(stats["stores"]),
        skipped=int(stats.get("stores_skipped", 0)),
        arc_target=getattr(policy, "target_t1_size", None),
    )


_NEVER = (1 << 62, 0)


def belady_min(trace: Trace, capacity: int) -> Outcome:
    """Belady's MIN with bypass over ``trace`` at ``capacity`` blocks (prefix hits).

    A block's next use is ``(request index, position in it)`` of the next request that looks it
    up; the resident block with the latest next use is the victim (the deeper one on a tie of
    request index), and a missing block is stored only if it is needed before that victim.
    O(accesses x log(capacity)).
    """
    requests = trace.requests
    # Backward pass: the next use of every offered block, per request, parallel to r.store.
    next_seen: dict[OffloadKey, tuple[int, int]] = {}
    next_uses: list[list[tuple[int, int]]] = [[] for _ in requests]
    for r in range(len(requests) - 1, -1, -1):
        request = requests[r]
        next_uses[r] = [next_seen.get(key, _NEVER) for key in request.store]
        for pos, key in enumerate(request.lookup):
            next_seen[key] = (r, pos)

    resident: dict[OffloadKey, tuple[int, int]] = {}
    heap: list[tuple[int, int, OffloadKey]] = []  # (-request, -position, key), lazily stale
    hits = 0
    stored = 0
    for r, request in enumerate(requests):
        n = 0
        for key in request.lookup:
            if key not in resident:
                break
            n += 1
        hits += n
        for key, use in zip(request.store, next_uses[r], strict=True):
            if key in resident:
                resident[key] = use
                heapq.heappush(heap, (-use[0], -use[1], key))
                continue
            if use == _NEVER:
                continue  # never looked up again: storing it cannot help
            if len(resident) >= capacity:
                while True:
                    neg_r, neg_pos, victim = heap[0]
                    if resident.get(victim) == (-neg_r, -neg_pos):
                        break
                    heapq.heappop(heap)  # stale entry
                if (-neg_r, -neg_pos) <= use:
                    continue  # every resident block is needed before this one: bypass
                heapq.heappop(heap)
                del resident[victim]
            resident[key] = use
            heapq.heappush(heap, (-use[0], -use[1], key))
            stored += 1
    return Outcome(hits=hits, lookups=trace.num_lookups, stored=stored)


def build_traces(names: Sequence[str], quick: bool) -> list[Trace]:
    scale = 4 if quick else 1
    builders = {
        "cli-chat": lambda: cli_trace("chat", 640 // scale),
        "cli-system-prompt": lambda: cli_trace("system-prompt", 640 // scale),
        "cli-documents": lambda: cli_trace("documents", 640 // scale),
        "cli-mix": lambda: cli_trace("mix", 640 // scale),
        "zipf": lambda: zipf_trace(20_000 // scale),
        "scan": lambda: scan_trace(20_000 // scale),
        "multi-turn": lambda: multi_turn_trace(20_000 // scale),
    }
    return [builders[name]() for name in names]


ALL_TRACES = (
    "cli-chat",
    "cli-system-prompt",
    "cli-documents",
    "cli-mix",
    "zipf",
    "scan",
    "multi-turn",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", nargs="+", default=list(ALL_TRACES), choices=ALL_TRACES)
    parser.add_argument(
        "--fractions",
        nargs="+",
        type=float,
        default=[0.1, 0.25],
        help="capacities, as fractions of each trace's footprint (default: 0.1 0.25)",
    )
    parser.add_argument("--touch", choices=["all", "hits"], default="all")
    parser.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS])
    parser.add_argument("--quick", action="store_true", help="traces 4x shorter")
    args = parser.parse_args()
    variants = [v for v in VARIANTS if v.name in args.variants]

    t0 = time.perf_counter()
    traces = build_traces(args.traces, args.quick)
    print(f"traces built in {time.perf_counter() - t0:.1f} s; touch order: {args.touch}\n")
    names = " ".join(f"{v.name:>11}" for v in variants)
    header = (
        f"{'trace':<18} {'requests':>8} {'footprint':>9} {'capacity':>8} {'MIN rate':>8} "
        f"{names} {'stored lru':>10} {'stored r2':>10} {'arc p/c':>7}"
    )
    print("hits as a fraction of MIN's:")
    print(header)
    print("-" * len(header))
    verdicts: list[str] = []
    for trace in traces:
        footprint = trace.footprint
        for fraction in args.fractions:
            capacity = max(1, round(footprint * fraction))
            best = belady_min(trace, capacity)
            outcomes = {v.name: replay(trace, capacity, v, args.touch) for v in variants}
            for name, outcome in outcomes.items():
                assert outcome.hits <= best.hits, f"{trace.name}: {name} beat MIN"
            ratios = {
                name: (o.hits / best.hits if best.hits else 1.0) for name, o in outcomes.items()
            }
            cells = " ".join(f"{ratios[v.name]:>11.3f}" for v in variants)
            stored_lru = outcomes["lru"].stored if "lru" in outcomes else 0
            stored_r2 = outcomes["lru+reuse2"].stored if "lru+reuse2" in outcomes else 0
            arc = outcomes.get("arc")
            target = (
                f"{arc.arc_target / capacity:>7.2f}"
                if arc is not None and arc.arc_target is not None
                else f"{'-':>7}"
            )
            print(
                f"{trace.name:<18} {len(trace.requests):>8} {footprint:>9} {capacity:>8} "
                f"{best.hits / best.lookups:>8.3f} {cells} {stored_lru:>10} {stored_r2:>10} "
                f"{target}"
            )
            if "lru" in ratios and "arc" in ratios and ratios["arc"] < ratios["lru"]:
                verdicts.append(
                    f"ARC < LRU on {trace.name} at {fraction:g} of the footprint "
                    f"({ratios['arc']:.3f} < {ratios['lru']:.3f})"
                )
            if trace.name == DEFAULT_TRACE and "arc" in ratios and ratios["arc"] < ARC_GOAL:
                verdicts.append(
                    f"ARC below {ARC_GOAL} of MIN on {trace.name} at {fraction:g} "
                    f"({ratios['arc']:.3f})"
                )
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    print("goals (ARC >= LRU everywhere, ARC >= 0.9 of MIN on the default mix): ", end="")
    print("met" if not verdicts else "missed:\n  " + "\n  ".join(verdicts))


if __name__ == "__main__":
    main()
