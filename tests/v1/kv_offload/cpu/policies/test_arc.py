# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ARCCachePolicy: T1/T2 lists, ghost lists, adaptive target and atomic eviction."""

from __future__ import annotations

import pytest

from tests.v1.kv_offload.cpu.policies.reference_arc import ReferenceARCCachePolicy
from tests.v1.kv_offload.cpu.policies.utils import (
    CountingSet,
    arc_lists,
    evicted_ids,
    insert_blocks,
    insert_ready,
    k,
    pin,
    unpin,
)
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus


def ids(keys: object) -> list[int]:
    return [int.from_bytes(key[:8], "big") for key in keys]  # type: ignore[attr-defined]


def make_t2(policy: ARCCachePolicy, *indices: int) -> None:
    """Insert ready blocks and touch them once, which promotes them to T2."""
    for i in indices:
        insert_ready(policy, i)
    policy.touch([k(i) for i in indices])


def test_basic() -> None:
    """A new block joins T1 (``test_base`` checks the rest of ``insert``)."""
    policy = ARCCachePolicy(8)
    policy.insert(k(0), BlockStatus(0))
    assert sorted(ids(arc_lists(policy).t1)) == [0]
    assert sorted(ids(arc_lists(policy).t2)) == []
    assert policy.target_t1_size == 0.0


def test_t1_to_t2_promotion() -> None:
    policy = ARCCachePolicy(8)
    policy.insert(k(0), BlockStatus(0))  # being written
    policy.touch([k(0)])
    assert sorted(ids(arc_lists(policy).t1)) == [0], "being written: stays in T1 when touched"
    block = policy.get(k(0))
    assert block is not None
    block.ref_cnt = 0
    policy.mark_evictable(k(0))
    policy.touch([k(0)])
    assert sorted(ids(arc_lists(policy).t1)) == [] and sorted(ids(arc_lists(policy).t2)) == [0]
    assert evicted_ids(policy.evict(1, ())) == [0]
    assert ids(arc_lists(policy).b2) == [0], "a victim from T2 goes to B2"


def test_pinned_block_is_promoted_and_released_into_t2() -> None:
    policy = ARCCachePolicy(8)
    insert_ready(policy, 0)
    insert_ready(policy, 1)
    pin(policy, 0)
    policy.touch([k(0)])
    assert sorted(ids(arc_lists(policy).t2)) == [0]
    assert policy.num_evictable == 1
    unpin(policy, 0)
    assert policy.num_evictable == 2
    # target 0: T1 (block 1) goes first, then T2 (block 0).
    victims = policy.evict(2, ())
    assert evicted_ids(victims) == [1, 0]
    assert ids(arc_lists(policy).b1) == [1] and ids(arc_lists(policy).b2) == [0]


def test_touch_ordering() -> None:
    policy = ARCCachePolicy(8)
    make_t2(policy, 0, 1, 2, 3)
    # The first key of a touch ends most recently used.
    policy.touch([k(2), k(0)])
    assert evicted_ids(policy.evict(4, ())) == [3, 1, 0, 2]
    assert ids(arc_lists(policy).b2) == [3, 1, 0, 2]


def test_touch_promotion_order_first_key_most_recent() -> None:
    policy = ARCCachePolicy(8)
    make_t2(policy, 0, 1, 2)
    assert evicted_ids(policy.evict(3, ())) == [2, 1, 0]


def test_t1_preferred_while_at_or_above_target() -> None:
    policy = ARCCachePolicy(8)
    make_t2(policy, 0, 1)  # older, but frequent
    insert_ready(policy, 2)
    insert_ready(policy, 3)
    assert policy.target_t1_size == 0.0
    assert evicted_ids(policy.evict(2, ())) == [2, 3]
    assert ids(arc_lists(policy).b1) == [2, 3]


def test_t1_t2_eviction_policy_uses_virtual_t1_size() -> None:
    policy = ARCCachePolicy(8)
    make_t2(policy, 0, 1, 2)
    insert_ready(policy, 3)
    insert_ready(policy, 4)
    policy.target_t1_size = 2.7  # int() -> 2
    # T2 order (LRU first) is 2, 1, 0: make_t2's touch left its first key most recent.
    # |T1| = 2 >= 2: first victim from T1; then the virtual |T1| is 1 < 2: from T2.
    assert evicted_ids(policy.evict(3, ())) == [3, 2, 1]
    assert ids(arc_lists(policy).b1) == [3] and ids(arc_lists(policy).b2) == [2, 1]


