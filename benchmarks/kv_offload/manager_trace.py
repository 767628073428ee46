# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Trace mode of ``bench_manager.py``: the connector's per-step calls over a Zipf prefix trace.

Each row replays the same seeded trace (``traces.zipf_trace``: documents of Zipf popularity, each
request a document prefix plus a unique question) through one manager, making the manager calls
the offloading connector makes (``OffloadingConnectorScheduler``), step by step:

1. completions of the previous step's jobs (``update_connector_output``): ``complete_load`` of
   every load job, ``complete_store`` of every store job; then ``on_request_finished`` of the
   requests those jobs belonged to (each request runs for one step);
2. ``requests_per_step`` new requests, after the ones deferred by the previous step
   (``get_num_new_matched_tokens``): ``on_new_request`` at first sight, ``touch`` of all the
   request's keys, ``lookup`` of its keys until the first miss (going on past a None, as the
   connector does, so promotions start for every key that could hit), in one ``lookup_prefix``
   call where the manager has one (as the connector calls it). A None defers the request
   to the next step; otherwise its hits are pinned with ``prepare_load`` (a load job);
3. ``build_connector_meta``: ``prepare_store`` of each scheduled request's blocks after its hits
   (a store job if it returned keys), then ``on_schedule_end()``;
4. ``get_stats()``: the engine core collects the connector's statistics every step, and the
   connector's include the manager's.

