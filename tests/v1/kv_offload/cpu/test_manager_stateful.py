# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Hypothesis state machine of CPUOffloadingManager against a dict model, for each policy.

The model maps each resident key to its ref count (-1 being written, n >= 0 ready with n
readers) and its slot, each pending store to the request that prepared it, and each request to
the pins it holds. Several requests act at once, and besides well-behaved callers the machine
plays misbehaving ones: stray, duplicate, foreign and out-of-order completions, loads of blocks
that are not readable, values that are not keys, and calls after ``shutdown()``. A
``complete_store`` ignores the keys that are absent or already stored (upstream vLLM's
contract) and is refused only for a key another request is writing.

Every call is checked against the model's prediction. A call the model deems legitimate must
succeed and change exactly what the model says; any other must raise a clean error (the
manager's ``OffloadKeyStateError``, ``TypeError`` or ``RuntimeError``, never an
``AssertionError``) and leave the manager's observable state exactly as it was: every key's
state, slot and pins, the pending stores, the slot accounting and free list, the statistics,
the pending events and the policy's eviction order. After every step the manager must agree
with the model and pass its own ``check_invariants()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from typing_extensions import override

from tests.v1.kv_offload.cpu.manager_state import (
    check_invariants,
    free_rows,
    load_pins,
    pending_events,
    pending_stores,
)
from tests.v1.kv_offload.cpu.policies.utils import arc_lists, lru_order
from tests.v1.kv_offload.refusal_machine import (
    RefusalMachine,
    Refused,
    long_fuzz,
    refused,
)
from vllm.v1.kv_offload.base import (
    OffloadKey,
    OffloadKeyStateError,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

UNIVERSE = [make_offload_key(bytes([i + 1]) * 4, i % 2) for i in range(14)]
REQS = [ReqContext(f"req-{i}") for i in range(3)]

key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=7)
reqs = st.sampled_from(REQS)


