# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report's data model: what one invocation of ``vllm-kv-offload run`` measured.

Owns the figures and nothing else: ``RunResult`` is what one engine run measured (the no-offload
baseline or the offloaded run), ``InstanceResult`` one fleet instance's share of both, and
``Report`` both runs side by side with the settings that produced them. The figures derived from
them alone (hit rates, shares, prefill tokens saved) are here too. Judging them (verdict,
reasons) is ``verdict.py``'s; rendering them is ``text.py``'s, ``json_doc.py``'s and
``plot.py``'s. Filled by ``cli/engine_run.py`` (from an engine) and ``cli/fleet.py`` (sums
over instances).

A new figure: a field here (with its docstring line), filled in ``engine_run.fill_result``,
shown by a line in ``text.py`` and a key in ``json_doc.py``.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.engine.stats import TTFT_PARTS

__all__ = ["TTFT_PARTS"]  # the names of ``RunResult.ttft_parts_ms``, defined by the engine


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


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(offload: float, baseline: float) -> float | None:
    """``offload / baseline`` (the report's ratios), or None when the baseline's figure is 0."""
    return offload / baseline if baseline else None


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
        jobs: jobs the tier reported in this direction (its ``store_jobs`` / ``load_jobs``);
            None when the tier does not count them.
        failed_jobs: those of them that failed.
        served_bytes: promotions (tier -> CPU) only: the bytes CPU -> GPU loads then read of the
            blocks promoted from the tier (each key's KV-cache group's bytes, as the load moves
            them), counted per load that used them; None for the other directions. Against
            ``bytes``, it says how much of what was read from the tier was used.
    """

    blocks: int = 0
    bytes: int = 0
    busy_s: float | None = None
    failed_blocks: int = 0
    skipped_blocks: int = 0
    jobs: int | None = None
    failed_jobs: int = 0
    served_bytes: int | None = None

    def throughput(self) -> float | None:
        """Bytes per second while transferring, or None when the busy time is unknown."""
        return self.bytes / self.busy_s if self.busy_s else None

    def __add__(self, other: TransferFigures) -> TransferFigures:
        """Both moves together (two instances of a fleet): counts add up; a figure one side
        does not know (None) is the other's, unknown if neither knows it."""
        return TransferFigures(
            blocks=self.blocks + other.blocks,
            bytes=self.bytes + other.bytes,
            busy_s=_add_known(self.busy_s, other.busy_s),
            failed_blocks=self.failed_blocks + other.failed_blocks,
            skipped_blocks=self.skipped_blocks + other.skipped_blocks,
            jobs=_add_known(self.jobs, other.jobs),
            failed_jobs=self.failed_jobs + other.failed_jobs,
            served_bytes=_add_known(self.served_bytes, other.served_bytes),
        )