def test_t2_preferred_below_target_with_fallback_to_t1() -> None:
    policy = ARCCachePolicy(8)
    make_t2(policy, 0)
    insert_ready(policy, 1)
    insert_ready(policy, 2)
    policy.target_t1_size = 5.0
    # |T1| = 2 < 5: T2 first; once T2 has no candidate left, fall back to T1.
    assert evicted_ids(policy.evict(3, ())) == [0, 1, 2]


def test_adaptive_target() -> None:
    policy = ARCCachePolicy(10)
    make_t2(policy, 1, 2, 3)
    insert_ready(policy, 0)
    assert evicted_ids(policy.evict(1, ())) == [0]  # T1 first
    assert evicted_ids(policy.evict(3, ())) == [3, 2, 1]  # then T2
    assert ids(arc_lists(policy).b1) == [0] and ids(arc_lists(policy).b2) == [3, 2, 1]

    policy.touch([k(0)])  # B1 hit: + max(1, |B2| / |B1|) = + 3
    assert policy.target_t1_size == pytest.approx(3.0)
    policy.touch([k(3)])  # B2 hit: - max(1, |B1| / |B2|) = - 1
    assert policy.target_t1_size == pytest.approx(2.0)
    assert ids(arc_lists(policy).b2) == [2, 1, 3], "a ghost hit moves the ghost to its MRU end"

    # A ghost adapts once: its re-reference was counted (a request deferred for several steps
    # touches and looks its keys up again every step).
    for _ in range(5):
        policy.touch([k(0)])
        policy.touch([k(3)])
        assert policy.lookup(k(0)) is None
    assert policy.target_t1_size == pytest.approx(2.0)
    assert ids(arc_lists(policy).b2) == [2, 1, 3]

    policy.target_t1_size = 9.5
    policy.touch([k(2)])  # B2 hit: - max(1, 1 / 3)
    assert policy.target_t1_size == pytest.approx(8.5)
    policy.target_t1_size = 0.5
    policy.touch([k(1)])
    assert policy.target_t1_size == 0.0, "floored at 0"


def test_target_is_capped_at_the_capacity() -> None:
    policy = ARCCachePolicy(10)
    make_t2(policy, 1, 2, 3)
    insert_ready(policy, 0)
    policy.evict(4, ())
    policy.target_t1_size = 9.0
    policy.touch([k(0)])  # B1 hit: + 3
    assert policy.target_t1_size == 10.0


def test_fractional_adaptation() -> None:
    policy = ARCCachePolicy(10)
    make_t2(policy, 0)
    insert_ready(policy, 1)
    insert_ready(policy, 2)
    insert_ready(policy, 3)
    assert evicted_ids(policy.evict(3, ())) == [1, 2, 3]
    assert evicted_ids(policy.evict(1, ())) == [0]
    # |B1| = 3, |B2| = 1: a B1 hit adds max(1, 1/3) = 1, a B2 hit removes max(1, 3/1) = 3.
    policy.touch([k(1)])
    policy.touch([k(2)])
    assert policy.target_t1_size == pytest.approx(2.0)
    policy.touch([k(0)])
    assert policy.target_t1_size == 0.0


def test_insert_removes_ghost() -> None:
    policy = ARCCachePolicy(8)
    insert_ready(policy, 0)
    make_t2(policy, 1)
    policy.evict(2, ())
    assert ids(arc_lists(policy).b1) == [0] and ids(arc_lists(policy).b2) == [1]
    policy.insert(k(0), BlockStatus(0))  # B1 hit: + max(1, |B2| / |B1|) = + 1
    assert policy.target_t1_size == 1.0
    policy.insert(k(1), BlockStatus(1))  # B2 hit: - max(1, |B1| / |B2|) = - 1
    assert policy.target_t1_size == 0.0
    assert ids(arc_lists(policy).b1) == [] and ids(arc_lists(policy).b2) == []
    # The paper's cases II and III: a block requested again after its eviction joins T2.
    assert sorted(ids(arc_lists(policy).t2)) == [0, 1] and not arc_lists(policy).t1


def assert_directory_bounds(policy: ARCCachePolicy) -> None:
    """The ARC paper's bounds: L1 = T1 + B1 holds at most c keys, the whole directory 2c."""
    t1, t2 = len(arc_lists(policy).t1), len(arc_lists(policy).t2)
    b1, b2 = len(arc_lists(policy).b1), len(arc_lists(policy).b2)
    capacity = policy.cache_capacity
    assert t1 + b1 <= capacity, f"|T1| + |B1| = {t1} + {b1} > c = {capacity}"
    assert t1 + t2 + b1 + b2 <= 2 * capacity, f"directory {t1 + t2 + b1 + b2} > 2c"


