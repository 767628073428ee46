# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report of ``vllm-kv-offload run``: figures of one invocation, and their JSON.

One ``RunResult`` holds what one engine run measured (the no-offload baseline or the offloaded
run); ``Report`` puts both side by side and derives the comparison (prefill tokens saved, and why
nothing was saved when that happens) and the verdict. The JSON document (``Report.to_json()``)
carries the same figures as the text, which ``report_text.py`` renders; its layout is documented
in ``docs/cli.md`` and versioned by ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1
"""Bumped whenever a JSON field is renamed or removed (adding fields keeps the version)."""


class Tier(str, enum.Enum):
    """Where a prompt token came from."""

    GPU = "gpu_prefix_cache"
    CPU = "cpu_tier"
    FS = "fs_tier"
    REDIS = "redis_tier"


class Direction(str, enum.Enum):
    """A direction in which offloaded blocks move."""

    GPU_TO_CPU = "gpu_to_cpu"
    CPU_TO_GPU = "cpu_to_gpu"
    CPU_TO_FS = "cpu_to_fs"
    FS_TO_CPU = "fs_to_cpu"
    CPU_TO_REDIS = "cpu_to_redis"
    REDIS_TO_CPU = "redis_to_cpu"

    @property
    def label(self) -> str:
        """Human-readable name of the direction."""
        return {
            Direction.GPU_TO_CPU: "GPU -> CPU (store)",
            Direction.CPU_TO_GPU: "CPU -> GPU (load)",
            Direction.CPU_TO_FS: "CPU -> fs (store)",
            Direction.FS_TO_CPU: "fs -> CPU (promote)",
            Direction.CPU_TO_REDIS: "CPU -> redis (store)",
            Direction.REDIS_TO_CPU: "redis->CPU (promote)",  # 20 columns: the table's
        }[self]


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (reports are printed and shared)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def secondary_tokens(total: int, by_tier: Mapping[str, int]) -> dict[str, int]:
    """Promoted tokens by ``Tier`` value: the redis tier's, and the fs tier's (the rest).

    Args:
        total: ``EngineStats.tokens_from_secondary``.
        by_tier: ``EngineStats.tokens_from_tier`` (by registered tier type).

    Tokens whose tier the manager did not name count as the fs tier's, so that the two add up
    to ``total`` (the accounting invariant).
    """
    redis = by_tier.get("redis", 0)
    return {Tier.FS.value: total - redis, Tier.REDIS.value: redis}