def _add_known(a: Any, b: Any) -> Any:
    """``a + b`` where None is "not known": None only if both are."""
    if a is None and b is None:
        return None
    return (a or 0) + (b or 0)


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

    @staticmethod
    def merged(series: Sequence[Sequence[StepSample]]) -> list[StepSample]:
        """Several instances' samples on one time axis; the cumulative token counts of a
        merged sample add each instance's latest counts."""
        latest: list[dict[str, int]] = [{} for _ in series]
        events = sorted((s.t_s, i, s) for i, samples in enumerate(series) for s in samples)
        merged: list[StepSample] = []
        for t_s, i, sample in events:
            latest[i] = sample.tokens
            tokens: dict[str, int] = {}
            for counts in latest:
                for name, n in counts.items():
                    tokens[name] = tokens.get(name, 0) + n
            merged.append(StepSample(t_s=t_s, tokens=tokens, bytes_moved=dict(sample.bytes_moved)))
        return merged


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

    @classmethod
    def sum_of(
        cls, root_dir: str, max_bytes: int | None, parts: Sequence[FsTierState]
    ) -> FsTierState:
        """A fleet's fs directories under ``root_dir`` (their bound added up: ``max_bytes``) as
        one: the files and bytes of ``parts`` added up."""
        total = cls(root_dir, max_bytes)
        for part in parts:
            total.files_at_start += part.files_at_start
            total.bytes_at_start += part.bytes_at_start
            total.files_at_end += part.files_at_end
            total.bytes_at_end += part.bytes_at_end
        return total


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
        connector_thread_cpu_us, worker_connector_thread_cpu_us: of the same steps, the CPU time
            of the thread that ran each side's hooks (``time.thread_time``), in microseconds:
            ``overhead_us`` minus time off the CPU (waiting for the GIL, descheduled).
        lookup_deferred_requests: requests whose lookup answered "ask again next step" at least
            once because a tier could not answer yet whether it holds a block (the connector's
            count; offload only), delaying them one step or more.
        transfer_wait_requests: requests whose lookup answered so because their blocks were
            being moved (promoted from a secondary tier, stored, or loaded for another request):
            waiting for the bytes, part of loading them (offload only).
        lookup_deferred_requests_by_tier: of those, the requests each secondary tier deferred
            (by tier type; a request two tiers deferred counts in both).
        ttft_ms: time to first token per request, in milliseconds (measured by the clients).
        ttft_parts_ms: that time's parts per request, by ``TTFT_PARTS`` name (slot, lookup,
            loading, prefill), in milliseconds, as the engine measured them from the request's
            arrival at the engine (``vllm/v1/engine/stats.py`` defines each part).
        latency_ms: end-to-end time per request, in milliseconds.
        transfers: figures per direction (offload only).
        engine_thread_cpu_s: the engine thread's CPU time (``time.thread_time()``) over the timed
            window; the checks run after it (in a fleet: every instance's, added up).
        engine_thread_idle_s: over the same window, the engine thread's sleep between steps:
            no request to run, or waiting for a transfer or lookup after an idle step
            (``EngineStats.idle_wait_seconds``; in a fleet: added up).
        engine_thread_runqueue_wait_s: over the same window, the engine thread's time runnable
            but not running (waiting for a core while other threads or processes had them);
            None where the kernel does not say (``cli/thread_cpu.py``; in a fleet: added up).
        engine_thread_blocked_s: the rest of the window, the engine thread asleep inside its
            steps: waiting for the GIL, a lock or I/O (window minus CPU, idle sleep and the
            wait for a core; None with the wait; in a fleet: added up).
        cpu_s_by_component: CPU seconds each component's threads used over the timed window
            (``cli/thread_cpu.py``: engine thread, tier threads, ...; in a fleet: added up).
        verify_cpu_s: CPU seconds the checks took, after the timed window.
        verify_s: seconds the oracle's checks took after the timed window (in a fleet: the
            slowest instance's).
        verify_mode: ``--verify`` (``loaded``, ``all`` or ``none``).
        blocks_verified: offloaded blocks loaded into the GPU pool and checked bit-exact against
            a reference (the baseline's computation of the same block, or a recomputation).
        blocks_checked: every block checked (``--verify all`` adds finished requests' blocks
            and computed blocks to the loaded ones).
        blocks_mismatched: checked blocks whose bytes differed from their reference.
        corrupt_blocks_detected: blocks the fs tier found corrupt on disk (discarded, recomputed).
        failed_loads: blocks of load or promotion jobs that failed for any reason.
        blocks_verified_from_redis: of ``blocks_verified``, GPU blocks of blocks promoted from
            the redis tier.
        fs: the fs tier's state (None without an fs tier).
        redis_url: the redis tier's server (None without a redis tier).
        redis_down: why the redis tier never got an answer from its server during the run
            ("authentication failed", "server unreachable"); None when it did (or there is
            none).
        cross_instance_tokens: in a fleet, prompt tokens served from KV that another instance
            of the fleet computed and stored in the shared (redis) tier during this run; None
            outside a fleet.
        outputs: output token ids per request id, to compare runs.
        samples: one sample per engine step, for the plot.
        load_guard: the load guard's figures (the connector's ``load_guard.*`` statistics,
            without the prefix: ``compute_s_per_token``, ``<tier>.skipped_tokens``, ...; see
            ``LoadGuard.summary``); None when the guard was off (or no offloading).
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
    connector_thread_cpu_us: list[float] = field(default_factory=list)
    worker_connector_thread_cpu_us: list[float] = field(default_factory=list)
    lookup_deferred_requests: int = 0
    transfer_wait_requests: int = 0
    lookup_deferred_requests_by_tier: dict[str, int] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    ttft_parts_ms: dict[str, list[float]] = field(
        default_factory=lambda: {name: [] for name in TTFT_PARTS}
    )
    latency_ms: list[float] = field(default_factory=list)
    transfers: dict[Direction, TransferFigures] = field(
        default_factory=lambda: {d: TransferFigures() for d in Direction}
    )
    engine_thread_cpu_s: float = 0.0
    engine_thread_idle_s: float = 0.0
    engine_thread_runqueue_wait_s: float | None = None
    engine_thread_blocked_s: float | None = None
    cpu_s_by_component: dict[str, float] = field(default_factory=dict)
    verify_s: float = 0.0
    verify_cpu_s: float = 0.0
    verify_mode: str = "loaded"
    blocks_verified: int = 0
    blocks_checked: int = 0
    blocks_mismatched: int = 0
    corrupt_blocks_detected: int = 0
    failed_loads: int = 0
    blocks_verified_from_redis: int = 0
    fs: FsTierState | None = None
    redis_url: str | None = None
    redis_down: str | None = None
    cross_instance_tokens: int | None = None
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    samples: list[StepSample] = field(default_factory=list)
    load_guard: dict[str, float | int] | None = None

    @property
    def outputs_digest(self) -> str:
        """One hex digest of every request's output tokens, in request-id order: equal for two
        runs exactly when their outputs are (whatever the batching)."""
        h = hashlib.sha256()
        for req_id in sorted(self.outputs):
            tokens = self.outputs[req_id]
            h.update(f"{req_id}:{len(tokens)}:{','.join(map(str, tokens))};".encode())
        return h.hexdigest()

    @classmethod
    def sum_of(cls, label: str, offload: bool, parts: Sequence[RunResult]) -> RunResult:
        """A fleet's run: its instances' figures added up (samples merged on one time axis;
        wall and verification time the longest instance's). A new figure is added up here."""
        total = cls(label=label, offload=offload)
        # Untimed (None) until an instance's figures say otherwise.
        total.transfers = {d: TransferFigures(busy_s=None) for d in Direction}
        total.wall_s = max((p.wall_s for p in parts), default=0.0)
        total.verify_s = max((p.verify_s for p in parts), default=0.0)
        total.verify_mode = parts[0].verify_mode if parts else total.verify_mode
        for p in parts:
            for name in _SUMMED_COUNTS:
                setattr(total, name, getattr(total, name) + getattr(p, name))
            for t in Tier:
                total.served[t] += p.served[t]
                total.lookup_tokens[t] += p.lookup_tokens[t]
            for d in Direction:
                total.transfers[d] += p.transfers[d]
            for name in _CONCATENATED:
                getattr(total, name).extend(getattr(p, name))
            for tier_type, n in p.lookup_deferred_requests_by_tier.items():
                by_tier = total.lookup_deferred_requests_by_tier
                by_tier[tier_type] = by_tier.get(tier_type, 0) + n
            for name, values in p.ttft_parts_ms.items():
                total.ttft_parts_ms.setdefault(name, []).extend(values)
            for component, cpu_s in p.cpu_s_by_component.items():
                total.cpu_s_by_component[component] = (
                    total.cpu_s_by_component.get(component, 0.0) + cpu_s
                )
            total.outputs.update(p.outputs)
            total.redis_url = total.redis_url or p.redis_url
            total.cross_instance_tokens = _add_known(
                total.cross_instance_tokens, p.cross_instance_tokens
            )
        for name in ("engine_thread_runqueue_wait_s", "engine_thread_blocked_s"):
            # Known for the fleet only if every instance's kernel said.
            values = [getattr(p, name) for p in parts]
            setattr(total, name, None if not values or None in values else sum(values))
        # Down for the fleet only if no instance ever got an answer.
        downs = [p.redis_down for p in parts]
        total.redis_down = downs[0] if downs and all(downs) else None
        total.samples = StepSample.merged([p.samples for p in parts])
        return total

    def check_accounting(self) -> None:
        """Assert the token accounting invariant (see the class docstring)."""
        total = self.computed_tokens + sum(self.served.values())
        assert total == self.prompt_tokens, (
            f"{self.label} run: computed {self.computed_tokens} + served "
            f"{ {t.value: n for t, n in self.served.items()} } = {total} != prompt tokens "
            f"{self.prompt_tokens}"
        )

    @property
    def requests_per_s(self) -> float:
        """Requests finished per second of the timed window (0.0 when not timed)."""
        return self.num_finished / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prompt_tokens_per_s(self) -> float:
        """Prompt tokens placed per second of the timed window (0.0 when not timed)."""
        return self.prompt_tokens / self.wall_s if self.wall_s > 0 else 0.0

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


_SUMMED_COUNTS = (
    "num_requests",
    "num_finished",
    "prompt_tokens",
    "computed_tokens",
    "output_tokens",
    "steps",
    "preemptions",
    "engine_thread_cpu_s",
    "engine_thread_idle_s",
    "verify_cpu_s",
    "blocks_verified",
    "blocks_checked",
    "blocks_mismatched",
    "corrupt_blocks_detected",
    "failed_loads",
    "blocks_verified_from_redis",
    "lookup_deferred_requests",
    "transfer_wait_requests",
)
"""``RunResult`` counts a fleet's run adds up over its instances (``RunResult.sum_of``)."""
_CONCATENATED = (
    "overhead_us",
    "worker_overhead_us",
    "connector_thread_cpu_us",
    "worker_connector_thread_cpu_us",
    "ttft_ms",
    "latency_ms",
)
"""``RunResult`` lists of observations a fleet's run concatenates over its instances."""


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


@dataclass
class RoutingFigures:
    """How a fleet's front end routed one run (``fleet_events.routing_figures``).

    Attributes:
        policy: the routing policy (``--routing``).
        requests: requests routed to each instance.
        expected_cached_tokens: kv-aware: per place (``GPU``, ``CPU``, ``LOCAL_STORAGE``,
            ``SHARED_STORAGE``), the prompt tokens the router expected the chosen instances to
            serve from there (its index's view; what they served is in the run's figures).
        expected_computed_tokens: prompt tokens the router expected them to compute.
        guard_exclusions: kv-aware: candidates the load-balance guard excluded.
        measured_costs: per instance, the costs it last reported measuring (its load guard's
            estimates), as the router scored them: ``compute_us_per_token`` and ``load_cost``
            per place in units of computing a token; None where it reported none (kv-aware
            then scores it with the defaults).
        events: kv-aware: per instance, the event feed's counters (``batches``, ``replayed``,
            ``replay_requests``, ``lost``, ``mean_lag_ms``, ``max_lag_ms``); None otherwise.
    """

    policy: str
    requests: list[int]
    expected_cached_tokens: dict[str, int] = field(default_factory=dict)
    expected_computed_tokens: int = 0
    guard_exclusions: int = 0
    measured_costs: list[dict[str, Any] | None] = field(default_factory=list)
    events: dict[str, list[float]] | None = None


@dataclass
class PolicyRun:
    """The offloaded run served under one routing policy (``--compare-routing``).

    Attributes:
        routing: how it was routed.
        result: the fleet's figures (the instances' added up).
    """

    routing: RoutingFigures
    result: RunResult


@dataclass
class Report:
    """Both runs of one invocation, with the settings that produced them.

    In a fleet (``--engines`` > 1) ``baseline`` and ``offload`` are the sums over the instances
    and ``instances`` holds each one's figures.

    Attributes:
        settings: the options of the run (JSON-serialisable values), echoed in the report
            (``RunConfig.settings``).
        baseline: the no-offload run.
        offload: the offloaded run.
        instances: the fleet's instances (empty with one engine in this process).
        routing: how the fleet's offloaded run was routed (None with one engine).
        policy_runs: ``--compare-routing``: the offloaded run under each policy, in
            ``ROUTING_POLICIES`` order (empty otherwise).
        kv_events: what the KV event publishers sent (``batches_sent``, ``batches_dropped``,
            summed over the instances), None when no events were published.
        load_average: the machine's 1-minute load average (``os.getloadavg``) before the
            baseline started and after the offloaded run ended; None where unknown.
    """

    settings: dict[str, Any]
    baseline: RunResult
    offload: RunResult
    instances: list[InstanceResult] = field(default_factory=list)
    routing: RoutingFigures | None = None
    policy_runs: list[PolicyRun] = field(default_factory=list)
    kv_events: dict[str, int] | None = None
    load_average: tuple[float, float] | None = None

    @property
    def prefill_tokens_saved(self) -> int:
        """Prompt tokens the baseline computed that the offloaded run did not."""
        return self.baseline.computed_tokens - self.offload.computed_tokens

    @property
    def prefill_tokens_saved_fraction(self) -> float:
        """``prefill_tokens_saved`` over the baseline's computed tokens (0.0 when none)."""
        base = self.baseline.computed_tokens
        return self.prefill_tokens_saved / base if base else 0.0
