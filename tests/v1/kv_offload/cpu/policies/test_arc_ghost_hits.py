# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""ARC adapts on a ghost hit whichever call observes the re-reference.

The ARC paper adapts its target when a request misses on a ghost. A request reaches the CPU tier
through several calls: the connector may touch its keys, looks them up until the first miss, and
stores the missing ones. A connector that touches only hit keys never touches a ghost, so
``lookup`` (a miss) and ``prepare_store`` must count the ghost hit too, once per re-reference.
"""

from __future__ import annotations

import random

import pytest

from tests.v1.kv_offload.cpu.policies.utils import arc_lists, k
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy

CTX = ReqContext("r")


def store(manager: CPUOffloadingManager, *indices: int) -> None:
    out = manager.prepare_store([k(i) for i in indices], CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)


def arc_with_b1_ghost() -> tuple[CPUOffloadingManager, ARCCachePolicy]:
    """Capacity 4: T2 = {0, 1}, T1 = {2, 4}, B1 = [3] (3 evicted from T1), target 0."""
    manager = CPUOffloadingManager(4, cache_policy="arc")
    store(manager, 0, 1)
    manager.touch([k(0), k(1)], CTX)
    store(manager, 2, 3)
    store(manager, 4)
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    assert arc_lists(policy).b1 == [k(3)] and policy.target_t1_size == 0.0
    return manager, policy


def test_a_lookup_miss_on_a_ghost_adapts() -> None:
    manager, policy = arc_with_b1_ghost()
    assert manager.lookup(k(3), CTX) is False
    assert policy.target_t1_size == 1.0  # + max(1, |B2| / |B1|)


def test_storing_a_ghost_adapts_and_places_it_in_t2() -> None:
    manager, policy = arc_with_b1_ghost()
    store(manager, 3)
    assert policy.target_t1_size == 1.0
    assert k(3) in arc_lists(policy).t2 and k(3) not in arc_lists(policy).b1


@pytest.mark.parametrize("calls", [("touch", "lookup", "store"), ("lookup", "lookup", "store")])
def test_one_re_reference_adapts_once(calls: tuple[str, ...]) -> None:
    manager, policy = arc_with_b1_ghost()
    for call in calls:
        if call == "touch":
            manager.touch([k(3)], CTX)
        elif call == "lookup":
            assert manager.lookup(k(3), CTX) is False
        else:
            store(manager, 3)
    assert policy.target_t1_size == 1.0


def test_a_stored_ghost_is_resident_and_adapts_no_more() -> None:
    manager, policy = arc_with_b1_ghost()
    store(manager, 3)  # B1 hit: target 1, 3 joins T2
    policy.target_t1_size = 0.0
    manager.lookup(k(3), CTX)  # resident: no adaptation
    assert policy.target_t1_size == 0.0


def test_the_target_moves_when_the_connector_touches_only_hits() -> None:
    """A skewed single-block workload; the caller touches a request's key only when it hits, so
    every ghost is seen by a lookup or a store only. Before, the target stayed at 0."""
    rng = random.Random(0)
    manager = CPUOffloadingManager(16, cache_policy="arc")
    policy = manager.policy
    assert isinstance(policy, ARCCachePolicy)
    moved = False
    for _ in range(2_000):
        i = rng.randrange(8) if rng.random() < 0.5 else rng.randrange(8, 40)
        key = k(i)
        if manager.lookup(key, CTX):
            manager.prepare_load([key], CTX)
            manager.complete_load([key], CTX)
            manager.touch([key], CTX)
        else:
            store(manager, i)
        moved |= policy.target_t1_size > 0
    assert moved