def token_shares(tokens: Mapping[str, int]) -> dict[str, float]:
    """The progress line's shares (computed, GPU, CPU, fs, redis) of cumulative ``tokens``."""
    total = sum(tokens.values())
    if not total:
        return {}
    counts = {"computed": tokens.get("computed", 0)} | {
        name: tokens.get(t.value, 0)
        for name, t in (("GPU", Tier.GPU), ("CPU", Tier.CPU), ("fs", Tier.FS))
    }
    if tokens.get(Tier.REDIS.value):
        counts["redis"] = tokens[Tier.REDIS.value]
    return {name: n / total for name, n in counts.items()}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Distribution:
    """Summary of a sample (e.g. per-step overhead in microseconds)."""

    count: int = 0
    median: float = 0.0
    p99: float = 0.0
    mean: float = 0.0
    max: float = 0.0

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        """Summarise ``values`` (an empty sample gives zeros)."""
        if not values:
            return cls()
        return cls(
            count=len(values),
            median=percentile(values, 50),
            p99=percentile(values, 99),
            mean=sum(values) / len(values),
            max=max(values),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the summary."""
        return {
            "count": self.count,
            "median": self.median,
            "p99": self.p99,
            "mean": self.mean,
            "max": self.max,
        }


@dataclass
class TransferFigures:
    """Blocks and bytes moved in one direction during a run.

    Attributes:
        blocks: blocks moved successfully.
        bytes: bytes moved successfully (for the fs tier: whole block files, header included).
        busy_s: how long transfers were running: GPU <-> CPU, the summed duration of the copy
            jobs (they run one after another per direction); CPU <-> fs, the wall time during
            which at least one of the tier's I/O threads worked on that direction (blocks already
            on disk included). None when not timed.
        failed_blocks: blocks whose transfer failed (for loads from disk: corrupt files included).
        skipped_blocks: blocks not moved because the destination already held them (a store to
            the fs tier of a block already on disk).
    """

    blocks: int = 0
    bytes: int = 0
    busy_s: float | None = None
    failed_blocks: int = 0
    skipped_blocks: int = 0

    def throughput(self) -> float | None:
        """Bytes per second while transferring, or None when the busy time is unknown."""
        return self.bytes / self.busy_s if self.busy_s else None

    def to_json(self, wall_s: float) -> dict[str, Any]:
        """The JSON object; ``average_bytes_per_s`` spreads the bytes over the whole run."""
        return {
            "blocks": self.blocks,
            "bytes": self.bytes,
            "busy_s": self.busy_s,
            "failed_blocks": self.failed_blocks,
            "skipped_blocks": self.skipped_blocks,
            "throughput_bytes_per_s": self.throughput(),
            "average_bytes_per_s": self.bytes / wall_s if wall_s > 0 else 0.0,
        }


@dataclass
class StepSample:
    """One engine step of a run, for the plot.

    Attributes:
        t_s: seconds since the run started, at the end of the step.
        tokens: cumulative prompt tokens per source so far: ``"computed"`` and each ``Tier`` value.
        bytes_moved: bytes each direction moved during this step (completed transfers).
    """

    t_s: float
    tokens: dict[str, int]
    bytes_moved: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the sample."""
        return {
            "t_s": round(self.t_s, 4),
            "tokens": dict(self.tokens),
            "bytes_moved": dict(self.bytes_moved),
        }


