# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The hit-rate benchmark's optimum (Belady's MIN with bypass) is the optimum.

``benchmarks/kv_offload/bench_hit_rate.py`` reports every policy's hits as a fraction of MIN's;
here MIN is checked against an exhaustive search over every caching schedule on small random
traces, and the policies' replays against MIN.
"""

from __future__ import annotations

import functools
import random
import struct
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks" / "kv_offload"))

from bench_hit_rate import VARIANTS, belady_min, replay
from traces import Request, Trace

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key


def _key(*parts: int) -> OffloadKey:
    """A synthetic key, unique per ``parts``."""
    return make_offload_key(struct.pack(f">{len(parts)}q", *parts), 0)


def random_trace(rng: random.Random, num_requests: int) -> Trace:
    """Requests over a small prefix tree: 3 roots, each a chain of up to 4 blocks."""
    requests = []
    for _ in range(num_requests):
        root = rng.randrange(3)
        depth = rng.randint(1, 4)
        lookup = tuple(_key(9, root, b) for b in range(depth))
        extra = tuple(_key(9, root, b) for b in range(depth, depth + rng.randint(0, 1)))
        requests.append(Request(lookup, lookup + extra))
    return Trace("random", tuple(requests))


def exhaustive_optimum(trace: Trace, capacity: int) -> int:
    """Most prefix hits of any schedule: after each request, keep any subset (at most
    ``capacity`` keys) of what was resident plus what the request offered."""
    requests = trace.requests

    @functools.cache
    def best(r: int, resident: frozenset[object]) -> int:
        if r == len(requests):
            return 0
        request = requests[r]
        hits = 0
        for key in request.lookup:
            if key not in resident:
                break
            hits += 1
        pool = sorted(resident | set(request.store))
        options = [frozenset()]
        for key in pool:
            options += [s | {key} for s in options if len(s) < capacity]
        return hits + max(best(r + 1, s) for s in options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(12))
def test_min_is_the_optimum_and_bounds_every_policy(seed: int) -> None:
    rng = random.Random(seed)
    trace = random_trace(rng, rng.randint(3, 7))
    for capacity in (1, 2, 3):
        optimum = exhaustive_optimum(trace, capacity)
        assert belady_min(trace, capacity).hits == optimum, (seed, capacity)
        for variant in VARIANTS:
            assert replay(trace, capacity, variant, "all").hits <= optimum
