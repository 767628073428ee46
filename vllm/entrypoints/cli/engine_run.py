# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""One engine run in this process: the engine behind its front end, and what it measured.

``EngineRun`` owns one run of one engine (the baseline or the offloaded run; the single-engine
command's, or a fleet instance's): it builds the ``EngineCore`` from the run's config
(``engine_config``), puts it behind the asyncio front end ``AsyncLLM``, counts what the fs tier
holds before the first request, and at the end waits for every transfer and fills the run's
``RunResult``. What the clients do with the front end is the caller's (``run.py``,
``fleet_instance.py``).

What a run measured is read from the engine here: ``StepSampler`` samples the engine's counters
after every busy step (for the plot and the per-step overhead); ``snapshot_engine`` copies the
counters, connector statistics and tier reports on the engine thread before the engine shuts
down, and ``fill_result`` turns that snapshot into the ``RunResult``'s figures. A new figure
read from the engine is a line in ``fill_result`` (and a field in ``report/figures.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from vllm.distributed.kv_events import KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.entrypoints.cli.config import FS_TIER_TYPE, REDIS_TIER_TYPE, RunConfig
from vllm.entrypoints.cli.metrics_server import EngineMetrics
from vllm.entrypoints.cli.report.figures import (
    TTFT_PARTS,
    Direction,
    FsTierState,
    RunResult,
    StepSample,
    Tier,
    TransferFigures,
)
from vllm.entrypoints.cli.thread_cpu import ThreadCpuWindow, runqueue_wait_s
from vllm.entrypoints.router.measured_costs import MeasuredCosts
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.config import EngineConfig, default_instance_id
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.scheduler import RequestOutput
from vllm.v1.engine.verification import BlockKey
from vllm.v1.kv_offload.base import TierStats

IDLE_TIMEOUT_S = 600.0
"""Longest wait for in-flight transfers after the last output before the run gives up."""
SCAN_TIMEOUT_S = 120.0
"""Longest wait for the fs tier's start-up scan (it only counts what is already on disk)."""

GPU_DIRECTIONS = {"GPU_to_CPU": Direction.GPU_TO_CPU, "CPU_to_GPU": Direction.CPU_TO_GPU}
_TRANSFER_BYTES = "vllm:kv_offload_transfer_bytes"
# Per secondary tier: its type name, its directions (store, promote), the name of its counter
# of blocks stored, and those of its failed blocks per direction (the redis tier counts the
# blocks of its failed jobs, whatever failed them: dropped, refused at maxmemory, unreachable).
SECONDARY_TIERS = (
    (
        FS_TIER_TYPE,
        Direction.CPU_TO_FS,
        Direction.FS_TO_CPU,
        "blocks_written",
        ("store_failures",),
        ("load_failures", "corrupt_removed"),
    ),
    (
        REDIS_TIER_TYPE,
        Direction.CPU_TO_REDIS,
        Direction.REDIS_TO_CPU,
        "blocks_written",
        ("store_failed_blocks",),
        ("load_failed_blocks",),
    ),
)
CORRUPT_COUNTERS = ("corrupt_removed", "forged_removed", "unauthenticated_removed")
"""Counters of blocks a tier found invalid (damaged, or, with a fleet secret, not authentic)."""


def engine_config(
    config: RunConfig,
    offload: bool,
    instance_id: str | None = None,
    kv_events: bool = False,
) -> EngineConfig:
    """The engine settings of one run: the config's engine, with the connector when offloading.

    Args:
        config: the invocation's settings.
        offload: with the offloading connector and its tiers (else the baseline).
        instance_id: names the CPU tier's shared region (default: fresh, unique per process).
        kv_events: whether the engine collects KV events: only when something receives them
            (as vLLM collects them only when ``kv_events_config`` enables them), so that
            neither the GPU prefix cache nor the offload tiers record an event per block for
            nothing.
    """
    return dataclasses.replace(
        config.engine,
        kv_connector_extra_config=config.tiers.connector_config() if offload else None,
        instance_id=instance_id or default_instance_id(),
        enable_kv_events=kv_events,
    )


def secondary_tokens(total: int, by_tier: Mapping[str, int]) -> dict[str, int]:
    """Promoted tokens by ``Tier`` value: the redis tier's, and the fs tier's (the rest).

    Args:
        total: ``EngineStats.tokens_from_secondary``.
        by_tier: ``EngineStats.tokens_from_tier`` (by registered tier type).

    Tokens whose tier the manager did not name count as the fs tier's, so that the two add up
    to ``total`` (the accounting invariant).
    """
    redis = by_tier.get(REDIS_TIER_TYPE, 0)
    return {Tier.FS.value: total - redis, Tier.REDIS.value: redis}


def fs_tier_stats(engine: EngineCore, tier_type: str = FS_TIER_TYPE) -> TierStats | None:
    """The report of the engine's tier ``tier_type`` (``EngineCore.tier_stats``), if any."""
    return next((s for s in engine.tier_stats() if s.tier_type == tier_type), None)


@dataclass
class StepSampler:
    """Step callback (engine thread): one ``StepSample`` and overhead figures per busy step.

    Steps that scheduled no token and moved nothing (the front end polling for transfers) are
    not sampled, so they neither flood the plot nor dilute the per-step overhead.

    Attributes:
        t0: ``time.monotonic()`` at the start of the run.
        samples: the samples so far.
        overhead_us: scheduler-side connector + manager time per busy step (microseconds).
        worker_overhead_us: worker-side connector time per busy step (microseconds).
        thread_cpu_us, worker_thread_cpu_us: the same steps' thread CPU time of the two sides
            (microseconds).
        tokens_per_block: tokens of an offloaded block (0: costs are not read).
        measured_costs: the last costs the connector's load guard published (None: none yet,
            or no guard); a fleet instance reports them to the router.
    """

    t0: float
    tokens_per_block: int = 0
    measured_costs: MeasuredCosts | None = None
    samples: list[StepSample] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)
    worker_overhead_us: list[float] = field(default_factory=list)
    thread_cpu_us: list[float] = field(default_factory=list)
    worker_thread_cpu_us: list[float] = field(default_factory=list)

    def __call__(self, engine: EngineCore, outputs: list[RequestOutput]) -> None:
        stats = engine.stats
        record = stats.step_records[-1] if stats.step_records else None
        moved = dict.fromkeys((d.value for d in Direction), 0)
        if record is not None:
            for name, n in record.bytes_moved.items():
                direction = GPU_DIRECTIONS.get(name)
                if direction is not None:
                    moved[direction.value] += n
        # The CPU <-> tier bytes of this step are in the connector's stats the engine collected
        # this step (from the tiers' counters): the tiers are not asked a second time.
        kv = engine.step_kv_connector_stats
        if isinstance(kv, OffloadingConnectorStats):
            if self.tokens_per_block:
                measured = MeasuredCosts.from_connector_stats(
                    kv, self.tokens_per_block, (REDIS_TIER_TYPE,)
                )
                if measured is not None:
                    self.measured_costs = measured
            for tier_type, store, promote, _, _, _ in SECONDARY_TIERS:
                for direction, transfer in (
                    (store, f"CPU_to_{tier_type}"),
                    (promote, f"{tier_type}_to_CPU"),
                ):
                    moved[direction.value] = int(kv.get(_TRANSFER_BYTES, (transfer,)) or 0)
        busy = record is not None and record.num_scheduled_tokens > 0
        if not busy and not any(moved.values()) and not outputs:
            return
        if busy and record is not None:
            self.overhead_us.append(record.connector_seconds * 1e6)
            self.worker_overhead_us.append(record.worker_connector_seconds * 1e6)
            self.thread_cpu_us.append(record.connector_cpu_seconds * 1e6)
            self.worker_thread_cpu_us.append(record.worker_connector_cpu_seconds * 1e6)
        self.samples.append(
            StepSample(
                t_s=time.monotonic() - self.t0,
                tokens={
                    "computed": stats.prompt_tokens_computed,
                    Tier.GPU.value: stats.tokens_from_gpu_cache,
                    Tier.CPU.value: stats.tokens_from_cpu,
                    **secondary_tokens(stats.tokens_from_secondary, stats.tokens_from_tier),
                },
                bytes_moved=moved,
            )
        )