@dataclass
class FsTierState:
    """What the fs tier held before and after a run.

    Attributes:
        root_dir: the tier's root directory.
        max_bytes: the tier's capacity bound (None: bounded by the filesystem).
        files_at_start, bytes_at_start: block files of this run's geometry already on disk when
            the run started (a warm start when > 0).
        files_at_end, bytes_at_end: the same after the run.
    """

    root_dir: str
    max_bytes: int | None
    files_at_start: int = 0
    bytes_at_start: int = 0
    files_at_end: int = 0
    bytes_at_end: int = 0

    @property
    def warm(self) -> bool:
        """Whether the run started with blocks already on disk."""
        return self.files_at_start > 0

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the state."""
        return {
            "root_dir": self.root_dir,
            "max_bytes": self.max_bytes,
            "warm_start": self.warm,
            "files_at_start": self.files_at_start,
            "bytes_at_start": self.bytes_at_start,
            "files_at_end": self.files_at_end,
            "bytes_at_end": self.bytes_at_end,
        }


@dataclass
class RunResult:
    """Everything one engine run measured.

    Token accounting: every prompt token the scheduler placed (counted again when a preempted
    request is scheduled anew) is either computed by the model or served from exactly one of the
    GPU prefix cache, the CPU tier, the fs tier or the redis tier, so
    ``computed + sum(served.values()) == prompt_tokens``.

    Attributes:
        label: ``"baseline"`` or ``"offload"``.
        offload: whether the offloading connector was on.
        wall_s: seconds from the first request to the last output.
        num_requests: requests submitted; ``num_finished`` of them finished.
        prompt_tokens: prompt tokens placed (see above).
        computed_tokens: prompt tokens the model computed.
        served: prompt tokens served per tier.
        lookup_tokens: prompt tokens looked up per tier (those that reached it, i.e. missed every
            faster tier), the denominators of the hit rates.
        output_tokens: tokens generated.
        steps: engine steps run.
        preemptions: requests preempted for lack of GPU blocks.
        overhead_us: scheduler-side connector + manager time per busy engine step (one that
            scheduled tokens), in microseconds (offload only).
        worker_overhead_us: worker-side connector time per busy step (submitting and polling
            transfers; with the CPU fallback this includes the copies), in microseconds.
        ttft_ms: time to first token per request, in milliseconds.
        latency_ms: end-to-end time per request, in milliseconds.
        transfers: figures per direction (offload only).
        blocks_verified: offloaded blocks loaded into the GPU pool and checked bit-exact against
            what recomputation writes.
        blocks_mismatched: such blocks whose bytes differed (never served: recomputed).
        corrupt_blocks_detected: blocks the fs tier found corrupt on disk (discarded, recomputed).
        failed_loads: blocks of load or promotion jobs that failed for any reason.
        blocks_verified_from_redis: of ``blocks_verified``, GPU blocks of blocks promoted from
            the redis tier.
        fs: the fs tier's state (None without an fs tier).
        redis_url: the redis tier's server (None without a redis tier).
        cross_instance_tokens: in a fleet, prompt tokens served from KV that another instance
            of the fleet computed and stored in the shared (redis) tier during this run; None
            outside a fleet.
        outputs: output token ids per request id, to compare runs.
        samples: one sample per engine step, for the plot.
    """

    label: str
    offload: bool
    wall_s: float = 0.0
    num_requests: int = 0
    num_finished: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    served: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    lookup_tokens: dict[Tier, int] = field(default_factory=lambda: dict.fromkeys(Tier, 0))
    output_tokens: int = 0
    steps: int = 0
    preemptions: int = 0
    overhead_us: list[float] = field(default_factory=list)
    worker_overhead_us: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    transfers: dict[Direction, TransferFigures] = field(
        default_factory=lambda: {d: TransferFigures() for d in Direction}
    )
    blocks_verified: int = 0
    blocks_mismatched: int = 0
    corrupt_blocks_detected: int = 0
    failed_loads: int = 0
    blocks_verified_from_redis: int = 0
    fs: FsTierState | None = None
    redis_url: str | None = None
    cross_instance_tokens: int | None = None
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    samples: list[StepSample] = field(default_factory=list)

    def check_accounting(self) -> None:
        """Assert the token accounting invariant (see the class docstring)."""
        total = self.computed_tokens + sum(self.served.values())
        assert total == self.prompt_tokens, (
            f"{self.label} run: computed {self.computed_tokens} + served "
            f"{ {t.value: n for t, n in self.served.items()} } = {total} != prompt tokens "
            f"{self.prompt_tokens}"
        )

    def hit_rate(self, tier: Tier) -> float:
        """Fraction of the prompt tokens that reached ``tier`` which it served."""
        looked_up = self.lookup_tokens[tier]
        return self.served[tier] / looked_up if looked_up else 0.0

    def share(self, tier: Tier | None) -> float:
        """Fraction of all prompt tokens served by ``tier`` (None: computed)."""
        if not self.prompt_tokens:
            return 0.0
        n = self.computed_tokens if tier is None else self.served[tier]
        return n / self.prompt_tokens

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the run."""
        return {
            "label": self.label,
            "offload": self.offload,
            "wall_s": self.wall_s,
            "requests": {"submitted": self.num_requests, "finished": self.num_finished},
            "prompt_tokens": {
                "total": self.prompt_tokens,
                "computed": self.computed_tokens,
                **{t.value: self.served[t] for t in Tier},
            },
            "hit_rate": {t.value: self.hit_rate(t) for t in Tier},
            "share": {
                "computed": self.share(None),
                **{t.value: self.share(t) for t in Tier},
            },
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "overhead_us_per_step": Distribution.of(self.overhead_us).to_json(),
            "worker_overhead_us_per_step": Distribution.of(self.worker_overhead_us).to_json(),
            "ttft_ms": Distribution.of(self.ttft_ms).to_json(),
            "latency_ms": Distribution.of(self.latency_ms).to_json(),
            "transfers": {d.value: self.transfers[d].to_json(self.wall_s) for d in Direction},
            "verification": {
                "blocks_verified": self.blocks_verified,
                "blocks_mismatched": self.blocks_mismatched,
                "corrupt_blocks_detected": self.corrupt_blocks_detected,
                "failed_loads": self.failed_loads,
                "blocks_verified_from_redis": self.blocks_verified_from_redis,
            },
            "fs_tier": None if self.fs is None else self.fs.to_json(),
            "redis_url": self.redis_url,
            "cross_instance_tokens": self.cross_instance_tokens,
            "samples": [s.to_json() for s in self.samples],
        }


