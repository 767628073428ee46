# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What one run of ``vllm-kv-offload run`` measured, read from its engine.

``StepSampler`` samples the engine's counters after every busy step (for the plot and the
per-step overhead); ``snapshot_engine`` copies the counters, connector statistics and tier
reports on the engine thread before the engine shuts down, and ``fill_result`` turns that
snapshot into a ``RunResult``'s figures. Used by ``run.py`` and by a fleet's instances
(``fleet_instance.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.entrypoints.cli.options import RunOptions
from vllm.entrypoints.cli.report import (
    Direction,
    RunResult,
    StepSample,
    Tier,
    TransferFigures,
    secondary_tokens,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.scheduler import RequestOutput
from vllm.v1.kv_offload.base import TierStats

FS_TIER_TYPE = "fs"
"""Registered type name of the filesystem tier (``secondary_tiers[i]["type"]``)."""
REDIS_TIER_TYPE = "redis"
"""Registered type name of the redis tier."""
SCAN_TIMEOUT_S = 120.0
"""Longest wait for the fs tier's start-up scan (it only counts what is already on disk)."""

GPU_DIRECTIONS = {"GPU_to_CPU": Direction.GPU_TO_CPU, "CPU_to_GPU": Direction.CPU_TO_GPU}
# Per secondary tier: its type name, its directions (store, promote), the name of its counter
# of blocks stored, and those of its failed blocks per direction (the redis tier counts failed
# jobs apart: blocks it dropped at once, or found gone or invalid, are its per-block figures).
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
        ("stores_dropped",),
        ("server_misses", "corrupt_removed"),
    ),
)


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
    """

    t0: float
    samples: list[StepSample] = field(default_factory=list)
    overhead_us: list[float] = field(default_factory=list)
    worker_overhead_us: list[float] = field(default_factory=list)
    # Per secondary tier type: (blocks written, blocks loaded) at the previous sample.
    _tier_blocks: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __call__(self, engine: EngineCore, outputs: list[RequestOutput]) -> None:
        stats = engine.stats
        record = stats.step_records[-1] if stats.step_records else None
        moved = dict.fromkeys((d.value for d in Direction), 0)
        if record is not None:
            for name, n in record.bytes_moved.items():
                direction = GPU_DIRECTIONS.get(name)
                if direction is not None:
                    moved[direction.value] += n
        for tier in engine.tier_stats():  # their counters give the CPU <-> tier bytes
            for tier_type, store, promote, stored_counter, _, _ in SECONDARY_TIERS:
                if tier.tier_type != tier_type:
                    continue
                c = tier.counters
                written, loaded = c.get(stored_counter, 0), c.get("blocks_loaded", 0)
                last_written, last_loaded = self._tier_blocks.get(tier_type, (0, 0))
                moved[store.value] = (written - last_written) * tier.block_bytes
                moved[promote.value] = (loaded - last_loaded) * tier.block_bytes
                self._tier_blocks[tier_type] = (written, loaded)
        busy = record is not None and record.num_scheduled_tokens > 0
        if not busy and not any(moved.values()) and not outputs:
            return
        if busy and record is not None:
            self.overhead_us.append(record.connector_seconds * 1e6)
            self.worker_overhead_us.append(record.worker_connector_seconds * 1e6)
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
    engine_stats: Any
    connector: dict[str, int | float]
    tiers: dict[str, TierStats]
    stored_keys: frozenset[bytes]


def snapshot_engine(engine: EngineCore) -> EngineSnapshot:
    # Engine thread: copy everything the report needs before the engine shuts down. The KV
    # checks run first, after the run's timed window.
    engine.verify_kv()
    stored = engine.connector.connector_scheduler.stored_keys if engine.connector else None
    return EngineSnapshot(
        engine_stats=engine.stats,
        connector=dict(engine.connector_stats()),
        tiers={t.tier_type: t for t in engine.tier_stats()},
        stored_keys=frozenset(stored or ()),
    )


def fill_result(result: RunResult, snap: EngineSnapshot, opts: RunOptions) -> None:
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
    has_fs = result.offload and opts.fs_root is not None
    result.lookup_tokens = {
        Tier.GPU: s.prompt_tokens,
        Tier.CPU: s.prompt_tokens - s.tokens_from_gpu_cache if result.offload else 0,
        Tier.FS: past_cpu if has_fs else 0,
        Tier.REDIS: (
            past_cpu - result.served[Tier.FS]
            if result.offload and opts.redis_url is not None
            else 0
        ),
    }
    result.blocks_verified_from_redis = s.blocks_verified_by_tier.get(REDIS_TIER_TYPE, 0)
    result.output_tokens = s.output_tokens
    result.steps = s.steps - s.idle_steps
    result.preemptions = s.preemptions
    result.blocks_verified = s.blocks_loaded_verified
    result.blocks_mismatched = s.verification_failures
    result.failed_loads = int(snap.connector.get("failed_load_blocks", 0))
    c = snap.connector
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
        result.transfers[store] = TransferFigures(
            blocks=tc.get(stored_counter, 0),
            bytes=tc.get(stored_counter, 0) * tier.block_bytes,
            busy_s=tc.get("store_busy_us", 0) / 1e6 if timed else None,
            failed_blocks=sum(tc.get(name, 0) for name in store_failed),
            skipped_blocks=tc.get("blocks_skipped", 0),
        )
        result.transfers[promote] = TransferFigures(
            blocks=tc.get("blocks_loaded", 0),
            bytes=tc.get("blocks_loaded", 0) * tier.block_bytes,
            busy_s=tc.get("load_busy_us", 0) / 1e6 if timed else None,
            failed_blocks=sum(tc.get(name, 0) for name in load_failed),
        )
        result.corrupt_blocks_detected += tc.get("corrupt_removed", 0)
        if tier_type == FS_TIER_TYPE and result.fs is not None:
            result.fs.files_at_end = tier.num_blocks
            result.fs.bytes_at_end = tier.used_bytes
