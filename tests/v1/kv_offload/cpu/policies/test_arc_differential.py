"""Differential test: ARCCachePolicy against the straightforward reference implementation.

``ARCCachePolicy`` keeps resident blocks and ghosts in one dict and its orders in FIFOs with lazy
deletion and periodic compaction. Hypothesis drives it and ``ReferenceARCCachePolicy`` (ordered
dicts, no laziness) through the same calls, the way the CPU manager makes them, and requires
identical observable state after every step: list membership and order, target size, eviction
results. Batched inserts (``insert_many``, which trims the ghost lists once per batch) are checked
against one reference ``insert`` per block. The compaction slack is lowered so compaction runs
all the time.
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.v1.kv_offload.cpu.policies.reference_arc import ReferenceARCCachePolicy
from tests.v1.kv_offload.cpu.policies.utils import k
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy

UNIVERSE = [k(i) for i in range(20)]
key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=6)


class ARCDifferentialMachine(RuleBasedStateMachine):
    capacity: ClassVar[int] = 4
    compact_slack: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.fast = ARCCachePolicy(self.capacity)
        self.fast._COMPACT_SLACK = self.compact_slack
        self.ref = ReferenceARCCachePolicy(self.capacity)
        self.next_block_id = 0

    def _both(self) -> tuple[CachePolicy, CachePolicy]:
        return self.fast, self.ref

    def _resident(self) -> list[OffloadKey]:
        return [key for key in UNIVERSE if self.ref.get(key) is not None]

    @rule(key=st.sampled_from(UNIVERSE))
    def insert_being_written(self, key: OffloadKey) -> None:
        if self.ref.get(key) is not None:
            return
        block_id = self.next_block_id
        self.next_block_id += 1
        for policy in self._both():
            policy.insert(key, BlockStatus(block_id))

    @rule(keys=key_lists)
    def insert_batch(self, keys: list[OffloadKey]) -> None:
        """The manager's path: ``insert_many`` here, one ``insert`` per block in the reference."""
        new_keys = [key for key in dict.fromkeys(keys) if self.ref.get(key) is None]
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
        assert fast.t1_keys == ref.t1_keys
        assert fast.t2_keys == ref.t2_keys
        assert fast.b1_keys == ref.b1_keys
        assert fast.b2_keys == ref.b2_keys
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
    compact_slack = ARCCachePolicy._COMPACT_SLACK
    capacity = 3


TestARCDifferentialDefaultSlack = _DefaultSlack.TestCase
TestARCDifferentialDefaultSlack.settings = _SETTINGS