@dataclass(frozen=True)
class _EngineClocks:
    """The engine thread's clocks at one instant, read on the engine thread: wall
    (``time.monotonic``), its own CPU time (``time.thread_time``: not the tiers' threads'), its
    sleep between steps (``EngineStats.idle_wait_seconds``) and its wait for a core so far
    (``runqueue_wait_s``; None where the kernel does not say)."""

    wall: float
    cpu: float
    idle: float
    runqueue_wait: float | None


def _engine_clocks(engine: EngineCore) -> _EngineClocks:
    return _EngineClocks(
        time.monotonic(), time.thread_time(), engine.stats.idle_wait_seconds, runqueue_wait_s()
    )


def _verify_timed(engine: EngineCore, reference: Mapping[BlockKey, bytes] | None) -> float:
    # Engine thread, after the timed window: the checks, and the CPU time they took.
    start = time.thread_time()
    engine.verify_kv(reference)
    return time.thread_time() - start


def fs_usage_after_scan(engine: EngineCore) -> tuple[int, int]:
    # Engine thread, before the first request: (blocks, bytes) the fs tier found on disk.
    if not engine.wait_for_tiers_ready(SCAN_TIMEOUT_S):
        return 0, 0
    fs = fs_tier_stats(engine)
    if fs is None:
        return 0, 0
    return fs.num_blocks, fs.used_bytes


