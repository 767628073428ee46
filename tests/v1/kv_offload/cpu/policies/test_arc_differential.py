# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Differential test: ARCCachePolicy against the straightforward reference implementation.

``ARCCachePolicy`` keeps resident blocks and ghosts in one dict and its orders in FIFOs with lazy
deletion and periodic compaction. Hypothesis drives it and ``ReferenceARCCachePolicy`` (ordered
dicts, no laziness) through the same calls, the way the CPU manager makes them, and requires
identical observable state after every step: list membership and order, target size, eviction
results. Lookups are driven too: a lookup that misses on a ghost adapts the target, once per
ghost, as touches and stores of ghost keys do. Inserts first evict what they need, as the manager
does, so at most ``capacity`` blocks are ever resident. Batched inserts (``insert_many``, which
trims the ghost lists once per batch while the batch holds new keys only) are checked against one
reference ``insert`` per block. The compaction slack is lowered so compaction runs all the time.
"""

from __future__ import annotations

import random
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.v1.kv_offload.cpu.policies.reference_arc import ReferenceARCCachePolicy
from tests.v1.kv_offload.cpu.policies.utils import arc_lists, k
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy

UNIVERSE = [k(i) for i in range(20)]
key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=6)


class ARCDifferentialMachine(RuleBasedStateMachine):
    capacity: ClassVar[int] = 4
    compact_slack: ClassVar[int | None] = 0  # None: ARC's own

    def __init__(self) -> None:
        super().__init__()
        self.fast = ARCCachePolicy(self.capacity)
        if self.compact_slack is not None:
            # private: a tuning constant, not configuration: only this test varies it
            # (compactions often).
            self.fast._COMPACT_SLACK = self.compact_slack
        self.ref = ReferenceARCCachePolicy(self.capacity)
        self.next_block_id = 0

    def _both(self) -> tuple[CachePolicy, CachePolicy]:
        return self.fast, self.ref

    def _resident(self) -> list[OffloadKey]:
        return [key for key in UNIVERSE if self.ref.get(key) is not None]

    def _make_room(self, new_keys: list[OffloadKey]) -> bool:
        """Evict what storing ``new_keys`` needs, as the manager's ``prepare_store`` does."""
        need = len(self.ref) + len(new_keys) - self.capacity
        if need <= 0:
            return True
        fast = self.fast.evict(need, set(new_keys))
        ref = self.ref.evict(need, set(new_keys))
        assert (fast is None) == (ref is None)
        if ref is None or fast is None:
            return False
        assert [(key, b.block_id) for key, b in fast] == [(key, b.block_id) for key, b in ref]
        return True

    @rule(key=st.sampled_from(UNIVERSE))
    def insert_being_written(self, key: OffloadKey) -> None:
        if self.ref.get(key) is not None or not self._make_room([key]):
            return
        block_id = self.next_block_id
        self.next_block_id += 1
        for policy in self._both():
            policy.insert(key, BlockStatus(block_id))

    @rule(keys=key_lists)
    def insert_batch(self, keys: list[OffloadKey]) -> None:
        """The manager's path: ``insert_many`` here, one ``insert`` per block in the reference."""
        new_keys = [key for key in dict.fromkeys(keys) if self.ref.get(key) is None]
        if len(new_keys) > self.capacity or not self._make_room(new_keys):
            return
        items = [(key, self.next_block_id + i) for i, key in enumerate(new_keys)]
        self.next_block_id += len(new_keys)
        self.fast.insert_many([(key, BlockStatus(block_id)) for key, block_id in items])
        for key, block_id in items:
            self.ref.insert(key, BlockStatus(block_id))

    @rule(key=st.sampled_from(UNIVERSE))
    def complete_store(self, key: OffloadKey) -> None:
        for policy in self._both():
            block = policy.get(key)
            if block is not None and block.ref_cnt == -1:
                block.ref_cnt = 0
                policy.mark_evictable(key)

    @rule(key=st.sampled_from(UNIVERSE))
    def fail_store(self, key: OffloadKey) -> None:
        for policy in self._both():
            block = policy.get(key)
            if block is not None and block.ref_cnt == -1:
                policy.remove(key)

    @rule(key=st.sampled_from(UNIVERSE))
    def pin(self, key: OffloadKey) -> None:
        for policy in self._both():
            block = policy.get(key)
            if block is not None and block.ref_cnt >= 0:
                if block.ref_cnt == 0:
                    policy.mark_non_evictable(key)
                block.ref_cnt += 1

    @rule(key=st.sampled_from(UNIVERSE))
    def unpin(self, key: OffloadKey) -> None:
        for policy in self._both():
            block = policy.get(key)
            if block is not None and block.ref_cnt > 0:
                block.ref_cnt -= 1
                if block.ref_cnt == 0:
                    policy.mark_evictable(key)

    @rule(keys=key_lists)
    def touch(self, keys: list[OffloadKey]) -> None:
        for policy in self._both():
            policy.touch(keys)

    @rule(key=st.sampled_from(UNIVERSE))
    def lookup(self, key: OffloadKey) -> None:
        """A request's lookup: a miss on a ghost adapts the target (once per ghost)."""
        fast, ref = self.fast.lookup(key), self.ref.lookup(key)
        assert (fast is None) == (ref is None)

    @rule(n=st.integers(0, 5), protected=key_lists)
    def evict(self, n: int, protected: list[OffloadKey]) -> None:
        fast = self.fast.evict(n, set(protected))
        ref = self.ref.evict(n, set(protected))
        if ref is None:
            assert fast is None
            return
        assert fast is not None
        assert [(key, b.block_id) for key, b in fast] == [(key, b.block_id) for key, b in ref]

    @precondition(lambda self: self.next_block_id % 7 == 6)
    @rule()
    def clear(self) -> None:
        for policy in self._both():
            policy.clear()

    @invariant()
    def same_observable_state(self) -> None:
        fast, ref = self.fast, self.ref
        assert arc_lists(fast).t1 == ref.t1_keys
        assert arc_lists(fast).t2 == ref.t2_keys
        assert arc_lists(fast).b1 == ref.b1_keys
        assert arc_lists(fast).b2 == ref.b2_keys
        assert fast.target_t1_size == ref.target_t1_size
        assert len(fast) == len(ref)
        assert fast.num_evictable == ref.num_evictable
        assert sorted(key for key, _ in fast.items()) == sorted(key for key, _ in ref.items())
        for key in UNIVERSE:
            fb, rb = fast.get(key), ref.get(key)
            assert (fb is None) == (rb is None), f"key {key.hex()}"
            if fb is not None and rb is not None:
                assert (fb.block_id, fb.ref_cnt) == (rb.block_id, rb.ref_cnt), f"key {key.hex()}"


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestARCDifferentialEagerCompaction = ARCDifferentialMachine.TestCase
TestARCDifferentialEagerCompaction.settings = _SETTINGS


