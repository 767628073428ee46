# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``LoadGuard`` and its ``DecayedLineFit``: the estimates and the decisions, directly.

The fit is checked against what least squares must give (exact lines are recovered, costs are
never negative, an estimate never falls with size, old samples fade); the guard's decisions
against the rule of ``load_guard.py``'s docstring, with measurements fed by hand.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.load_guard import (
    CPU_TIER,
    DecayedLineFit,
    LoadGuard,
)

_costs = st.floats(min_value=0.0, max_value=10.0, allow_nan=False, allow_subnormal=False)
_sizes = st.integers(min_value=1, max_value=4096)


@settings(max_examples=200, deadline=None)
@given(
    intercept=_costs,
    # A flat line is not kept (it would make any size free): see the next test.
    slope=st.floats(min_value=1e-3, max_value=10.0),
    xs=st.lists(_sizes, min_size=2, max_size=40).filter(lambda xs: len(set(xs)) >= 2),
    decay=st.sampled_from([0.5, 0.8, 0.98, 1.0]),
)
def test_fit_recovers_an_exact_line(
    intercept: float, slope: float, xs: list[int], decay: float
) -> None:
    fit = DecayedLineFit(decay)
    for x in xs:
        fit.add(x, intercept + slope * x)
    params = fit.params()
    assert params is not None
    for x in (1, 100, 4096):
        got = fit.estimate(x)
        assert got is not None
        assert math.isclose(got, intercept + slope * x, rel_tol=1e-5, abs_tol=1e-6)


@settings(max_examples=200, deadline=None)
@given(
    samples=st.lists(st.tuples(_sizes, _costs), min_size=1, max_size=40),
    decay=st.sampled_from([0.5, 0.8, 0.98, 1.0]),
)
def test_fit_is_non_negative_and_never_falls_with_size(
    samples: list[tuple[int, float]], decay: float
) -> None:
    fit = DecayedLineFit(decay)
    for x, y in samples:
        fit.add(x, y)
    params = fit.params()
    assert params is not None
    intercept, slope = params
    assert intercept >= 0.0 and slope >= 0.0
    assert slope > 0.0 or all(y == 0.0 for _, y in samples)  # never free while costs are seen
    estimates = [fit.estimate(x) for x in (1, 10, 100, 1000)]
    assert all(e is not None and e >= 0.0 for e in estimates)
    assert estimates == sorted(estimates)  # type: ignore[type-var]


def test_fit_of_one_size_is_proportional() -> None:
    fit = DecayedLineFit(0.8)
    assert fit.params() is None and fit.estimate(5) is None
    fit.add(10, 0.5)
    fit.add(10, 0.5)
    assert fit.params() == (0.0, pytest.approx(0.05))
    assert fit.estimate(20) == pytest.approx(1.0)


@pytest.mark.parametrize("decay", [0.0, -0.1, 1.5])
def test_fit_refuses_a_bad_decay(decay: float) -> None:
    with pytest.raises(ValueError, match="decay"):
        DecayedLineFit(decay)


def test_old_samples_fade() -> None:
    """After a tier slows down (or recovers), the decayed line follows within a few loads."""
    fit = DecayedLineFit(0.8)
    for _ in range(50):
        fit.add(4, 1.0)
        fit.add(8, 2.0)
    for _ in range(15):
        fit.add(4, 0.01)
        fit.add(8, 0.02)
    estimate = fit.estimate(8)
    assert estimate is not None and estimate < 0.05


def _guard_with_compute(per_token_s: float, overhead_s: float = 0.0) -> LoadGuard:
    """A guard that measured steps costing ``overhead_s + per_token_s * tokens``, and steps
    that computed nothing costing ``overhead_s``."""
    guard = LoadGuard()
    now = 100.0
    for tokens in (64, 0, 128, 256, 0, 512):
        guard.on_step_start(now, tokens)
        now += overhead_s + per_token_s * tokens
        guard.on_step_end(now)
    return guard


def test_optimistic_until_both_estimates_exist() -> None:
    guard = LoadGuard()
    assert guard.admit("fs", ("fs", CPU_TIER), 4, 64)  # no compute estimate
    guard = _guard_with_compute(1e-3)
    assert guard.admit("fs", ("fs", CPU_TIER), 4, 64)  # no sample of fs yet
    guard.observe_load("fs", 4, 10.0)
    assert guard.admit("fs", ("fs", CPU_TIER), 4, 64)  # no sample of the CPU leg yet
    guard.observe_load(CPU_TIER, 4, 0.0)
    assert not guard.admit("fs", ("fs", CPU_TIER), 4, 64)
    assert guard.stats["fs"].skipped_hits == 1 and guard.stats["fs"].skipped_tokens == 64


