"""Hypothesis state machine of CPUOffloadingManager against a dict model, for each policy.

The model maps each resident key to its ref count (-1 being written, n >= 0 ready with n
readers) and its slot. After every step the manager must agree with it: lookups, ref counts,
slots, slot accounting, stats, and the running balance of stored/removed events.
"""

from __future__ import annotations

from typing import ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

UNIVERSE = [make_offload_key(bytes([i + 1]) * 4, i % 2) for i in range(14)]
CTX = ReqContext("req")

key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=7)


class CPUManagerMachine(RuleBasedStateMachine):
    policy_name: ClassVar[str] = "lru"
    capacity: ClassVar[int] = 6

    def __init__(self) -> None:
        super().__init__()
        self.manager = CPUOffloadingManager(
            self.capacity, cache_policy=self.policy_name, enable_events=True
        )
        self.ref: dict[OffloadKey, int] = {}
        self.slot: dict[OffloadKey, int] = {}
        self.store_jobs: list[list[OffloadKey]] = []
        self.load_jobs: list[list[OffloadKey]] = []
        self.announced: set[OffloadKey] = set()  # stored events minus removed events
        self.hits = 0
        self.misses = 0

    # -- helpers ------------------------------------------------------------------------------

    def ready_keys(self) -> list[OffloadKey]:
        return [key for key, ref in self.ref.items() if ref >= 0]

    # -- rules --------------------------------------------------------------------------------

    @rule(key=st.sampled_from(UNIVERSE))
    def lookup(self, key: OffloadKey) -> None:
        result = self.manager.lookup(key, CTX)
        ref = self.ref.get(key)
        if ref is None:
            assert result is False
            self.misses += 1
        elif ref < 0:
            assert result is None
        else:
            assert result is True
            self.hits += 1

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        requested = set(keys)
        new = list(dict.fromkeys(key for key in keys if key not in self.ref))
        need = len(new) - (self.capacity - len(self.ref))
        candidates = {key for key, ref in self.ref.items() if ref == 0 and key not in requested}

        out = self.manager.prepare_store(keys, CTX)

        if need > len(candidates):
            assert out is None, f"expected failure: need {need}, {len(candidates)} candidates"
            return  # the invariants check that nothing changed
        assert out is not None
        assert out.keys_to_store == new
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        evicted = out.evicted_keys
        assert len(evicted) == max(need, 0)
        assert len(set(evicted)) == len(evicted)
        assert not set(evicted) & requested, "a key passed to prepare_store was evicted by it"
        for key in evicted:
            assert key in candidates, f"evicted {key.hex()} with ref_cnt {self.ref.get(key)}"
            del self.ref[key]
            del self.slot[key]
        new_slots = [int(s) for s in out.store_spec.block_ids]
        assert len(new_slots) == len(new)
        assert all(0 <= s < self.capacity for s in new_slots)
        assert not set(new_slots) & set(self.slot.values()), "slot handed out twice"
        for key, s in zip(new, new_slots, strict=True):
            self.ref[key] = -1
            self.slot[key] = s
        if new:
            self.store_jobs.append(new)

    @precondition(lambda self: self.store_jobs)
    @rule(data=st.data(), success=st.booleans())
    def complete_store_job(self, data: st.DataObject, success: bool) -> None:
        index = data.draw(st.integers(0, len(self.store_jobs) - 1), label="job")
        self._complete_store(self.store_jobs.pop(index), success)

    @rule(keys=key_lists, success=st.booleans())
    def complete_store_any(self, keys: list[OffloadKey], success: bool) -> None:
        """Completions naming ready, absent or other jobs' keys change only not-ready blocks."""
        self._complete_store(keys, success)

    def _complete_store(self, keys: list[OffloadKey], success: bool) -> None:
        self.manager.complete_store(keys, CTX, success=success)
        for key in keys:
            if self.ref.get(key) == -1:
                if success:
                    self.ref[key] = 0
                else:
                    del self.ref[key]
                    del self.slot[key]

    @precondition(lambda self: any(ref >= 0 for ref in self.ref.values()))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.ready_keys()), min_size=1, max_size=4))
        spec = self.manager.prepare_load(keys, CTX)
        assert isinstance(spec, CPULoadStoreSpec)
        assert [int(s) for s in spec.block_ids] == [self.slot[key] for key in keys]
        for key in keys:
            self.ref[key] += 1
        self.load_jobs.append(keys)

    @precondition(lambda self: self.load_jobs)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.load_jobs) - 1), label="job")
        keys = self.load_jobs.pop(index)
        self.manager.complete_load(keys, CTX)
        for key in keys:
            self.ref[key] -= 1

    @rule(keys=key_lists)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.manager.touch(keys, CTX)

    @rule()
    def reset_cache(self) -> None:
        self.manager.reset_cache()
        self.ref.clear()
        self.slot.clear()
        self.store_jobs.clear()
        self.load_jobs.clear()
        self.hits = 0
        self.misses = 0

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def events_balance(self) -> None:
        for event in self.manager.take_events():
            assert event.medium == "CPU"
            for key in event.keys:
                if event.removed:
                    assert key in self.announced, f"removal of unannounced {key.hex()}"
                    self.announced.remove(key)
                else:
                    assert key not in self.announced, f"{key.hex()} announced twice"
                    self.announced.add(key)
        assert self.announced == set(self.ready_keys())

    @invariant()
    def slots_account(self) -> None:
        manager = self.manager
        assert manager.num_free_blocks + len(manager.policy) == self.capacity
        assert len(manager.policy) == len(self.ref)
        assert len(set(self.slot.values())) == len(self.slot)
        stats = manager.get_stats()
        assert stats["used_blocks"] == len(self.ref)
        assert stats["hits"] == self.hits and stats["misses"] == self.misses

    @invariant()
    def ref_counts_and_slots_match(self) -> None:
        policy = self.manager.policy
        for key, ref in self.ref.items():
            block = policy.get(key)
            assert block is not None, f"{key.hex()} missing"
            assert block.ref_cnt == ref, f"{key.hex()}: ref_cnt {block.ref_cnt} != model {ref}"
            assert block.block_id == self.slot[key]
        for key in UNIVERSE:
            if key not in self.ref:
                assert policy.get(key) is None, f"{key.hex()} resident but not in the model"

    @invariant()
    def policy_indexes_consistent(self) -> None:
        """The policy's evictable index holds exactly the ready, unpinned blocks."""
        policy = self.manager.policy
        assert isinstance(policy, (LRUCachePolicy, ARCCachePolicy))
        assert policy.num_evictable == sum(1 for ref in self.ref.values() if ref == 0)
        if isinstance(policy, ARCCachePolicy):
            t1, t2 = set(policy.t1_keys), set(policy.t2_keys)
            assert not t1 & t2
            assert t1 | t2 == set(self.ref)
            assert not (set(policy.b1_keys) | set(policy.b2_keys)) & set(self.ref)
            # The ARC paper's directory bounds: |T1| + |B1| <= c, all four lists <= 2c.
            b1, b2 = len(policy.b1_keys), len(policy.b2_keys)
            assert len(t1) + b1 <= self.capacity
            assert len(t1) + len(t2) + b1 + b2 <= 2 * self.capacity
            assert 0.0 <= policy.target_t1_size <= self.capacity


_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class LRUManagerMachine(CPUManagerMachine):
    policy_name = "lru"


class ARCManagerMachine(CPUManagerMachine):
    policy_name = "arc"


class TinyARCManagerMachine(CPUManagerMachine):
    """Capacity 2: eviction pressure and all-pinned failures on almost every step."""

    policy_name = "arc"
    capacity = 2


TestLRUManagerStateful = LRUManagerMachine.TestCase
TestLRUManagerStateful.settings = _SETTINGS
TestARCManagerStateful = ARCManagerMachine.TestCase
TestARCManagerStateful.settings = _SETTINGS
TestTinyARCManagerStateful = TinyARCManagerMachine.TestCase
TestTinyARCManagerStateful.settings = settings(_SETTINGS, max_examples=60)