@dataclass(frozen=True)
class EngineSnapshot:
    """What the report needs of an engine, copied on its thread before it shuts down.

    Attributes:
        engine_stats: the engine's ``EngineStats``.
        connector: the connector's statistics (``EngineCore.connector_stats``).
        tiers: each secondary tier's report, by tier type.
        stored_keys: keys of the blocks this engine stored from its GPU pool.
    """

    engine_stats: Any
    connector: dict[str, int | float]
    tiers: dict[str, TierStats]
    stored_keys: frozenset[bytes]


def snapshot_engine(engine: EngineCore) -> EngineSnapshot:
    # Engine thread: copy everything the report needs before the engine shuts down.
    stored = engine.connector.stored_keys() if engine.connector else None
    return EngineSnapshot(
        engine_stats=engine.stats,
        connector=dict(engine.connector_stats()),
        tiers={t.tier_type: t for t in engine.tier_stats()},
        stored_keys=frozenset(stored or ()),
    )


def fill_result(result: RunResult, snap: EngineSnapshot) -> None:
    """Fill ``result``'s figures from the engine's snapshot (the tiers ``result`` names)."""
    s = snap.engine_stats
    result.num_finished = s.requests_finished - s.requests_aborted
    result.prompt_tokens = s.prompt_tokens
    result.computed_tokens = s.prompt_tokens_computed
    secondary = secondary_tokens(s.tokens_from_secondary, s.tokens_from_tier)
    result.served = {
        Tier.GPU: s.tokens_from_gpu_cache,
        Tier.CPU: s.tokens_from_cpu,
        **{t: secondary[t.value] for t in (Tier.FS, Tier.REDIS)},
    }
    # Tiers are consulted in order: a tier only sees the tokens every faster tier missed.
    past_cpu = s.prompt_tokens - s.tokens_from_gpu_cache - s.tokens_from_cpu
    has_fs = result.fs is not None
    result.lookup_tokens = {
        Tier.GPU: s.prompt_tokens,
        Tier.CPU: s.prompt_tokens - s.tokens_from_gpu_cache if result.offload else 0,
        Tier.FS: past_cpu if has_fs else 0,
        Tier.REDIS: (past_cpu - result.served[Tier.FS] if result.redis_url is not None else 0),
    }
    result.blocks_verified_from_redis = s.blocks_verified_by_tier.get(REDIS_TIER_TYPE, 0)
    result.output_tokens = s.output_tokens
    result.steps = s.steps - s.idle_steps
    result.preemptions = s.preemptions
    result.blocks_verified = s.blocks_loaded_verified
    result.blocks_checked = s.blocks_verified
    result.blocks_mismatched = s.verification_failures
    result.verify_s = s.verify_seconds
    result.ttft_parts_ms = {
        name: [parts[i] * 1e3 for parts in s.ttft_parts] for i, name in enumerate(TTFT_PARTS)
    }
    result.failed_loads = int(snap.connector.get("failed_load_blocks", 0))
    c = snap.connector
    result.lookup_deferred_requests = int(c.get("deferred_lookup_requests", 0))
    result.transfer_wait_requests = int(c.get("transfer_wait_requests", 0))
    guard = {k.removeprefix("load_guard."): v for k, v in c.items() if k.startswith("load_guard.")}
    result.load_guard = guard or None  # the guard always reports its step cost when on
    for name, direction in GPU_DIRECTIONS.items():
        blocks_key = "store_blocks" if direction is Direction.GPU_TO_CPU else "load_blocks"
        failed_key = f"failed_{blocks_key}"
        result.transfers[direction] = TransferFigures(
            blocks=int(c.get(blocks_key, 0)) - int(c.get(failed_key, 0)),
            bytes=int(c.get(f"transfer.{name}.bytes", 0)),
            busy_s=float(c.get(f"transfer.{name}.seconds", 0.0)),
            failed_blocks=int(c.get(failed_key, 0)),
        )
    for tier_type, store, promote, stored_counter, store_failed, load_failed in SECONDARY_TIERS:
        tier = snap.tiers.get(tier_type)
        if tier is None:
            continue
        tc = tier.counters
        timed = "store_busy_us" in tc  # the redis tier does not time its I/O
        result.lookup_deferred_requests_by_tier[tier_type] = tc.get("lookup_deferred_requests", 0)
        result.transfers[store] = TransferFigures(
            blocks=tc.get(stored_counter, 0),
            bytes=tc.get(stored_counter, 0) * tier.block_bytes,
            busy_s=tc.get("store_busy_us", 0) / 1e6 if timed else None,
            failed_blocks=sum(tc.get(name, 0) for name in store_failed),
            skipped_blocks=tc.get("blocks_skipped", 0),
            jobs=tc.get("store_jobs"),
            failed_jobs=tc.get("store_jobs_failed", 0),
        )
        result.transfers[promote] = TransferFigures(
            blocks=tc.get("blocks_loaded", 0),
            bytes=tc.get("blocks_loaded", 0) * tier.block_bytes,
            busy_s=tc.get("load_busy_us", 0) / 1e6 if timed else None,
            failed_blocks=sum(tc.get(name, 0) for name in load_failed),
            jobs=tc.get("load_jobs"),
            failed_jobs=tc.get("load_jobs_failed", 0),
            served_bytes=s.bytes_from_tier.get(tier_type, 0),
        )
        result.corrupt_blocks_detected += sum(tc.get(name, 0) for name in CORRUPT_COUNTERS)
        if (
            tier_type == REDIS_TIER_TYPE
            and tc.get("server_answers", 1) == 0
            and tc.get("breaker_trips", 0)
        ):
            # Cut off, and not one round trip answered: down, or refusing the credentials.
            result.redis_down = (
                "authentication failed" if tc.get("auth_failures", 0) else "server unreachable"
            )
        if tier_type == FS_TIER_TYPE and result.fs is not None:
            result.fs.files_at_end = tier.num_blocks
            result.fs.bytes_at_end = tier.used_bytes


