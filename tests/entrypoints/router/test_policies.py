# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Routing policies and the router's bookkeeping."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from vllm.entrypoints.router.measured_costs import MeasuredCosts
from vllm.entrypoints.router.policies import (
    InstanceLoad,
    KVAware,
    RoutingCosts,
    make_policy,
)
from vllm.entrypoints.router.prefix_index import Place, PrefixIndex, PrefixMatch
from vllm.entrypoints.router.router import Router


def _matcher(per_instance: list[list[int]]):  # type: ignore[no-untyped-def]
    def match(hashes: Sequence[object], piece: int, on_gpu: object = None) -> list[PrefixMatch]:
        return [PrefixMatch(tokens=list(t)) for t in per_instance]

    return match


def test_round_robin_and_session_affinity() -> None:
    rr = Router(make_policy("round-robin", 3))
    assert [rr.route(f"r{k}", f"s{k % 2}", [1] * 20).instance for k in range(5)] == [0, 1, 2, 0, 1]
    sess = Router(make_policy("session", 2))
    got = [sess.route(f"r{k}", f"s{k % 3}", [1] * 20).instance for k in range(6)]
    assert got == [0, 1, 0, 0, 1, 0]  # s0 -> 0, s1 -> 1, s2 -> 0 (least routed, lower index)
    assert sess.stats.decisions == [4, 2]


def test_kv_aware_picks_the_cheapest_instance() -> None:
    # Instance 1 holds 64 tokens in its CPU tier, instance 0 nothing.
    policy = KVAware(2, _matcher([[0, 0, 0, 0], [0, 64, 0, 0]]), 16)
    router = Router(policy)
    d = router.route("r0", "s0", [1] * 100)
    assert d.instance == 1 and d.expected_computed == 36
    assert d.costs == (100.0, 36 + 64 * 0.05)
    assert router.loads[1].queued_tokens == 36
    router.on_first_token("r0")
    assert router.loads[1].queued_tokens == 0 and router.loads[1].in_flight == 1
    router.on_finished("r0")
    assert router.loads[1].in_flight == 0
    assert router.stats.expected_cached_tokens["CPU"] == 64


def test_kv_aware_weighs_the_queue() -> None:
    policy = KVAware(2, _matcher([[0, 0, 0, 0], [16, 0, 0, 0]]), 16)
    router = Router(policy)
    router.loads[1].queued_tokens = 500  # instance 1 is busy prefilling
    assert router.route("r", "s", [1] * 100).instance == 0


def test_the_guard_keeps_every_instance_within_its_share() -> None:
    # Instance 0 always looks cheapest; the guard spreads the load anyway.
    policy = KVAware(4, _matcher([[96, 0, 0, 0]] + [[0, 0, 0, 0]] * 3), 16, slack=0.25)
    router = Router(policy)
    for k in range(40):
        router.route(f"r{k}", "s", [1] * 100)
    counts = router.stats.decisions
    assert sum(counts) == 40 and max(counts) <= 1.25 * 40 / 4 + 1
    assert counts[0] == max(counts)
    assert router.stats.guard_exclusions > 0


def test_a_prefix_in_flight_draws_the_next_request_before_any_event() -> None:
    # Nothing announced yet: the first request's blocks are on its instance's GPU all the same
    # (being computed, pinned until it ends), so a second one sharing its prefix goes there.
    index = PrefixIndex(2)
    router = Router(KVAware(2, index.match, 16))
    document = list(range(1, 257))
    first = router.route("r0", "s0", [*document, 7, 7])
    assert first.instance == 0 and first.expected_computed == 258
    second = router.route("r1", "s1", [*document, 9, 9, 9])
    assert second.instance == 0
    assert second.match is not None and second.match.tokens[Place.GPU] == 256
    assert second.expected_computed == 3
    # A request that shares nothing goes to the idle instance (the queue weighs).
    assert router.route("r2", "s2", list(range(300, 556))).instance == 1
    # Ended, a request's blocks are no longer counted as in flight.
    for r in ("r0", "r1", "r2"):
        router.on_finished(r)
    assert all(not load.blocks for load in router.loads)


def test_the_guard_allows_one_request_beyond_the_share() -> None:
    policy = KVAware(2, _matcher([[0] * 4] * 2), 16, slack=0.2)
    loads = [InstanceLoad(routed=1), InstanceLoad(routed=0)]
    # (1 + 0.2) * (1 + 1) / 2 + 1: the busier instance may take a second request now.
    assert policy.cap(loads) == pytest.approx(2.2)
    loads = [InstanceLoad(routed=12), InstanceLoad(routed=8)]
    assert policy.cap(loads) == pytest.approx(1.2 * 21 / 2 + 1)


def test_costs_from_throughputs() -> None:
    costs = RoutingCosts.from_throughputs(
        prefill_tokens_per_s=10_000, bytes_per_token=1000, load_bytes_per_s={Place.CPU: 1e9}
    )
    assert costs.load_cost[Place.CPU] == pytest.approx(0.01)
    assert costs.load_cost[Place.GPU] == 0.0
    with pytest.raises(ValueError, match="positive"):
        RoutingCosts.from_throughputs(0, 1, {})


def test_costs_from_seconds_per_token() -> None:
    costs = RoutingCosts.from_seconds(2e-4, {Place.LOCAL_STORAGE: 1e-5, Place.CPU: 0.0})
    assert costs.load_cost[Place.LOCAL_STORAGE] == pytest.approx(0.05)
    assert costs.load_cost[Place.CPU] == 0.0
    assert costs.load_cost[Place.SHARED_STORAGE] == RoutingCosts().load_cost[Place.SHARED_STORAGE]
    with pytest.raises(ValueError, match="positive"):
        RoutingCosts.from_seconds(0.0, {})
    with pytest.raises(ValueError, match=">= 0"):
        RoutingCosts.from_seconds(1e-4, {Place.CPU: -1.0})


def test_kv_aware_scores_each_instance_with_what_it_measured() -> None:
    # Both instances hold the prompt's first 64 tokens on local storage; instance 0 is queued
    # a little deeper. With the defaults, loading is cheap on both, so the queue decides.
    policy = KVAware(2, _matcher([[0, 0, 64, 0], [0, 0, 64, 0]]), 16)
    router = Router(policy)
    router.loads[0].queued_tokens = 8
    assert router.route("r0", "s0", [1] * 100).instance == 1
    router.on_finished("r0")
    # Instance 1 measured its disk: loading a token costs it 2 tokens' compute, dearer than
    # computing the prefix; instance 0 keeps the defaults.
    router.on_measured_costs(1, MeasuredCosts(1e-4, {Place.LOCAL_STORAGE: 2e-4}))
    assert router.stats.measured == [None, MeasuredCosts(1e-4, {Place.LOCAL_STORAGE: 2e-4})]
    d = router.route("r1", "s1", [1] * 100)
    assert d.instance == 0
    assert d.costs == (36 + 64 * 0.15 + 0.25 * 8, 36 + 64 * 2.0)


def test_unknown_policy_and_kv_aware_without_an_index() -> None:
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 2)
    with pytest.raises(ValueError, match="prefix index"):
        make_policy("kv-aware", 2)
