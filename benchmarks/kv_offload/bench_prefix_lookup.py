# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A request's prefix scan: ``lookup`` key by key against one ``lookup_prefix`` call.

What ``get_num_new_matched_tokens`` asks of the manager for a request at its start: every key of
its prefix, in order, until the first miss. Before ``lookup_prefix`` the connector called
``lookup`` once per key, and each key that only a secondary tier held reserved its primary row
on its own (an allocation with its eviction, a policy insert and a ledger record per key); now
it makes one call, which reserves the rows of all the promotions it starts in one allocation.

Each row is a tiering manager (CPU primary of ``--capacity`` blocks under LRU or ARC, full) with
the in-memory example tier holding every block stored before. Two scans per round, one in each
form, on the same manager, the order alternating round by round:

* ``promote``: ``--keys`` keys only the tier holds (each scan promotes all of them; the
  promotions then complete over two step ends, which are not timed);
* ``hit``: the same keys again, now readable in the primary.

Reported per row, scan and form: the calling thread's CPU per key (median over the rounds), and
the ratio of the two forms. Usage::

    python benchmarks/kv_offload/bench_prefix_lookup.py            # ~10 s
    python benchmarks/kv_offload/bench_prefix_lookup.py --keys 512 --rounds 20
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

ROW_BYTES = 4096
FORMS = ("lookup", "lookup_prefix")


def one_by_one(
    manager: TieringOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> int:
    """The scan as the connector made it before: ``lookup`` per key until the first False."""
    lookup = manager.lookup
    n = 0
    for key in keys:
        if lookup(key, ctx) is False:
            break
        n += 1
    return n


def in_one_call(
    manager: TieringOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext
) -> int:
    """The scan as the connector makes it: one ``lookup_prefix``."""
    results = manager.lookup_prefix(keys, ctx)
    return len(results) - 1 if results and results[-1] is False else len(results)


SCANS: dict[str, Callable[[TieringOffloadingManager, Sequence[OffloadKey], ReqContext], int]] = {
    "lookup": one_by_one,
    "lookup_prefix": in_one_call,
}


def run_row(
    policy: str, capacity: int, num_keys: int, rounds: int, workdir: str
) -> dict[str, list[float]]:
    """ns of thread CPU per key, per ``(scan, form)``, over ``rounds`` rounds of each form."""
    region = SharedOffloadRegion(
        f"bench-prefix-{os.getpid()}-{policy}", capacity, ROW_BYTES, directory=workdir
    )
    primary = CPUPrimaryTierOffloadingManager(capacity, region, cache_policy=policy)
    total = capacity + 2 * rounds * num_keys  # the primary's blocks plus every scan's keys
    tier = ExampleSecondaryTierManager(
        None,  # type: ignore[arg-type]  # the example tier does not read the spec
        primary.get_kv_memoryview(),
        "example",
        capacity_blocks=total,
    )
    manager = TieringOffloadingManager(primary, [tier])
    try:
        keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(total)]
        writer = ReqContext("writer")
        manager.on_new_request(writer)
        # Stored in request-sized runs, oldest first: the tier holds them all, the primary the
        # last ``capacity``.
        for start in range(0, total, num_keys):
            run = keys[start : start + num_keys]
            manager.prepare_store(run, writer)
            manager.complete_store(run, writer)
            manager.on_schedule_end()
        for _ in range(3):
            manager.on_schedule_end()
        times: dict[str, list[float]] = {f"{s} {f}": [] for s in ("promote", "hit") for f in FORMS}
        gc.collect()
        gc.disable()
        try:
            for i in range(2 * rounds):
                form = FORMS[(i + i // 2) % 2]  # alternate which form goes first
                batch = keys[i * num_keys : (i + 1) * num_keys]  # only in the tier now
                ctx = ReqContext(f"req-{i}")
                manager.on_new_request(ctx)
                scan = SCANS[form]
                for what in ("promote", "hit"):
                    t0 = time.thread_time_ns()
                    n = scan(manager, batch, ctx)
                    elapsed = time.thread_time_ns() - t0
                    assert n == num_keys, f"{what}: {n} of {num_keys} keys"
                    times[f"{what} {form}"].append(elapsed / num_keys)
                    manager.on_schedule_end()  # submits the promotions
                    manager.on_schedule_end()  # applies their completion
                manager.on_request_finished(ctx)
        finally:
            gc.enable()
        return times
    finally:
        manager.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=4096, help="primary blocks (4096)")
    parser.add_argument("--keys", type=int, default=64, help="keys per scan (64)")
    parser.add_argument("--rounds", type=int, default=40, help="scans per form (40)")
    parser.add_argument("--policies", nargs="+", default=["lru", "arc"])
    args = parser.parse_args()
    print(
        f"prefix scans of {args.keys} keys, primary of {args.capacity} blocks, "
        f"{args.rounds} rounds per form; thread CPU per key, median over the rounds"
    )
    print(f"{'row':<12} {'scan':<8} {'lookup ns':>10} {'lookup_prefix ns':>17} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as workdir:
        for policy in args.policies:
            times = run_row(policy, args.capacity, args.keys, args.rounds, workdir)
            for what in ("promote", "hit"):
                one, batched = (statistics.median(times[f"{what} {f}"]) for f in FORMS)
                print(
                    f"{'tier+ex-' + policy:<12} {what:<8} {one:>10.0f} {batched:>17.0f} "
                    f"{one / batched:>6.2f}"
                )


if __name__ == "__main__":
    main()