class _DefaultSlack(ARCDifferentialMachine):
    compact_slack = None
    capacity = 3


TestARCDifferentialDefaultSlack = _DefaultSlack.TestCase
TestARCDifferentialDefaultSlack.settings = _SETTINGS


class _Tiny(ARCDifferentialMachine):
    """Capacity 2: the bounds bind on almost every insert, so batches trim both ghost lists."""

    capacity = 2


TestARCDifferentialTiny = _Tiny.TestCase
TestARCDifferentialTiny.settings = _SETTINGS


# -- the same comparison through two managers, by random walk ---------------------------------

_REFERENCE = "tests.v1.kv_offload.cpu.policies.reference_arc:ReferenceARCCachePolicy"


def _observable(manager: CPUOffloadingManager) -> tuple[object, ...]:
    policy = manager.policy
    assert isinstance(policy, (ARCCachePolicy, ReferenceARCCachePolicy))
    return (
        arc_lists(policy).t1,
        arc_lists(policy).t2,
        arc_lists(policy).b1,
        arc_lists(policy).b2,
        policy.target_t1_size,
        sorted((key, b.block_id, b.ref_cnt) for key, b in policy.items()),
    )


@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_random_manager_walks_agree_with_the_reference(capacity: int) -> None:
    """Random prepare/complete/load/touch walks through the CPU manager: short batches over few
    keys reach the full-directory states (both ghost lists non-empty, a batch mixing new keys and
    ghosts) that the rule-based machine above rarely builds."""
    ctx = ReqContext("r")
    keys = [k(i) for i in range(3 * capacity + 2)]
    for seed in range(150):
        rng = random.Random(seed)
        managers = [CPUOffloadingManager(capacity, cache_policy=p) for p in ("arc", _REFERENCE)]
        pinned: list[list[OffloadKey]] = []
        for _ in range(60):
            op = rng.random()
            batch = rng.sample(keys, rng.randint(1, min(3, capacity)))
            if op < 0.5:
                outs = [m.prepare_store(batch, ctx) for m in managers]
                assert (outs[0] is None) == (outs[1] is None), seed
                if outs[0] is not None and outs[1] is not None:
                    assert outs[0].keys_to_store == outs[1].keys_to_store, seed
                    ok = rng.random() < 0.9
                    for m, out in zip(managers, outs, strict=True):
                        m.complete_store(out.keys_to_store, ctx, success=ok)
            elif op < 0.8:
                for m in managers:
                    m.touch(batch, ctx)
            elif op < 0.9:
                # Lookups adapt on ghosts: both managers look up exactly the same keys.
                answers = [[m.lookup(key, ctx) for key in batch] for m in managers]
                assert answers[0] == answers[1], seed
                ready = [key for key, hit in zip(batch, answers[1], strict=True) if hit]
                if ready:
                    for m in managers:
                        m.prepare_load(ready, ctx)
                    pinned.append(ready)
            elif pinned:
                done = pinned.pop(rng.randrange(len(pinned)))
                for m in managers:
                    m.complete_load(done, ctx)
            assert _observable(managers[0]) == _observable(managers[1]), seed