@dataclass(frozen=True)
class Verdict:
    """Outcome of the correctness checks of the offloaded run.

    Attributes:
        passed: True when nothing wrong was served and no stored block was found corrupt.
        served_correctly: every block loaded from CPU or disk matched recomputation, and every
            request's output equals the baseline's.
        storage_intact: no block on disk was found corrupt.
        reasons: one line per failed check.
    """

    passed: bool
    served_correctly: bool
    storage_intact: bool
    reasons: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the verdict."""
        return {
            "status": "PASS" if self.passed else "FAIL",
            "served_correctly": self.served_correctly,
            "storage_intact": self.storage_intact,
            "reasons": list(self.reasons),
        }


def compare_outputs(
    baseline: Mapping[str, Sequence[int]], offload: Mapping[str, Sequence[int]]
) -> list[str]:
    """Request ids whose outputs differ between the runs (or that only one run finished)."""
    ids = sorted(set(baseline) | set(offload))
    return [
        r
        for r in ids
        if r not in baseline or r not in offload or tuple(baseline[r]) != tuple(offload[r])
    ]


def judge(baseline: RunResult, offload: RunResult) -> Verdict:
    """Derive the verdict of ``offload`` from its own checks and the baseline's outputs."""
    reasons: list[str] = []
    if offload.blocks_mismatched:
        reasons.append(f"{offload.blocks_mismatched} loaded block(s) differed from recomputation")
    differing = compare_outputs(baseline.outputs, offload.outputs)
    if differing:
        shown = ", ".join(differing[:5]) + (" ..." if len(differing) > 5 else "")
        reasons.append(
            f"{len(differing)} request(s) produced other outputs than the baseline: {shown}"
        )
    served_correctly = not reasons
    if offload.corrupt_blocks_detected:
        where = "on disk or in redis" if offload.redis_url is not None else "on disk"
        reasons.append(
            f"{offload.corrupt_blocks_detected} corrupt block(s) detected {where} "
            "(discarded and recomputed, never served)"
        )
    storage_intact = offload.corrupt_blocks_detected == 0
    return Verdict(
        passed=served_correctly and storage_intact,
        served_correctly=served_correctly,
        storage_intact=storage_intact,
        reasons=tuple(reasons),
    )