def test_decides_by_comparing_load_and_compute() -> None:
    guard = _guard_with_compute(per_token_s=1e-3, overhead_s=0.002)
    assert guard.compute_s(100) == pytest.approx(0.1)
    assert guard.step_overhead_s() == pytest.approx(0.002)
    guard.observe_load(CPU_TIER, 4, 0.0)
    guard.observe_load("fs", 4, 0.05)
    # 0.05 (fs) + 0 (CPU) + 0.002 (the step it waits) against 1 ms per token.
    assert guard.admit("fs", ("fs", CPU_TIER), 4, 60)
    assert not guard.admit("fs", ("fs", CPU_TIER), 4, 50)
    assert guard.admit(CPU_TIER, (CPU_TIER,), 4, 16)
    s = guard.stats["fs"]
    assert (s.decisions, s.skipped_hits, s.skipped_tokens, s.probes) == (2, 1, 50, 0)


def test_expensive_decode_steps_are_not_charged_to_loads() -> None:
    """Steps of few tokens over long contexts cost much (a large intercept of the compute
    line); the step a load waits is charged only what steps that compute nothing cost."""
    guard = LoadGuard()
    now = 0.0
    for tokens, seconds in [(8, 0.12), (512, 0.2), (0, 0.001)] * 5:
        guard.on_step_start(now, tokens)
        now += seconds
        guard.on_step_end(now)
    params = guard.compute.params()
    assert params is not None and params[0] > 0.1
    assert guard.step_overhead_s() == pytest.approx(0.001)
    guard.observe_load(CPU_TIER, 1, 0.0)
    assert guard.admit(CPU_TIER, (CPU_TIER,), 1, 16)


def test_one_late_load_is_no_evidence_two_in_a_row_are() -> None:
    guard = _guard_with_compute(per_token_s=1e-3)  # 48 tokens: 48 ms
    for _ in range(5):
        guard.observe_load(CPU_TIER, 3, 0.0)
    guard.observe_load(CPU_TIER, 3, 0.2)  # reported a step late, once
    assert guard.admit(CPU_TIER, (CPU_TIER,), 3, 48)
    guard.observe_load(CPU_TIER, 3, 0.2)  # and again: the tier is slow now
    assert not guard.admit(CPU_TIER, (CPU_TIER,), 3, 48)
    for _ in range(4):
        guard.observe_load(CPU_TIER, 3, 0.0)
    assert guard.admit(CPU_TIER, (CPU_TIER,), 3, 48)


def test_refused_tier_is_probed_every_eighth_time() -> None:
    guard = _guard_with_compute(per_token_s=1e-3)
    guard.observe_load(CPU_TIER, 1, 0.0)
    guard.observe_load("redis", 1, 1.0)
    answers = [guard.admit("redis", ("redis", CPU_TIER), 1, 16) for _ in range(24)]
    assert answers == ([False] * 7 + [True]) * 3
    assert guard.stats["redis"].probes == 3
    assert guard.stats["redis"].skipped_hits == 21
    # The probe's load shows the tier recovered: within a few loads it is used again.
    for _ in range(20):
        guard.observe_load("redis", 1, 0.0)
    assert guard.admit("redis", ("redis", CPU_TIER), 1, 16)


def test_wait_counts_only_the_time_after_its_first_step() -> None:
    guard = LoadGuard()
    done_in_step = guard.start_wait(CPU_TIER, 2, now=10.0)
    guard.on_step_end(10.5)
    slow = guard.start_wait("fs", 2, now=10.6)
    guard.end_wait(done_in_step, now=10.55)  # reported after its step ended: 0.05 s late
    guard.on_step_end(11.0)
    guard.end_wait(slow, now=13.0)  # 2 s after its first step ended
    failed = guard.start_wait("fs", 2, now=13.0)
    guard.end_wait(failed, now=20.0, success=False)  # no sample
    guard.end_wait(failed, now=21.0)  # already ended: nothing
    assert guard.loads[CPU_TIER].estimate(2) == pytest.approx(0.05)
    assert guard.loads["fs"].estimate(2) == pytest.approx(2.0)
    within = guard.start_wait(CPU_TIER, 2, now=30.0)
    guard.end_wait(within, now=30.1)  # before its step ended: it cost that step only
    assert guard.loads[CPU_TIER].estimate(2) < 0.05


def test_summary_names_every_figure() -> None:
    guard = _guard_with_compute(per_token_s=1e-3, overhead_s=0.001)
    guard.observe_load("fs", 4, 0.5)
    guard.admit("fs", ("fs",), 4, 16)
    summary = guard.summary()
    assert summary["load_guard.compute_s_per_token"] == pytest.approx(1e-3)
    assert summary["load_guard.step_overhead_s"] == pytest.approx(1e-3)
    assert summary["load_guard.fs.decisions"] == 1
    assert summary["load_guard.fs.skipped_hits"] == 1
    assert summary["load_guard.fs.skipped_tokens"] == 16
    assert summary["load_guard.fs.latency_s"] == 0.0
    assert summary["load_guard.fs.s_per_block"] == pytest.approx(0.125)
