# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``LoadGuard``: load a hit only when loading it beats computing it ("do no harm").

The scheduler-side connector asks the guard, for each tier's part of a request's hit, whether
to load it (``admit``); a refused part and everything after it is computed instead (the
connector reports fewer matched tokens, which upstream's ``get_num_new_matched_tokens`` allows).

The estimates, all from this engine instance's own measurements (``docs/load_guard.md``):

* **Compute**: a decayed least-squares line through the engine's steps that computed tokens,
  step wall time against the tokens the step scheduled (``step_s = base + per_token * tokens``):
  a running estimate by batch size. Computing a hit's ``H`` tokens costs ``per_token * H``: the
  extra time of the steps that compute them.
* **Load, per tier**: a decayed line through the tier's completed loads (each the median of the
  tier's last three, so a single late one is no evidence), their wait against their blocks
  (``wait_s = latency + per_block * blocks``). A load's wait is the time from the decision
  until the blocks are ready (the load job reported; a promotion reported by its tier), less
  the step it runs in: that step's forward of the other requests runs whether or not this
  request loads. A hit in a secondary tier is loaded in two legs (promotion to the CPU tier,
  then CPU -> GPU): its estimate is the sum of both tiers'.
* **The step it waits**: a loading request is served at the earliest one step later; the guard
  charges every load that step's fixed cost, the decayed mean duration of the engine's steps
  that computed nothing (the scheduling round trip alone; 0 until one was seen). The forward of
  the other requests in that step is not charged: it runs either way. (The compute line's
  intercept is no measure of it: decode steps of long contexts cost much for few tokens.)

A part is loaded when ``load estimate + step cost < per_token * H``. Estimates start optimistic:
without a compute estimate, or without a sample of the tier, the answer is "load" (a cold start
behaves as without the guard). A refused tier is probed again: every ``probe_every``-th refusal
in a row of a tier is loaded anyway, so its estimate follows a tier that recovered.

Threading: scheduler thread only, like the connector that owns it. Every call is O(1) but
``on_step_end`` and ``end_wait``, which are O(the loads being waited for).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

CPU_TIER = "CPU"
"""The guard's name of the CPU (primary) tier; secondary tiers go by their ``tier_type``."""

COMPUTE_DECAY = 0.98
"""Weight kept by the compute line's older steps at each new step (about 50 steps' memory)."""

IDLE_STEP_DECAY = 0.9
"""Weight kept by the mean of the steps that computed nothing at each new one."""

LOAD_DECAY = 0.5
"""Weight kept by a tier's older (filtered) loads at each new load (about 2 loads' memory:
the median filter below already keeps single outliers out)."""

LOAD_FILTER = 3
"""A tier's line is fed the median of its last this many loads (by wait; of an even number,
the lower): one load reported a step late does not make a healthy tier look slow, two in a
row do."""

PROBE_EVERY = 8
"""Every this many refusals in a row of one tier, the next hit in it is loaded anyway."""


class DecayedLineFit:
    """An exponentially decayed least-squares fit of ``y = intercept + slope * x``.

    Each ``add`` multiplies the weight of every earlier sample by ``decay``. Both parameters are
    kept non-negative (a cost is never negative), and the slope positive once any ``y`` is: when
    the unconstrained fit has a negative intercept, or a slope that is not positive, the line
    goes through the origin (the least-squares ``y = slope * x``). While all samples share one
    ``x`` (no slope can be told apart), the same: ``y`` is taken as proportional to ``x``.

    Args:
        decay: the weight kept by older samples at each new one, in (0, 1].
    """

    __slots__ = ("_decay", "_w", "_x", "_xx", "_xy", "_y")

    def __init__(self, decay: float) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}")
        self._decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        """Add one sample (``x > 0``, ``y >= 0``)."""
        d = self._decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y

    @property
    def has_samples(self) -> bool:
        return self._w > 0.0

    def params(self) -> tuple[float, float] | None:
        """``(intercept, slope)``, or None before the first sample."""
        w = self._w
        if w <= 0.0:
            return None
        mean_x, mean_y = self._x / w, self._y / w
        var_x = self._xx / w - mean_x * mean_x
        if var_x <= 1e-9 * max(mean_x * mean_x, 1e-300):
            return 0.0, (self._y / self._x if self._x > 0 else 0.0)
        slope = (self._xy / w - mean_x * mean_y) / var_x
        intercept = mean_y - slope * mean_x
        if slope <= 0.0 or intercept < 0.0:
            # Through the origin: a cost that grows with size (a flat or falling line would
            # make large jobs look free, e.g. the compute of a hit).
            return 0.0, (self._xy / self._xx if self._xx > 0 else 0.0)
        return intercept, slope

    def estimate(self, x: float) -> float | None:
        """The fitted ``y`` at ``x``, or None before the first sample."""
        p = self.params()
        return None if p is None else p[0] + p[1] * x