class EngineRun:
    """One run of one engine in this process, as an ``async with`` block (see the module
    docstring). Event-loop thread only; the engine itself runs on the front end's thread.

    On entry the engine is started behind its front end (``llm``) and the fs tier's start-up
    scan has counted what is on disk (``result.fs``); ``finish`` ends the run; on exit the
    engine, its tiers and its shared region are shut down.

    Args:
        config: the invocation's settings.
        offload: with the offloading connector and its tiers (else the baseline).
        instance_id: names the CPU tier's shared region (default: fresh, unique per process).
        metrics: fed the run's metrics, labelled with the run (``--metrics-port``).
        event_sink: receives the engine's KV event batches (the instance's publisher's
            ``publish``, which outlives the run: ``fleet_events.py``). Without one the engine
            collects no KV events.
    """

    def __init__(
        self,
        config: RunConfig,
        offload: bool,
        instance_id: str | None = None,
        metrics: EngineMetrics | None = None,
        event_sink: Callable[[KVEventBatch], None] | None = None,
    ) -> None:
        self.label = "offload" if offload else "baseline"
        self.result = RunResult(label=self.label, offload=offload)
        tiers = config.tiers
        if offload and tiers.redis is not None:
            self.result.redis_url = tiers.redis.shown_url()
        if offload and tiers.fs is not None:
            self.result.fs = FsTierState(root_dir=str(tiers.fs.root), max_bytes=tiers.fs.max_bytes)
        self.sampler = StepSampler(t0=time.monotonic(), tokens_per_block=tiers.block_size)
        self._metrics = metrics
        self._clocks_at_start = _EngineClocks(0.0, 0.0, 0.0, None)
        self._threads = ThreadCpuWindow()
        self.digests: dict[BlockKey, bytes] = {}
        """Digests of every block the run computed (after ``finish``): another run's reference."""
        engine = EngineCore(
            engine_config(config, offload, instance_id, kv_events=event_sink is not None),
            event_sink=event_sink,
        )
        self.result.verify_mode = engine.config.verify.value
        callback: Callable[[EngineCore, list[Any]], None] = self.sampler
        if metrics is not None:
            callback = metrics.attach(engine, self.label, self.sampler)
        # From here on the engine belongs to the front end's thread (and is shut down by it).
        self.llm = AsyncLLM(engine, step_callback=callback)

    async def __aenter__(self) -> EngineRun:
        await self.llm.__aenter__()
        try:
            if self.result.fs is not None:
                # Only to report what was on disk before the run: the tier serves during its scan.
                files, size = await self.llm.call(fs_usage_after_scan)
                self.result.fs.files_at_start, self.result.fs.bytes_at_start = files, size
        except BaseException as e:
            await self.llm.__aexit__(type(e), e, e.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.llm.__aexit__(exc_type, exc, tb)

    async def start_window(self) -> None:
        """The timed window starts: note the engine thread's CPU time, and every thread's."""
        self._clocks_at_start = await self.llm.call(_engine_clocks)
        self._threads.start()

    async def finish(self, reference: Mapping[BlockKey, bytes] | None = None) -> EngineSnapshot:
        """After the last output (the end of the timed window): note the engine thread's CPU
        time, wait for every transfer (cascades to the fs tier included, so the next invocation
        over the same root starts warm), check what the oracle recorded against ``reference``
        (``EngineCore.verify_kv``: e.g. the baseline's ``digests``), keep this run's
        ``digests``, then fill ``result``.

        Raises:
            RuntimeError: transfers were still in flight ``IDLE_TIMEOUT_S`` after the last output.
        """
        end = await self.llm.call(_engine_clocks)
        self._threads.stop()
        start = self._clocks_at_start
        cpu, idle = end.cpu - start.cpu, end.idle - start.idle
        self.result.engine_thread_cpu_s = cpu
        self.result.engine_thread_idle_s = idle
        if start.runqueue_wait is not None and end.runqueue_wait is not None:
            wait = end.runqueue_wait - start.runqueue_wait
            self.result.engine_thread_runqueue_wait_s = wait
            # The rest of the window the thread slept inside the steps: on the GIL, a lock, I/O.
            rest = end.wall - start.wall - cpu - idle - wait
            self.result.engine_thread_blocked_s = max(rest, 0.0)
        self.result.cpu_s_by_component = dict(self._threads.by_component)
        try:
            await asyncio.wait_for(self.llm.wait_until_idle(), IDLE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"{self.label} run: transfers still in flight {IDLE_TIMEOUT_S:.0f} s after the "
                "last output"
            ) from None
        self.result.verify_cpu_s = await self.llm.call(lambda e: _verify_timed(e, reference))
        self.digests = await self.llm.call(lambda e: e.computed_block_digests())
        metrics = self._metrics
        if metrics is not None:
            await self.llm.call(lambda e: metrics.flush(e, self.label))
        snapshot = await self.llm.call(snapshot_engine)
        result = self.result
        result.samples = self.sampler.samples
        result.overhead_us = self.sampler.overhead_us
        result.worker_overhead_us = self.sampler.worker_overhead_us
        result.connector_thread_cpu_us = self.sampler.thread_cpu_us
        result.worker_connector_thread_cpu_us = self.sampler.worker_thread_cpu_us
        fill_result(result, snapshot)
        result.check_accounting()
        return snapshot