class CPUManagerMachine(RefusalMachine):
    key_lists = key_lists
    reqs = reqs
    policy_name: ClassVar[str] = "lru"
    capacity: ClassVar[int] = 6

    def __init__(self) -> None:
        super().__init__()
        self.manager = CPUOffloadingManager(
            self.capacity, cache_policy=self.policy_name, enable_events=True
        )
        self.ref: dict[OffloadKey, int] = {}
        self.slot: dict[OffloadKey, int] = {}
        self.writer: dict[OffloadKey, str] = {}  # pending store -> the request that prepared it
        self.pins: dict[str, Counter[OffloadKey]] = {ctx.req_id: Counter() for ctx in REQS}
        # Completions a well-behaved caller would send (legitimate until something changes).
        self.store_jobs: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.load_jobs: list[tuple[ReqContext, list[OffloadKey]]] = []
        # Completions already sent (or made stale by reset_cache): replaying one is a duplicate.
        self.sent: list[tuple[str, ReqContext, list[OffloadKey]]] = []
        self.announced: set[OffloadKey] = set()  # stored events minus removed events
        self.hits = 0
        self.misses = 0
        self.shut_down = False
        self.steps = 0

    # -- helpers ------------------------------------------------------------------------------

    def ready_keys(self) -> list[OffloadKey]:
        return [key for key, ref in self.ref.items() if ref >= 0]

    @override
    def observe(self) -> Any:
        """Everything a refused call must leave unchanged."""
        manager = self.manager
        policy = manager.policy
        order: Any = lru_order(policy) if isinstance(policy, LRUCachePolicy) else None
        if order is None:
            assert isinstance(policy, ARCCachePolicy)
            order = (arc_lists(policy), policy.target_t1_size)
        return (
            sorted((key, block.block_id, block.ref_cnt) for key, block in policy.items()),
            order,
            free_rows(manager),
            manager.num_free_blocks,
            manager.get_stats(),
            pending_events(manager),
            {ctx.req_id: load_pins(manager, ctx.req_id) for ctx in REQS},
            {ctx.req_id: pending_stores(manager, ctx.req_id) for ctx in REQS},
        )

    # -- well-behaved callers -----------------------------------------------------------------

    @rule(key=st.sampled_from(UNIVERSE), ctx=reqs)
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> None:
        self.lookup_prefix([key], ctx)

    @override
    def prefix_reaches(self, keys: list[OffloadKey]) -> bool:
        return all(self.ref.get(key) is not None for key in keys)

    @rule(keys=key_lists, ctx=reqs)
    @override
    def lookup_prefix(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """``lookup`` of one key, or ``lookup_prefix`` of several: each key in order up to the
        first miss."""

        def predict() -> Callable[[], None]:
            def apply() -> None:
                expected: list[bool | None] = []
                for key in keys:
                    ref = self.ref.get(key)
                    if ref is None:
                        expected.append(False)
                        self.misses += 1
                        break
                    expected.append(None if ref < 0 else True)
                    self.hits += ref >= 0
                assert result == expected

            return apply

        result: list[bool | None] = []

        def act() -> None:
            nonlocal result
            if len(keys) == 1:
                result = [self.manager.lookup(keys[0], ctx)]
            else:
                result = self.manager.lookup_prefix(keys, ctx)

        self.call(predict, act)

    @rule(keys=key_lists, ctx=reqs)
    def prepare_store(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        requested = set(keys)
        new = list(dict.fromkeys(key for key in keys if key not in self.ref))
        need = len(new) - (self.capacity - len(self.ref))
        candidates = {key for key, ref in self.ref.items() if ref == 0 and key not in requested}
        out: Any = None

        def act() -> None:
            nonlocal out
            out = self.manager.prepare_store(keys, ctx)

        def predict() -> Callable[[], None]:
            return apply

        def apply() -> None:
            if need > len(candidates):
                assert out is None, f"expected failure: need {need}, {len(candidates)} candidates"
                return
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
                self.writer[key] = ctx.req_id
            if new:
                self.store_jobs.append((ctx, new))

        self.call(predict, act)

    @precondition(lambda self: self.store_jobs)
    @rule(data=st.data(), success=st.booleans())
    def complete_store_job(self, data: st.DataObject, success: bool) -> None:
        """A job's completion, in any order; maybe only part of it (the rest comes later)."""
        index = data.draw(st.integers(0, len(self.store_jobs) - 1), label="job")
        ctx, keys = self.store_jobs.pop(index)
        part = data.draw(st.lists(st.sampled_from(keys), min_size=1, unique=True), label="part")
        if len(part) < len(keys):
            self.store_jobs.append((ctx, [key for key in keys if key not in part]))
        self._complete_store(part, ctx, success)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def complete_load_job(self, data: st.DataObject) -> None:
        """An outstanding load's completion (exact), or some of a request's pins (partial)."""
        jobs = [(ctx, keys) for ctx, keys in self.load_jobs if self._holds(ctx, keys)]
        if jobs and data.draw(st.booleans(), label="exact"):
            ctx, keys = data.draw(st.sampled_from(jobs), label="job")
            self.load_jobs.remove((ctx, keys))
        else:
            ctx = data.draw(st.sampled_from([c for c in REQS if self.pins[c.req_id]]))
            held = list(self.pins[ctx.req_id].elements())
            keys = data.draw(st.permutations(held), label="order")[
                : data.draw(st.integers(1, len(held)), label="n")
            ]
        self._complete_load(keys, ctx)

    @precondition(lambda self: any(ref >= 0 for ref in self.ref.values()))
    @rule(data=st.data(), ctx=reqs)
    def prepare_load(self, data: st.DataObject, ctx: ReqContext) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.ready_keys()), min_size=1, max_size=4))
        self._prepare_load(keys, ctx)

    @rule(keys=key_lists, ctx=reqs)
    def touch(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        self.call(lambda: lambda: None, lambda: self.manager.touch(keys, ctx))

    @rule()
    def reset_cache(self) -> None:
        def apply() -> None:
            self.ref.clear()
            self.slot.clear()
            self.writer.clear()
            for pins in self.pins.values():
                pins.clear()
            self.sent += [("store", ctx, keys) for ctx, keys in self.store_jobs]
            self.sent += [("load", ctx, keys) for ctx, keys in self.load_jobs]
            self.store_jobs.clear()
            self.load_jobs.clear()
            self.hits = 0
            self.misses = 0

        self.call(lambda: apply, self.manager.reset_cache)

    @precondition(lambda self: self.steps >= 40)
    @rule()
    def shutdown(self) -> None:
        self.manager.shutdown()
        self.shut_down = True

    # -- misbehaving callers ------------------------------------------------------------------

    @rule(keys=key_lists.filter(bool), ctx=reqs)
    def prepare_load_any(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """Keys that may be absent or being written."""
        self._prepare_load(keys, ctx)

    @precondition(lambda self: self.store_jobs)
    @rule(data=st.data(), success=st.booleans(), foreign=st.booleans())
    def complete_store_misdirected(self, data: st.DataObject, success: bool, foreign: bool) -> None:
        """A pending job's keys completed by another request, or with one key too many."""
        ctx, keys = data.draw(st.sampled_from(self.store_jobs), label="job")
        if foreign:
            other = data.draw(st.sampled_from([c for c in REQS if c is not ctx]), label="other")
            self._complete_store(list(keys), other, success)
        else:
            mixed = list(keys)
            mixed.insert(
                data.draw(st.integers(0, len(mixed)), label="at"),
                data.draw(st.sampled_from(UNIVERSE), label="extra"),
            )
            self._complete_store(mixed, ctx, success)

    @precondition(lambda self: self.load_jobs)
    @rule(data=st.data(), foreign=st.booleans())
    def complete_load_misdirected(self, data: st.DataObject, foreign: bool) -> None:
        """An outstanding load's keys released by another request, or with one key too many."""
        ctx, keys = data.draw(st.sampled_from(self.load_jobs), label="job")
        if foreign:
            other = data.draw(st.sampled_from([c for c in REQS if c is not ctx]), label="other")
            self._complete_load(list(keys), other)
        else:
            mixed = list(keys)
            mixed.insert(
                data.draw(st.integers(0, len(mixed)), label="at"),
                data.draw(st.sampled_from(UNIVERSE), label="extra"),
            )
            self._complete_load(mixed, ctx)

    @rule(ctx=reqs, method=st.sampled_from(["prepare_store", "prepare_load", "complete_store"]))
    def single_bytes_as_keys(self, ctx: ReqContext, method: str) -> None:
        """One key passed where a collection belongs (iterating it yields ints)."""
        act = getattr(self.manager, method)
        self.call(refused(TypeError), lambda: act(UNIVERSE[0], ctx))

    # -- predictions --------------------------------------------------------------------------

    def _holds(self, ctx: ReqContext, keys: list[OffloadKey]) -> bool:
        return not Counter(keys) - self.pins[ctx.req_id]

    @override
    def _complete_store(self, keys: list[OffloadKey], ctx: ReqContext, success: bool) -> None:
        def predict() -> Callable[[], None]:
            # Upstream's contract: keys absent or ready are ignored; another request's pending
            # store is refused.
            if any(self.writer.get(key, ctx.req_id) != ctx.req_id for key in keys):
                raise Refused(OffloadKeyStateError)

            def apply() -> None:
                for key in dict.fromkeys(keys):
                    if self.writer.get(key) != ctx.req_id:
                        continue
                    del self.writer[key]
                    if success:
                        self.ref[key] = 0
                    else:
                        del self.ref[key]
                        del self.slot[key]
                for _, job in self.store_jobs:
                    job[:] = [key for key in job if key not in keys]
                self.store_jobs[:] = [(c, job) for c, job in self.store_jobs if job]
                self.sent.append(("store", ctx, keys))

            return apply

        self.call(predict, lambda: self.manager.complete_store(keys, ctx, success=success))

    @override
    def _complete_load(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        def predict() -> Callable[[], None]:
            if not self._holds(ctx, keys):
                raise Refused(OffloadKeyStateError)

            def apply() -> None:
                self.pins[ctx.req_id] -= Counter(keys)
                for key in keys:
                    self.ref[key] -= 1
                self.sent.append(("load", ctx, keys))

            return apply

        self.call(predict, lambda: self.manager.complete_load(keys, ctx))

    def _prepare_load(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        spec: Any = None

        def act() -> None:
            nonlocal spec
            spec = self.manager.prepare_load(keys, ctx)

        def predict() -> Callable[[], None]:
            if any(self.ref.get(key, -1) < 0 for key in keys):
                raise Refused(OffloadKeyStateError)

            def apply() -> None:
                assert isinstance(spec, CPULoadStoreSpec)
                assert [int(s) for s in spec.block_ids] == [self.slot[key] for key in keys]
                for key in keys:
                    self.ref[key] += 1
                self.pins[ctx.req_id].update(keys)
                self.load_jobs.append((ctx, keys))

            return apply

        self.call(predict, act)

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
    def ref_counts_slots_pins_and_writers_match(self) -> None:
        manager = self.manager
        policy = manager.policy
        for key, ref in self.ref.items():
            block = policy.get(key)
            assert block is not None, f"{key.hex()} missing"
            assert block.ref_cnt == ref, f"{key.hex()}: ref_cnt {block.ref_cnt} != model {ref}"
            assert block.block_id == self.slot[key]
            if ref > 0:
                assert ref == sum(pins[key] for pins in self.pins.values())
        for key in UNIVERSE:
            if key not in self.ref:
                assert policy.get(key) is None, f"{key.hex()} resident but not in the model"
        for ctx in REQS:
            assert load_pins(manager, ctx.req_id) == +self.pins[ctx.req_id]
            pending = [key for key, req in self.writer.items() if req == ctx.req_id]
            assert sorted(pending_stores(manager, ctx.req_id)) == sorted(pending)
        check_invariants(manager)

    @invariant()
    def policy_indexes_consistent(self) -> None:
        """The policy's evictable index holds exactly the ready, unpinned blocks."""
        policy = self.manager.policy
        assert isinstance(policy, (LRUCachePolicy, ARCCachePolicy))
        assert policy.num_evictable == sum(1 for ref in self.ref.values() if ref == 0)
        if isinstance(policy, ARCCachePolicy):
            t1, t2 = set(arc_lists(policy).t1), set(arc_lists(policy).t2)
            assert not t1 & t2
            assert t1 | t2 == set(self.ref)
            assert not (set(arc_lists(policy).b1) | set(arc_lists(policy).b2)) & set(self.ref)
            # The ARC paper's directory bounds: |T1| + |B1| <= c, all four lists <= 2c.
            b1, b2 = len(arc_lists(policy).b1), len(arc_lists(policy).b2)
            assert len(t1) + b1 <= self.capacity
            assert len(t1) + len(t2) + b1 + b2 <= 2 * self.capacity
            assert 0.0 <= policy.target_t1_size <= self.capacity


_SETTINGS = settings(
    max_examples=120,
    stateful_step_count=60,
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
TestTinyARCManagerStateful.settings = settings(_SETTINGS, max_examples=50)


# The long fuzz: many more and longer runs of the same machines.
_LONG = settings(_SETTINGS, max_examples=300, stateful_step_count=120)
TestLRUManagerStatefulLong = long_fuzz(LRUManagerMachine, _LONG)
TestARCManagerStatefulLong = long_fuzz(ARCManagerMachine, _LONG)
