# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Per-key cost of ``TieringOffloadingManager.lookup``, for before/after comparisons.

Two in-memory ``example`` secondary tiers behind a 64-row primary. ``miss``: keys that miss the
primary and both tiers (the path that asks every secondary tier); ``hit``: keys readable in the
primary. Each figure is nanoseconds per lookup, best and median of ``REPS`` passes of ``N`` keys.
Run it against two checkouts alternately (interleaved) to compare them::

    for i in 1 2 3 4 5; do
      for tree in /tmp/base /path/to/branch; do
        (cd $tree && PYTHONPATH=$tree python benchmarks/kv_offload/bench_tier_lookup.py)
      done
    done
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from tests.v1.kv_offload.utils import make_tiering_spec
from vllm.v1.kv_offload.base import ReqContext, make_offload_key

N = 20_000
REPS = 15


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        spec = make_tiering_spec(
            Path(d), 64, 4096, secondary_tiers=[{"type": "example"}, {"type": "example"}]
        )
        manager = spec.get_manager()
        ctx = ReqContext("r")
        manager.on_new_request(ctx)
        keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(N)]
        hit = keys[:4]
        manager.prepare_store(hit, ctx)
        manager.complete_store(hit, ctx)
        manager.on_schedule_end()
        lookup = manager.lookup
        miss_ns, hit_ns = [], []
        for _ in range(REPS):
            start = time.perf_counter()
            for key in keys[4:]:
                lookup(key, ctx)
            miss_ns.append((time.perf_counter() - start) / (N - 4) * 1e9)
            start = time.perf_counter()
            for _ in range(N // 4):
                for key in hit:
                    lookup(key, ctx)
            hit_ns.append((time.perf_counter() - start) / N * 1e9)
            manager.on_schedule_end()
        manager.shutdown()
    print(
        f"miss ns/key best {min(miss_ns):.0f} med {statistics.median(miss_ns):.0f}  "
        f"hit ns/key best {min(hit_ns):.0f} med {statistics.median(hit_ns):.0f}  "
        f"load {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