def _suggest_smaller_pool(settings: Mapping[str, Any]) -> str:
    gpu_blocks = int(settings.get("gpu_blocks", 0))
    smallest = int(settings.get("min_gpu_blocks", 1))
    smaller = max(smallest, gpu_blocks // 4)
    if smaller < gpu_blocks:
        return f"try --gpu-blocks {smaller}"
    return f"try --num-clients {2 * int(settings.get('num_clients', 1))}"


def no_savings_reason(report: Report) -> str | None:
    """Why the offloaded run computed no fewer prompt tokens than the baseline, or None.

    Told from the run's own figures, from the likeliest cause to the least likely: nothing was
    offloaded; offloaded blocks were never asked for again (the GPU prefix cache held the working
    set); or the tiers served, but the baseline's GPU prefix cache happened to serve more.
    """
    if report.prefill_tokens_saved > 0:
        return None
    b, o = report.baseline, report.offload
    from_tiers = o.served[Tier.CPU] + o.served[Tier.FS] + o.served[Tier.REDIS]
    if o.transfers[Direction.GPU_TO_CPU].blocks == 0:
        block = report.settings.get("offload_block_size")
        return (
            f"nothing was offloaded: no request filled a whole offloaded block of {block} tokens "
            "(try a smaller --offload-block-size or longer prompts)"
        )
    if from_tiers == 0:
        return (
            "the GPU prefix cache held the whole working set, so no request needed a block "
            f"after it was evicted: {_suggest_smaller_pool(report.settings)}"
        )
    return (
        f"the {'CPU, fs and redis' if o.redis_url else 'CPU and fs'} tiers served "
        f"{from_tiers:,} tokens, but the baseline's GPU prefix cache "
        f"served {b.served[Tier.GPU]:,} to this run's {o.served[Tier.GPU]:,} (the two runs "
        "interleave requests differently)"
    )


@dataclass
class InstanceResult:
    """One engine instance of a fleet: its share of both runs (same requests, same router).

    Attributes:
        index: the instance's number (0-based).
        baseline: what it measured in the no-offload run.
        offload: what it measured in the offloaded run.
    """

    index: int
    baseline: RunResult
    offload: RunResult

    @property
    def verdict(self) -> Verdict:
        """The instance's own verdict (its loaded blocks, its outputs against its baseline)."""
        return judge(self.baseline, self.offload)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of the instance (its runs' figures, without samples, and verdict)."""
        runs = {}
        for run in (self.baseline, self.offload):
            doc = run.to_json()
            del doc["samples"]
            runs[run.label] = doc
        return {"index": self.index, "runs": runs, "verdict": self.verdict.to_json()}


@dataclass
class Report:
    """Both runs of one invocation, with the settings that produced them.

    In a fleet (``--engines`` > 1) ``baseline`` and ``offload`` are the sums over the instances
    and ``instances`` holds each one's figures.

    Attributes:
        settings: the options of the run (JSON-serialisable values), echoed in the report.
        baseline: the no-offload run.
        offload: the offloaded run.
        instances: the fleet's instances (empty with one engine in this process).
    """

    settings: dict[str, Any]
    baseline: RunResult
    offload: RunResult
    instances: list[InstanceResult] = field(default_factory=list)

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt tokens the baseline computed that the offloaded run did not."""
        return self.baseline.computed_tokens - self.offload.computed_tokens

    @property
    def verdict(self) -> Verdict:
        """The verdict of the offloaded run (in a fleet: of every instance, and of the whole)."""
        verdict = judge(self.baseline, self.offload)
        failed = [i for i in self.instances if not i.verdict.passed]
        if not failed:
            return verdict
        names = ", ".join(str(i.index) for i in failed)
        return Verdict(
            passed=False,
            served_correctly=verdict.served_correctly
            and all(i.verdict.served_correctly for i in failed),
            storage_intact=verdict.storage_intact and all(i.verdict.storage_intact for i in failed),
            reasons=(*verdict.reasons, f"instance(s) {names} failed their own verdict"),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON document of the report."""
        base = self.baseline.computed_tokens
        return {
            "schema_version": SCHEMA_VERSION,
            "settings": self.settings,
            "runs": {"baseline": self.baseline.to_json(), "offload": self.offload.to_json()},
            "comparison": {
                "prefill_tokens_saved": self.prefill_tokens_saved,
                "prefill_tokens_saved_fraction": self.prefill_tokens_saved / base if base else 0.0,
                "wall_time_ratio": (
                    self.offload.wall_s / self.baseline.wall_s if self.baseline.wall_s else None
                ),
                "outputs_identical": not compare_outputs(
                    self.baseline.outputs, self.offload.outputs
                ),
                "no_savings_reason": self.no_savings_reason,
            },
            "verdict": self.verdict.to_json(),
            "fleet": (
                {
                    "engines": len(self.instances),
                    "router": "round-robin per turn",
                    "instances": [i.to_json() for i in self.instances],
                }
                if self.instances
                else None
            ),
        }

    @property
    def no_savings_reason(self) -> str | None:
        """Why the offloaded run saved no prefill, in one sentence; None when it saved some."""
        return no_savings_reason(self)

    def render(self, home: str | None = None) -> str:
        """The human-readable report, at most ``report_text.WIDTH`` columns wide.

        Args:
            home: the directory shown as ``~`` in paths (default: the user's home).
        """
        from vllm.entrypoints.cli.report_text import render_report

        return "\n".join(render_report(self, home))