Rows: ``cpu-lru`` and ``cpu-arc`` (``CPUOffloadingManager``), ``tier-lru`` (a tiering manager
with no secondary tier), ``tier+ex-lru`` and ``tier+ex-arc`` (a tiering manager with the in-memory
example tier, which really copies each row, and holds twice the primary's blocks). Reported per
row: requests and per-key manager operations per second of step time (a step's time includes the
driver's own bookkeeping inside it, the same for every row), the distribution of single step
times, the hit rate, and the full (gen 2) garbage collections that ran inside timed steps.

Clock: by default the CPU time of the replaying thread (``time.thread_time``), not the wall
clock: on a machine shared with other jobs, wall-clock step times mostly measure when the
scheduler let the process run (runs on a loaded 2-core box differed by 2-3x from one process to
the next). CPU time still counts every cost of the step itself, garbage collections and dict
resizes included; ``--wall-clock`` times steps by the wall clock instead. Ops/s are per second
of step time.

Garbage collection, as in a serving process: the manager is built, then the start-up heap is
frozen (``gc.freeze()``, as vLLM's engine core and ours do; ``--no-freeze`` skips it), then the
cache is filled and the trace replayed. A real engine keeps each request's objects alive while it
decodes, and those survivors are what triggers full collections; ``--request-objects N`` makes
every request allocate N small containers inside its step and keep them for ``--request-steps``
steps (default 0: none, for throughput runs). A full collection's pause is the traversal of every
tracked object not frozen, so it shows where per-block objects are created after start-up.

Only public manager calls are made, so the same script can time an older checkout of the
project: ``--against PATH`` runs this mode in child processes alternately on this checkout and on
``PATH`` (``PYTHONPATH`` set to each), round by round, and reports each row's ratio of medians.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from traces import Trace, zipf_trace

from vllm.v1.kv_offload.base import OffloadingManager, OffloadKey, ReqContext

ROWS = ("cpu-lru", "cpu-arc", "tier-lru", "tier+ex-lru", "tier+ex-arc")
ROW_BYTES = 4096
"""Bytes of one primary row in the tiering rows (one page: the example tier copies them)."""
EXAMPLE_CAPACITY_FACTOR = 2
"""The example tier holds this many times the primary's blocks."""


@dataclass
class RowResult:
    """One row of one run."""

    row: str
    requests_per_step: int
    capacity: int
    seconds: float
    """Time inside the steps (the clock's: CPU time of this thread by default)."""
    wall_seconds: float
    """Wall-clock time of the whole replay (driver included), for context."""
    requests: int
    key_ops: int
    hits: int
    lookups: int
    step_ms: list[float] = field(default_factory=list)
    gc_steps: list[int] = field(default_factory=list)
    """Indices of the steps inside which a full collection ran."""
    full_gcs: int = 0
    full_gc_ms_max: float = 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds

    @property
    def key_ops_per_s(self) -> float:
        return self.key_ops / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.step_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class ManagerAPI:
    """How the driver talks to a manager: this project's API by default.

    Attributes:
        hit: what ``lookup`` returns for a readable block.
        miss: what it returns for an absent block (anything else: not readable yet).
        new_context: builds a request's context from its id.
        schedule_end: given the manager, the call that ends a step.
    """

    hit: object = True
    miss: object = False
    new_context: Callable[[str], Any] = ReqContext
    schedule_end: Callable[[Any], Callable[[], None]] = lambda m: m.on_schedule_end


class _GCWatch:
    """Counts the full collections that start and end while ``armed``, and their longest."""

    def __init__(self) -> None:
        self.armed = False
        self.in_step = False
        self.count = 0
        self.longest = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self.armed:
            self.count += 1
            self.in_step = True
            self.longest = max(self.longest, time.perf_counter() - self._start)


def build_manager(
    row: str, capacity: int, workdir: str
) -> tuple[OffloadingManager, Callable[[], None]]:
    """The row's manager and a function that shuts it down."""
    policy = row.rsplit("-", 1)[1]
    if row.startswith("cpu-"):
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        manager: OffloadingManager = CPUOffloadingManager(capacity, cache_policy=policy)
        return manager, manager.shutdown
    from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    region = SharedOffloadRegion(
        f"bench-trace-{os.getpid()}-{row.replace('+', '_')}", capacity, ROW_BYTES, directory=workdir
    )
    primary = CPUPrimaryTierOffloadingManager(capacity, region, cache_policy=policy)
    tiers = []
    if "+ex" in row:
        # No spec: the example tier does not read it.
        # Bounded (twice the primary), so a long replay keeps its memory bounded too.
        example = ExampleSecondaryTierManager(
            None,  # type: ignore[arg-type]
            primary.get_kv_memoryview(),
            "example",
            capacity_blocks=EXAMPLE_CAPACITY_FACTOR * capacity,
        )
        tiers.append(example)
    tiering = TieringOffloadingManager(primary, tiers)
    return tiering, tiering.shutdown


def replay(
    manager: OffloadingManager,
    trace: Trace,
    requests_per_step: int,
    watch: _GCWatch,
    request_objects: int = 0,
    request_steps: int = 32,
    clock: Callable[[], float] = time.thread_time,
    api: ManagerAPI | None = None,
) -> RowResult:
    """Replay ``trace`` step by step (see the module docstring); time every step with ``clock``.

    ``api`` adapts the driver to a manager with another ``lookup`` result type or
    ``on_schedule_end`` signature (default: this project's).
    """
    api = api or ManagerAPI()
    hit, miss = api.hit, api.miss
    new_context = api.new_context
    on_schedule_end = api.schedule_end(manager)
    survivors: deque[list[Any]] = deque()
    lookup = manager.lookup
    # The connector scans a prefix in one call where the manager has it (this project's API
    # since lookup_prefix; another tree's or upstream's managers are asked key by key).
    lookup_prefix = getattr(manager, "lookup_prefix", None) if hit is True else None
    get_stats = manager.get_stats
    requests = trace.requests
    next_request = 0
    waiting: list[tuple[tuple[OffloadKey, ...], ReqContext]] = []
    loads: list[tuple[tuple[OffloadKey, ...], ReqContext]] = []
    stores: list[tuple[list[OffloadKey], ReqContext]] = []
    finishing: list[ReqContext] = []
    step_ms: list[float] = []
    gc_steps: list[int] = []
    key_ops = hits = lookups = 0
    done = 0
    perf_counter = clock
    gc_count0 = watch.count
    watch.armed = True
    t_start = time.perf_counter()
    while done < len(requests):
        # The trace's requests for this step are taken before the clock starts.
        batch = waiting
        waiting = []
        take = min(requests_per_step, len(requests) - next_request)
        fresh = [
            (r.lookup, new_context(f"req-{next_request + i}"))
            for i, r in enumerate(requests[next_request : next_request + take])
        ]
        next_request += take
        watch.in_step = False
        t0 = perf_counter()
        for keys, ctx in loads:
            manager.complete_load(keys, ctx)
            key_ops += len(keys)
        for stored, ctx in stores:
            manager.complete_store(stored, ctx)
            key_ops += len(stored)
        for ctx in finishing:
            manager.on_request_finished(ctx)
        done += len(finishing)
        loads = []
        stores = []
        finishing = []
        scheduled: list[tuple[tuple[OffloadKey, ...], int, ReqContext]] = []
        for _, ctx in fresh:
            manager.on_new_request(ctx)
        if request_objects:
            # The engine's per-request objects, alive while the request decodes.
            survivors.append([[{"n": i}] for i in range(request_objects * len(fresh) // 2)])
            if len(survivors) > request_steps:
                survivors.popleft()
        for keys, ctx in batch + fresh:
            manager.touch(keys, ctx)
            if lookup_prefix is not None:
                results = lookup_prefix(keys, ctx)
                n = len(results) - 1 if results and results[-1] is miss else len(results)
                deferred = None in results
            else:
                n = 0
                deferred = False
                for key in keys:
                    result = lookup(key, ctx)
                    if result is miss:
                        break
                    if result is not hit:  # not readable yet
                        deferred = True
                    n += 1
            key_ops += len(keys) + n + 1
            if deferred:
                waiting.append((keys, ctx))
                continue
            if n:
                hit_keys = keys[:n]
                manager.prepare_load(hit_keys, ctx)
                loads.append((hit_keys, ctx))
                key_ops += n
            hits += n
            lookups += len(keys)
            scheduled.append((keys, n, ctx))
        for keys, n, ctx in scheduled:
            out = manager.prepare_store(keys[n:], ctx)
            key_ops += len(keys) - n
            if out is not None and out.keys_to_store:
                stores.append((out.keys_to_store, ctx))
            finishing.append(ctx)
        on_schedule_end()
        get_stats()
        step_ms.append((perf_counter() - t0) * 1e3)
        if watch.in_step:
            gc_steps.append(len(step_ms) - 1)
    wall_seconds = time.perf_counter() - t_start
    watch.armed = False
    return RowResult(
        row="",
        requests_per_step=requests_per_step,
        capacity=0,
        seconds=sum(step_ms) / 1e3,
        wall_seconds=wall_seconds,
        requests=len(requests),
        key_ops=key_ops,
        hits=hits,
        lookups=lookups,
        step_ms=step_ms,
        gc_steps=gc_steps,
        full_gcs=watch.count - gc_count0,
    )


def prefill(manager: OffloadingManager, n: int, seed: int, api: ManagerAPI | None = None) -> None:
    """Fill the cache with ``n`` one-off blocks first, so that the replay runs on a full cache."""
    api = api or ManagerAPI()
    on_schedule_end = api.schedule_end(manager)
    ctx = api.new_context("prefill")
    manager.on_new_request(ctx)
    for start in range(0, n, 4096):
        keys = [
            (seed.to_bytes(4, "big") + i.to_bytes(8, "big") + bytes(4))  # type: ignore[misc]
            for i in range(start, min(n, start + 4096))
        ]
        out = manager.prepare_store(keys, ctx)  # type: ignore[arg-type]
        assert out is not None
        if out.keys_to_store:
            manager.complete_store(out.keys_to_store, ctx)
        on_schedule_end()
    manager.on_request_finished(ctx)
    on_schedule_end()


def run_rows(
    rows: Sequence[str],
    requests_per_step: Sequence[int],
    capacity: int,
    num_steps: int,
    seed: int,
    freeze: bool = True,
    request_objects: int = 0,
    request_steps: int = 32,
    wall_clock: bool = False,
) -> list[RowResult]:
    """Every row at every batch size, in this process; returns the results in that order."""
    watch = _GCWatch()
    gc.callbacks.append(watch)
    results: list[RowResult] = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench-trace-", dir="/dev/shm") as workdir:
            for rps in requests_per_step:
                trace = zipf_trace(num_steps * rps, num_docs=2_000, seed=seed)
                for row in rows:
                    manager, close = build_manager(row, capacity, workdir)
                    gc.collect()
                    if freeze:  # the end of start-up
                        gc.freeze()
                    try:
                        prefill(manager, capacity, seed)
                        result = replay(
                            manager,
                            trace,
                            rps,
                            watch,
                            request_objects,
                            request_steps,
                            time.perf_counter if wall_clock else time.thread_time,
                        )
                    finally:
                        gc.unfreeze()
                        close()
                    result.row = row
                    result.capacity = capacity
                    result.full_gc_ms_max = watch.longest * 1e3
                    watch.longest = 0.0
                    results.append(result)
    finally:
        gc.callbacks.remove(watch)
    return results


def gc_pause_main(rows: Sequence[str], capacities: Sequence[int]) -> None:
    """``--gc-pause``: what one full collection costs once a row's cache is full.

    As in a serving process: build the manager, freeze the start-up heap, then fill the cache
    (twice its capacity in one-off blocks) and time ``gc.collect()`` (best of 5). Whatever the
    manager created after start-up is what the collection traverses.
    """
    header = f"{'row':<12} {'blocks':>9} {'build ms':>9} {'full GC ms':>10} {'tracked objects':>16}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="bench-gc-", dir="/dev/shm") as workdir:
        for row in rows:
            for capacity in capacities:
                t0 = time.perf_counter()
                manager, close = build_manager(row, capacity, workdir)
                build_ms = (time.perf_counter() - t0) * 1e3
                gc.collect()
                gc.freeze()
                try:
                    prefill(manager, 2 * capacity, 0)
                    best = float("inf")
                    for _ in range(5):
                        t0 = time.perf_counter()
                        gc.collect()
                        best = min(best, time.perf_counter() - t0)
                    visible = len(gc.get_objects())
                finally:
                    gc.unfreeze()
                    close()
                print(
                    f"{row:<12} {capacity:>9,} {build_ms:>9.0f} {best * 1e3:>10.1f} {visible:>16,}"
                )


def _print_table(title: str, results: Sequence[RowResult]) -> None:
    print(title)
    header = (
        f"{'row':<12} {'req/step':>8} {'blocks':>8} {'req/s':>9} {'key-ops/s':>10} "
        f"{'step med ms':>11} {'p99 ms':>8} {'max ms':>8} {'hit rate':>8} {'full GCs':>8} "
        f"{'GC max ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.row:<12} {r.requests_per_step:>8} {r.capacity:>8} {r.requests_per_s:>9.0f} "
            f"{r.key_ops_per_s:>10.0f} {statistics.median(r.step_ms):>11.2f} "
            f"{r.pct(0.99):>8.2f} {max(r.step_ms):>8.2f} {r.hits / max(1, r.lookups):>8.3f} "
            f"{r.full_gcs:>8} {r.full_gc_ms_max:>9.1f}"
        )


def trace_main(args: Any) -> None:
    """``bench_manager.py --trace``: run here, or alternate with ``--against`` checkouts."""
    rows = args.rows
    if args.against is None:
        results = run_rows(
            rows,
            args.requests_per_step,
            args.trace_capacity,
            args.trace_steps,
            0,
            freeze=not args.no_freeze,
            request_objects=args.request_objects,
            request_steps=args.request_steps,
            wall_clock=args.wall_clock,
        )
        if args.json:
            print(json.dumps([asdict(r) for r in results]))
            return
        _print_table(f"trace mode, {args.trace_capacity:,} blocks", results)
        return

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sides = {"this": here, "against": os.path.abspath(args.against)}
    script = os.path.abspath(sys.argv[0])
    runs: dict[str, list[list[dict[str, Any]]]] = {"this": [], "against": []}
    for round_idx in range(args.rounds):
        order = ("against", "this") if round_idx % 2 else ("this", "against")
        for side in order:
            cmd = [
                sys.executable,
                script,
                "--trace",
                "--json",
                "--trace-capacity",
                str(args.trace_capacity),
                "--trace-steps",
                str(args.trace_steps),
                "--rows",
                *rows,
                "--requests-per-step",
                *map(str, args.requests_per_step),
                "--request-objects",
                str(args.request_objects),
                "--request-steps",
                str(args.request_steps),
                *(["--no-freeze"] if args.no_freeze else []),
                *(["--wall-clock"] if args.wall_clock else []),
            ]
            env = {**os.environ, "PYTHONPATH": sides[side]}
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {round_idx + 1}/{args.rounds}: {side} done", flush=True)
    print(
        f"\n{args.rounds} interleaved rounds; 'this' = {sides['this']}, "
        f"'against' = {sides['against']}; medians over rounds\n"
    )
    header = (
        f"{'row':<12} {'req/step':>8} {'req/s this':>10} {'req/s base':>10} {'ratio':>6} "
        f"{'med ms':>13} {'p99 ms':>15} {'max ms':>15} {'full GCs':>9} {'GC max ms':>11} "
        f"{'hit rate':>11}"
    )
    print(header)
    print("-" * len(header))
    for i, base_row in enumerate(runs["this"][0]):

        def med(side: str, fn: Callable[[RowResult], float], i: int = i) -> float:
            return statistics.median(fn(RowResult(**run[i])) for run in runs[side])

        this_rps = med("this", lambda r: r.requests_per_s)
        base_rps = med("against", lambda r: r.requests_per_s)
        cells = []
        for fn in (
            lambda r: statistics.median(r.step_ms),
            lambda r: r.pct(0.99),
            lambda r: max(r.step_ms),
        ):
            cells.append(f"{med('this', fn):>6.1f}/{med('against', fn):<6.1f}")
        gcs_this = med("this", lambda r: r.full_gcs)
        gcs = f"{gcs_this:>3.0f}/{med('against', lambda r: r.full_gcs):<3.0f}"
        gc_max = (
            f"{med('this', lambda r: r.full_gc_ms_max):>5.1f}/"
            f"{med('against', lambda r: r.full_gc_ms_max):<5.1f}"
        )
        rate = (
            f"{med('this', lambda r: r.hits / max(1, r.lookups)):.3f}/"
            f"{med('against', lambda r: r.hits / max(1, r.lookups)):.3f}"
        )
        print(
            f"{base_row['row']:<12} {base_row['requests_per_step']:>8} {this_rps:>10.0f} "
            f"{base_rps:>10.0f} {this_rps / base_rps:>6.2f} {cells[0]:>13} {cells[1]:>15} "
            f"{cells[2]:>15} {gcs:>9} {gc_max:>11} {rate:>11}"
        )