def test_ghost_lists_follow_the_arc_directory_bounds() -> None:
    capacity = 4
    policy = ARCCachePolicy(capacity)

    def store(i: int) -> None:
        """What the manager does for a new block: evict if full, insert, complete the store."""
        if len(policy) == capacity:
            assert policy.evict(1, ()) is not None
        insert_ready(policy, i)
        assert_directory_bounds(policy)

    # T1 alone fills the cache: L1 is c already, so a T1 victim leaves no ghost behind.
    for i in range(6):
        store(i)
    assert ids(arc_lists(policy).b1) == []
    # With two blocks in T2, B1 keeps the c - |T1| newest T1 victims, the oldest dropped first.
    policy.touch([k(4), k(5)])
    for i in range(6, 9):
        store(i)
    assert sorted(ids(arc_lists(policy).t1)) == [7, 8]
    assert ids(arc_lists(policy).b1) == [3, 6], "|T1| + |B1| = c: the oldest B1 ghost went first"

    # T2 victims fill B2 until the directory holds 2c keys; then B2's oldest ghosts go.
    policy.target_t1_size = 4.0  # |T1| < target: evict from T2
    for i in range(10, 14):
        store(i)
        policy.touch([k(i)])
    assert ids(arc_lists(policy).b1) == [6], "inserting 10 made L1 = c + 1"
    # T2 victims in order: 5, 4, 10, 11; the directory reached 2c + 1 when 13 came in.
    assert ids(arc_lists(policy).b2) == [4, 10, 11]
    assert len(policy) + len(arc_lists(policy).b1) + len(arc_lists(policy).b2) == 2 * capacity


def test_insert_many_keeps_the_bounds_of_one_insert_per_block() -> None:
    one_by_one = ARCCachePolicy(4)
    batched = ARCCachePolicy(4)
    for policy in (one_by_one, batched):
        for i in range(4):
            insert_ready(policy, i)
        policy.touch([k(0)])
        assert evicted_ids(policy.evict(3, ())) == [1, 2, 3]
        assert ids(arc_lists(policy).b1) == [1, 2, 3]
    # Storing ghost 2 and two new keys: ghost 2 moves to T2 (adapting), L1 grows by the two
    # new keys and stays within c: B1 keeps its other ghosts.
    for i in (2, 20, 21):
        one_by_one.insert(k(i), BlockStatus(i))
    batched.insert_many([(k(i), BlockStatus(i)) for i in (2, 20, 21)])
    for policy in (one_by_one, batched):
        assert ids(arc_lists(policy).b1) == [1, 3]
        assert sorted(ids(arc_lists(policy).t1)) == [20, 21]
        assert sorted(ids(arc_lists(policy).t2)) == [0, 2]
        assert policy.target_t1_size == 1.0
        assert_directory_bounds(policy)


def test_a_batch_trims_as_one_insert_per_block_would() -> None:
    """Found by review: trimming once after a whole batch kept a B2 ghost that one insert per
    block drops (the directory was full when the first block came in; only the second one's
    B1 trim made room)."""
    reference = "tests.v1.kv_offload.cpu.policies.reference_arc:ReferenceARCCachePolicy"
    ctx = ReqContext("r")
    states = []
    for policy_name in ("arc", reference):
        manager = CPUOffloadingManager(2, cache_policy=policy_name)
        for batch in ([3, 4], [1, 2]):
            out = manager.prepare_store([k(i) for i in batch], ctx)
            assert out is not None
            manager.complete_store(out.keys_to_store, ctx)
            manager.touch([k(i) for i in batch if i != 1], ctx)  # 1 stays in T1
        # Evicts 1 (to B1) and 2 (to B2): B1 = [1], B2 = [4, 3, 2], a full directory. Then
        # stores new key 0 (the directory overflows: B2 drops 4) and B2 ghost 3 (a ghost hit:
        # it joins T2, so L1 does not grow and B1 keeps 1).
        assert manager.prepare_store([k(0), k(3)], ctx) is not None
        policy = manager.policy
        assert isinstance(policy, (ARCCachePolicy, ReferenceARCCachePolicy))
        states.append((ids(arc_lists(policy).b1), ids(arc_lists(policy).b2)))
    assert states[0] == states[1] == ([1], [2])


def test_evict_skips_pinned_in_flight_and_protected() -> None:
    policy = ARCCachePolicy(16)
    insert_blocks(policy, pinned=[0], writing=[1], ready=[2])  # T1; 2 protected below
    make_t2(policy, 3, 4)
    pin(policy, 3)  # T2, pinned
    insert_ready(policy, 5)  # T1
    victims = policy.evict(2, {k(2)})
    assert evicted_ids(victims) == [5, 4]
    assert sorted(ids(key for key, _ in policy.items())) == [0, 1, 2, 3]