@dataclass(slots=True)
class TierGuardStats:
    """What the guard decided for one tier (cumulative).

    Attributes:
        decisions: hits in the tier the guard decided on.
        skipped_hits: of those, hits it computed instead of loading.
        skipped_tokens: the tokens of those hits, recomputed because loading was slower.
        probes: hits loaded although the estimate said compute (re-probes).
        refusals_in_a_row: refusals since the last load from the tier (drives the probes).
    """

    decisions: int = 0
    skipped_hits: int = 0
    skipped_tokens: int = 0
    probes: int = 0
    refusals_in_a_row: int = 0


@dataclass(slots=True)
class PendingWait:
    """A load being waited for: a tier's leg of a request's hit, from the guard's decision.

    Attributes:
        tier: the tier loading it.
        num_blocks: the blocks (keys) it loads.
        start: ``perf_counter()`` of the decision.
        first_step_end: ``perf_counter()`` at the end of the first step after it (None: not
            ended yet). The wait counted is the time after that step.
    """

    tier: str
    num_blocks: int
    start: float
    first_step_end: float | None = None


class LoadGuard:
    """The estimates and decisions of one scheduler-side connector (see the module docstring).

    Args:
        probe_every: refusals in a row of one tier after which its next hit is loaded anyway.
        compute_decay, load_decay: the decays of the compute line and of each tier's load line.
    """

    def __init__(
        self,
        probe_every: int = PROBE_EVERY,
        compute_decay: float = COMPUTE_DECAY,
        load_decay: float = LOAD_DECAY,
    ) -> None:
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every!r}")
        self.probe_every = probe_every
        self._load_decay = load_decay
        self.compute = DecayedLineFit(compute_decay)
        self.loads: dict[str, DecayedLineFit] = {}
        # Per tier, its last LOAD_FILTER loads as (blocks, seconds), oldest first.
        self._recent: dict[str, deque[tuple[int, float]]] = {}
        self.stats: dict[str, TierGuardStats] = {}
        self._step_start: tuple[float, int] | None = None
        self._pending: list[PendingWait] = []
        # Decayed sums of the durations of the steps that computed nothing (weight, seconds).
        self._idle_w = 0.0
        self._idle_s = 0.0

    # -----------------------------------------------------------------------------------------
    # Measurements
    # -----------------------------------------------------------------------------------------

    def on_step_start(self, now: float, num_tokens: int) -> None:
        """A step scheduling ``num_tokens`` tokens starts its forward (``build_connector_meta``)."""
        self._step_start = (now, num_tokens)

    def on_step_end(self, now: float) -> None:
        """The step started last ended (the engine's ``observe_step``): one compute sample if it
        computed tokens; the pending waits' first step ends here."""
        if self._step_start is not None:
            start, num_tokens = self._step_start
            self._step_start = None
            if num_tokens > 0 and now > start:
                self.compute.add(num_tokens, now - start)
            elif num_tokens == 0:
                self._idle_w = self._idle_w * IDLE_STEP_DECAY + 1.0
                self._idle_s = self._idle_s * IDLE_STEP_DECAY + max(now - start, 0.0)
        for wait in self._pending:
            if wait.first_step_end is None:
                wait.first_step_end = now

    def start_wait(self, tier: str, num_blocks: int, now: float) -> PendingWait:
        """A load of ``num_blocks`` from ``tier`` is waited for from now on."""
        wait = PendingWait(tier, num_blocks, now)
        self._pending.append(wait)
        return wait

    def end_wait(self, wait: PendingWait, now: float, success: bool = True) -> None:
        """The blocks of ``wait`` are ready (or failed: no sample); forget it."""
        try:
            self._pending.remove(wait)
        except ValueError:
            return  # already ended (or dropped by ``reset``)
        if success and wait.num_blocks > 0:
            # Ready before the end of the step it ran in: it cost the request that step only.
            after = wait.first_step_end
            seconds = 0.0 if after is None else max(now - after, 0.0)
            self.observe_load(wait.tier, wait.num_blocks, seconds)

    def observe_load(self, tier: str, num_blocks: int, seconds: float) -> None:
        """One completed load of ``num_blocks`` from ``tier`` that made its request wait
        ``seconds`` beyond the step it ran in; the median of the tier's last ``LOAD_FILTER``
        loads goes into its line."""
        recent = self._recent.get(tier)
        if recent is None:
            recent = self._recent[tier] = deque(maxlen=LOAD_FILTER)
            self.loads[tier] = DecayedLineFit(self._load_decay)
        recent.append((num_blocks, seconds))
        ordered = sorted(recent, key=lambda sample: sample[1])
        blocks, wait = ordered[(len(ordered) - 1) // 2]
        self.loads[tier].add(blocks, wait)

    def reset(self) -> None:
        """Forget the waits in flight (``reset_cache``: their completions are ignored). The
        estimates stay: the engine and the tiers did not change."""
        self._pending.clear()
        self._step_start = None

    # -----------------------------------------------------------------------------------------
    # Decisions
    # -----------------------------------------------------------------------------------------

    def step_overhead_s(self) -> float:
        """The fixed cost of a step: the decayed mean duration of the steps that computed
        nothing (0 before the first one)."""
        return self._idle_s / self._idle_w if self._idle_w > 0.0 else 0.0

    def compute_s(self, num_tokens: int) -> float | None:
        """Estimated seconds to compute ``num_tokens`` more tokens (None: no estimate yet)."""
        p = self.compute.params()
        return None if p is None else p[1] * num_tokens

    def load_s(self, tiers: tuple[str, ...], num_blocks: int) -> float | None:
        """Estimated wait of a load of ``num_blocks`` through ``tiers`` (its legs) plus the step
        it waits; None while a leg's tier has no sample yet."""
        total = self.step_overhead_s()
        for tier in tiers:
            fit = self.loads.get(tier)
            if fit is None:
                return None
            estimate = fit.estimate(num_blocks)
            assert estimate is not None  # a fit is created with its first sample
            total += estimate
        return total

    def admit(self, tier: str, legs: tuple[str, ...], num_blocks: int, num_tokens: int) -> bool:
        """Whether to load a hit of ``num_tokens`` tokens (``num_blocks`` keys) found in
        ``tier``, loaded through ``legs``; counts the decision under ``tier``."""
        stats = self.stats.get(tier)
        if stats is None:
            stats = self.stats[tier] = TierGuardStats()
        stats.decisions += 1
        load = self.load_s(legs, num_blocks)
        compute = self.compute_s(num_tokens)
        if load is None or compute is None or load < compute:
            stats.refusals_in_a_row = 0
            return True
        stats.refusals_in_a_row += 1
        if stats.refusals_in_a_row >= self.probe_every:
            stats.refusals_in_a_row = 0
            stats.probes += 1
            return True
        stats.skipped_hits += 1
        stats.skipped_tokens += num_tokens
        return False

    # -----------------------------------------------------------------------------------------
    # Reports
    # -----------------------------------------------------------------------------------------

    def summary(self) -> dict[str, float | int]:
        """Flat figures for ``get_stats()``: ``load_guard.compute_s_per_token``,
        ``load_guard.step_overhead_s`` and, per tier ``T``, ``load_guard.T.{decisions,
        skipped_hits,skipped_tokens,probes,latency_s,s_per_block}`` (estimates absent before
        their first sample)."""
        out: dict[str, float | int] = {"load_guard.step_overhead_s": self.step_overhead_s()}
        p = self.compute.params()
        if p is not None:
            out["load_guard.compute_s_per_token"] = p[1]
        for tier in sorted(self.stats.keys() | self.loads.keys()):
            prefix = f"load_guard.{tier}."
            s = self.stats.get(tier) or TierGuardStats()
            out[prefix + "decisions"] = s.decisions
            out[prefix + "skipped_hits"] = s.skipped_hits
            out[prefix + "skipped_tokens"] = s.skipped_tokens
            out[prefix + "probes"] = s.probes
            fit = self.loads.get(tier)
            lp = None if fit is None else fit.params()
            if lp is not None:
                out[prefix + "latency_s"] = lp[0]
                out[prefix + "s_per_block"] = lp[1]
        return out