def test_pinned_t2_blocks_return_at_the_mru_end_and_are_walked_past_once() -> None:
    """A T2 block pinned in T2's order stays there until an eviction walks past it (then it is
    parked); either way its release puts it at T2's most recently used end, as the reference
    (which moves every pinned block out of the order at once) does."""
    for policy in (ARCCachePolicy(16), ReferenceARCCachePolicy(16)):
        make_t2(policy, 0, 1, 2, 3, 4, 5)  # T2, least recently used first: 5 4 3 2 1 0
        pin(policy, 5)
        pin(policy, 4)
        pin(policy, 2)
        assert policy.num_evictable == 3
        assert evicted_ids(policy.evict(1, ())) == [3]  # walks past 5 and 4
        unpin(policy, 2)  # never walked past: to the MRU end all the same
        assert policy.num_evictable == 3
        unpin(policy, 5)
        unpin(policy, 4)
        assert policy.num_evictable == 5
        assert sorted(ids(arc_lists(policy).t2)) == [0, 1, 2, 4, 5]
        assert evicted_ids(policy.evict(5, ())) == [1, 0, 2, 5, 4]
    # Only the first eviction walks past a pinned block: it parks it, out of T2's order.
    policy = ARCCachePolicy(16)
    make_t2(policy, 6, 7, 8)  # 8 7 6
    pin(policy, 8)
    pin(policy, 7)
    assert arc_lists(policy).t2_order == [k(8), k(7), k(6)]
    assert evicted_ids(policy.evict(1, ())) == [6]
    assert arc_lists(policy).t2_order == [] and arc_lists(policy).t2_parked == {k(7), k(8)}
    assert policy.num_evictable == 0 and policy.evict(1, ()) is None
    unpin(policy, 7)
    assert arc_lists(policy).t2_order == [k(7)] and policy.num_evictable == 1


def test_failed_eviction_changes_nothing() -> None:
    policy = ARCCachePolicy(16)
    insert_blocks(policy, pinned=[0], writing=[1])
    make_t2(policy, 2, 3)
    insert_ready(policy, 4)
    policy.target_t1_size = 1.5

    def snapshot() -> object:
        return (
            sorted((key, block.block_id, block.ref_cnt) for key, block in policy.items()),
            sorted(arc_lists(policy).t1),
            sorted(arc_lists(policy).t2),
            list(arc_lists(policy).b1),
            list(arc_lists(policy).b2),
            policy.target_t1_size,
            policy.num_evictable,
        )

    before = snapshot()
    assert policy.evict(3, {k(2)}) is None  # candidates: 3 and 4 only
    assert policy.evict(6, ()) is None
    assert snapshot() == before
    # |T1| = 3 >= 1: T1 first (4); virtual |T1| = 2 >= 1 but T1 has no candidate left: T2.
    assert evicted_ids(policy.evict(3, ())) == [4, 3, 2]


def test_evict_visits_only_evictable_entries() -> None:
    """The bound of ``test_base``'s walk of T1, with pinned blocks in T2 and a walk of T2."""
    policy = ARCCachePolicy(10_000)
    insert_blocks(policy, pinned=range(1000), writing=range(1000, 3000), ready=range(3000, 3004))
    policy.touch([k(i) for i in range(500)])  # pinned T2 blocks
    make_t2(policy, 4000, 4001)
    protected = CountingSet({k(3000), k(4000), k(7)})
    policy.target_t1_size = 3000.0  # |T1| = 2504 < 3000: T2 first
    assert evicted_ids(policy.evict(3, protected)) == [4001, 3001, 3002]
    # T2: 4000 skipped, 4001 taken, T2 exhausted; T1: 3000 skipped, 3001, 3002 taken.
    assert protected.lookups == 5


def test_remove_leaves_no_ghost() -> None:
    """Removal of a T1 and a T2 block (``test_base`` checks the rest of ``remove``)."""
    policy = ARCCachePolicy(8)
    insert_ready(policy, 0)
    make_t2(policy, 1)
    policy.remove(k(0))
    policy.remove(k(1))
    assert list(arc_lists(policy).b1) == [] and list(arc_lists(policy).b2) == []


def test_clear_resets_everything() -> None:
    policy = ARCCachePolicy(8)
    insert_ready(policy, 0)
    make_t2(policy, 1)
    policy.evict(2, ())
    policy.touch([k(0)])
    insert_ready(policy, 2)
    pin(policy, 2)
    assert policy.target_t1_size > 0
    policy.clear()
    assert len(policy) == 0
    assert policy.target_t1_size == 0.0
    assert list(arc_lists(policy).b1) == [] and list(arc_lists(policy).b2) == []
    assert policy.evict(1, ()) is None
