# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Hypothesis state machine of ``TieringOffloadingManager`` with misbehaving callers and tiers.

A CPU primary (over a real shared region) fronts two example tiers (real copies). Besides
well-behaved engine calls, the machine plays a misbehaving engine (stray, duplicate, foreign and
out-of-order completions, completions of keys being promoted, loads of unreadable blocks,
values that are not keys, calls after ``shutdown()``) and a misbehaving tier (reports of
unknown jobs, of another tier's jobs, of jobs already reported).

The machine tracks what a well-behaved engine holds: each request's pending stores (the
``keys_to_store`` of its ``prepare_store`` calls not completed yet) and its pins (its
``prepare_load`` keys not released yet). A call is legitimate iff it only releases what the
request holds, completes no store another request holds (keys absent, ready or being promoted
are ignored, as upstream's contract says), and only loads ready blocks; a legitimate call must
succeed, any other
must raise a clean error (``ValueError``, ``TypeError`` or ``RuntimeError``, never an
``AssertionError``) and change nothing observable (it may only have polled the tiers, which
had nothing to report): every block's row and ref count, every
owner's pins and pending stores, the jobs in flight, the queued promotions, the request states,
the statistics, and what the tiers were given. After every step every invariant holds: the
primary's ``check_invariants()``, each block's ref count is its request pins plus the cascade
jobs in flight that read it, a block being written is pending for exactly one request or being
promoted, and the manager's jobs are exactly those the tiers have not reported.

The tiers report only when the machine ends a step (``GatedTier``), so a refused call that
polls the tiers finds nothing to apply: any state change it made would be its own.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from typing_extensions import override

from tests.v1.kv_offload.cpu import manager_state as cpu_state
from tests.v1.kv_offload.refusal_machine import RefusalMachine, Refused, long_fuzz
from tests.v1.kv_offload.tiering.gated_tier import GatedTier
from tests.v1.kv_offload.tiering.manager_state import (
    jobs_in_flight,
    promoting,
    queued_promotions,
    request_states,
)
from tests.v1.kv_offload.tiering.test_manager import make_spec
from vllm.v1.kv_offload.base import (
    OffloadKey,
    OffloadKeyStateError,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    SecondaryTierReportError,
    TieringOffloadingManager,
)

UNIVERSE = [make_offload_key(bytes([i + 1]) * 4, 0) for i in range(12)]
REQS = [ReqContext(f"req-{i}") for i in range(3)]
CAPACITY = 6
ROW_BYTES = 16

key_lists = st.lists(st.sampled_from(UNIVERSE), max_size=5)
reqs = st.sampled_from(REQS)


class TieringManagerMachine(RefusalMachine):
    key_lists = key_lists
    reqs = reqs
    cache_policy: ClassVar[str] = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tiering-fuzz-"))
        spec = make_spec(self.tmp, CAPACITY)
        region = SharedOffloadRegion(
            f"tiering-fuzz-{self.tmp.name}", CAPACITY, ROW_BYTES, directory=self.tmp, prefault=False
        )
        self.primary = CPUPrimaryTierOffloadingManager(
            CAPACITY, region, cache_policy=self.cache_policy, enable_events=True
        )
        view = self.primary.get_kv_memoryview()
        self.tiers = [
            GatedTier(spec, view, "t0", capacity_blocks=8, deliver=False, deliver_on_drain=True),
            GatedTier(spec, view, "t1", deliver=False, deliver_on_drain=True),
        ]
        self.manager = TieringOffloadingManager(self.primary, self.tiers)
        for ctx in REQS:
            self.manager.on_new_request(ctx)
        # What a well-behaved engine holds, per request.
        self.stores: dict[str, list[OffloadKey]] = {ctx.req_id: [] for ctx in REQS}
        self.pins: dict[str, Counter[OffloadKey]] = {ctx.req_id: Counter() for ctx in REQS}
        self.sent: list[tuple[str, ReqContext, list[OffloadKey]]] = []
        self.finished: set[str] = set()
        self.shut_down = False
        self.steps = 0
        self.num_resets = 0
        self.last_store_ctx, self.last_store_new = REQS[0], 0

    # -- helpers ------------------------------------------------------------------------------

    @override
    def observe(self) -> Any:
        """Everything a refused call must leave unchanged."""
        manager, primary = self.manager, self.primary
        owners = cpu_state.owners(primary)
        owners |= {ctx.req_id for ctx in REQS}
        return (
            sorted((key, block.block_id, block.ref_cnt) for key, block in primary.policy.items()),
            {owner: cpu_state.load_pins(primary, owner) for owner in owners},
            {owner: cpu_state.pending_stores(primary, owner) for owner in owners},
            primary.num_free_blocks,
            cpu_state.pending_events(primary),
            manager.get_stats(),
            sorted(jobs_in_flight(manager)),
            promoting(manager),
            queued_promotions(manager),
            request_states(manager),
            [(len(t.submitted), sorted(t.unreported()), t.keys_lru_order()) for t in self.tiers],
            [dict(t.finished_calls()) for t in self.tiers],
        )

    def ready(self, key: OffloadKey) -> bool:
        block = self.primary.policy.get(key)
        return block is not None and block.ref_cnt >= 0

    def active(self) -> list[ReqContext]:
        return [ctx for ctx in REQS if ctx.req_id not in self.finished]

    # -- a well-behaved engine ----------------------------------------------------------------

    @rule(key=st.sampled_from(UNIVERSE), ctx=reqs)
    def lookup_any(self, key: OffloadKey, ctx: ReqContext) -> None:
        self.lookup(key, ctx)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> None:
        self.lookup_prefix([key], ctx)

    @rule(keys=st.lists(st.sampled_from(UNIVERSE), max_size=8), ctx=reqs)
    @override
    def lookup_prefix(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        """``lookup`` of one key, or of a request's prefix in one ``lookup_prefix`` call: each
        answer as the primary holds the key after the call (the promotions a prefix started
        evicted none of the keys it answered readable), up to the first False."""

        def check() -> None:
            assert len(result) <= len(keys)
            assert all(r is not False for r in result[:-1]), result
            if len(result) < len(keys):
                assert result[-1] is False, result
            for key, answer in zip(keys, result, strict=False):
                block = self.primary.policy.get(key)
                if answer is True:
                    assert block is not None and block.ref_cnt >= 0, f"{key.hex()}: hit, not ready"
                elif answer is None:
                    assert block is not None and block.ref_cnt < 0, (
                        f"{key.hex()}: None, not written"
                    )
                else:
                    assert block is None, f"{key.hex()}: False but resident"

        result: Any = None

        def act() -> None:
            nonlocal result
            if len(keys) == 1:
                result = [self.manager.lookup(keys[0], ctx)]
            else:
                result = self.manager.lookup_prefix(keys, ctx)

        self.call(lambda: check, act)

    @precondition(lambda self: self.active())
    @rule(data=st.data(), keys=key_lists)
    def prepare_store(self, data: st.DataObject, keys: list[OffloadKey]) -> None:
        ctx = data.draw(st.sampled_from(self.active()), label="ctx")
        self.last_store_ctx, self.last_store_new = ctx, 0
        out: Any = None

        def act() -> None:
            nonlocal out
            out = self.manager.prepare_store(keys, ctx)

        def apply() -> None:
            if out is not None:
                assert not set(out.keys_to_store) & set(self.stores[ctx.req_id])
                self.stores[ctx.req_id] += out.keys_to_store
                self.last_store_new = len(out.keys_to_store)

        self.call(lambda: apply, act)

    @precondition(lambda self: self.active())
    @rule(data=st.data(), keys=key_lists.filter(bool))
    def store(self, data: st.DataObject, keys: list[OffloadKey]) -> None:
        """prepare_store and, at once, complete_store of every new key (mostly successful)."""
        self.prepare_store(data, keys)
        ctx = self.last_store_ctx
        new = self.stores[ctx.req_id][-self.last_store_new :] if self.last_store_new else []
        if new:
            self._complete_store(list(new), ctx, data.draw(st.sampled_from([True, True, False])))

    def _tier_only_keys(self) -> list[OffloadKey]:
        get = self.primary.policy.get
        return [
            k
            for k in UNIVERSE
            if get(k) is None and any(t.get_block_bytes(k) is not None for t in self.tiers)
        ]

    @precondition(lambda self: not self.shut_down and self._tier_only_keys())
    @rule(data=st.data(), ctx=reqs)
    def lookup_tier_only_key(self, data: st.DataObject, ctx: ReqContext) -> None:
        """A key only a secondary tier holds: this starts a promotion (if the primary has room)."""
        self.lookup(data.draw(st.sampled_from(self._tier_only_keys()), label="key"), ctx)

    @precondition(lambda self: any(self.stores.values()))
    @rule(data=st.data(), success=st.booleans())
    def complete_store_part(self, data: st.DataObject, success: bool) -> None:
        """Any part of a request's pending stores, in any order (the rest comes later)."""
        ctx = data.draw(st.sampled_from([c for c in REQS if self.stores[c.req_id]]), label="ctx")
        keys = data.draw(
            st.lists(st.sampled_from(self.stores[ctx.req_id]), min_size=1, unique=True),
            label="part",
        )
        self._complete_store(keys, ctx, success)

    @precondition(lambda self: self.active() and any(map(self.ready, UNIVERSE)))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(self.active()), label="ctx")
        ready = [key for key in UNIVERSE if self.ready(key)]
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3), label="keys")
        self._prepare_load(keys, ctx)

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def complete_load_part(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from([c for c in REQS if self.pins[c.req_id]]), label="ctx")
        held = list(self.pins[ctx.req_id].elements())
        keys = data.draw(st.permutations(held), label="order")
        self._complete_load(keys[: data.draw(st.integers(1, len(held)), label="n")], ctx)

    @rule(keys=key_lists, ctx=reqs)
    def touch(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        self.call(lambda: lambda: None, lambda: self.manager.touch(keys, ctx))

    @precondition(lambda self: len(self.active()) > 1)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(self.active()), label="ctx")

        def apply() -> None:
            self.finished.add(ctx.req_id)

        self.call(lambda: apply, lambda: self.manager.on_request_finished(ctx))

    @rule(polls=st.integers(1, 2))
    def step_end(self, polls: int) -> None:
        """End one or two steps with the tiers reporting (the second end always polls)."""

        def act() -> None:
            for tier in self.tiers:
                tier.deliver = True
            try:
                for _ in range(polls):
                    self.manager.on_schedule_end()
            finally:
                for tier in self.tiers:
                    tier.deliver = False

        self.call(lambda: lambda: None, act)

    @precondition(lambda self: self.num_resets < 2)
    @rule()
    def reset_cache(self) -> None:
        """Rare (a reset empties the primary): at most twice per run."""
        self.num_resets += 1

        def apply() -> None:
            for ctx in REQS:
                if self.stores[ctx.req_id]:
                    self.sent.append(("store", ctx, list(self.stores[ctx.req_id])))
                if self.pins[ctx.req_id]:
                    self.sent.append(("load", ctx, list(self.pins[ctx.req_id].elements())))
                self.stores[ctx.req_id] = []
                self.pins[ctx.req_id] = Counter()

        self.call(lambda: apply, self.manager.reset_cache)

    @precondition(lambda self: self.steps >= 40 and not self.shut_down)
    @rule()
    def shutdown(self) -> None:
        self.manager.shutdown()
        self.shut_down = True

    # -- a misbehaving engine -----------------------------------------------------------------

    @precondition(lambda self: promoting(self.manager))
    @rule(data=st.data(), ctx=reqs, success=st.booleans())
    def complete_store_promoting(self, data: st.DataObject, ctx: ReqContext, success: bool) -> None:
        """A key being promoted (ignored), alone or after the request's pending keys."""
        key = data.draw(st.sampled_from(sorted(promoting(self.manager))), label="promoting")
        keys: list[OffloadKey] = []
        if self.stores[ctx.req_id]:
            keys = data.draw(st.lists(st.sampled_from(self.stores[ctx.req_id]), unique=True))
        if keys:
            keys = data.draw(st.permutations(keys), label="order")
        self._complete_store([*keys, key], ctx, success)

    @precondition(lambda self: self.active())
    @rule(data=st.data(), keys=key_lists.filter(bool))
    def prepare_load_any(self, data: st.DataObject, keys: list[OffloadKey]) -> None:
        """Keys that may be absent, being stored or being promoted."""
        self._prepare_load(keys, data.draw(st.sampled_from(self.active()), label="ctx"))

    # -- a misbehaving tier -------------------------------------------------------------------

    @precondition(lambda self: not self.shut_down)
    @rule(data=st.data(), kind=st.sampled_from(["unknown", "other_tier", "again"]))
    def tier_misreports(self, data: st.DataObject, kind: str) -> None:
        """A tier adds a bad report to its next delivery: an error, the valid ones applied."""
        tier_idx = data.draw(st.integers(0, 1), label="tier")
        tier, other = self.tiers[tier_idx], self.tiers[1 - tier_idx]
        if kind == "other_tier" and other.unreported():
            job_id = data.draw(st.sampled_from(sorted(other.unreported())), label="job")
        elif kind == "again" and tier.reported:
            job_id = data.draw(st.sampled_from(tier.reported), label="job")
        else:
            job_id = 10**9 + self.steps
        self.steps += 1
        tier.extra.append(JobResult(job_id, data.draw(st.booleans(), label="success")))
        for t in self.tiers:
            t.deliver = True
        try:
            with pytest.raises(SecondaryTierReportError, match=rf"#{tier_idx} \(t{tier_idx}\)"):
                self.manager.on_schedule_end()
                self.manager.on_schedule_end()
        finally:
            for t in self.tiers:
                t.deliver = False
        assert not tier.extra
        if kind == "other_tier" and job_id in other.unreported():
            assert job_id in jobs_in_flight(self.manager), "another tier's job left the table"

    # -- predictions --------------------------------------------------------------------------

    @override
    def _complete_store(self, keys: list[OffloadKey], ctx: ReqContext, success: bool) -> None:
        pending = self.stores[ctx.req_id]

        def predict() -> Callable[[], None]:
            # Upstream's contract: keys not pending for the request are ignored (absent, ready,
            # being promoted), unless another request is writing them.
            others = {
                key for req_id, ks in self.stores.items() if req_id != ctx.req_id for key in ks
            }
            if any(key in others for key in keys):
                raise Refused(OffloadKeyStateError)

            def apply() -> None:
                done = set(keys)
                self.stores[ctx.req_id] = [key for key in pending if key not in done]
                if keys:
                    self.sent.append(("store", ctx, keys))

            return apply

        self.call(predict, lambda: self.manager.complete_store(keys, ctx, success=success))

    @override
    def _complete_load(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        def predict() -> Callable[[], None]:
            if Counter(keys) - self.pins[ctx.req_id]:
                raise Refused(OffloadKeyStateError)

            def apply() -> None:
                self.pins[ctx.req_id] -= Counter(keys)
                if keys:
                    self.sent.append(("load", ctx, keys))

            return apply

        self.call(predict, lambda: self.manager.complete_load(keys, ctx))

    def _prepare_load(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        def predict() -> Callable[[], None]:
            if not all(map(self.ready, keys)):
                raise Refused(OffloadKeyStateError)

            def apply() -> None:
                self.pins[ctx.req_id].update(keys)

            return apply

        self.call(predict, lambda: self.manager.prepare_load(keys, ctx))

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def requests_hold_what_the_engine_holds(self) -> None:
        for ctx in REQS:
            req_id = ctx.req_id
            assert sorted(cpu_state.pending_stores(self.primary, req_id)) == sorted(
                self.stores[req_id]
            )
            assert cpu_state.load_pins(self.primary, req_id) == +self.pins[req_id]
            pending = self.primary.has_pending_stores(req_id)
            assert pending == bool(self.stores[req_id]), f"{req_id}: pending stores {pending}"

    @invariant()
    def ref_counts_are_pins_plus_cascades(self) -> None:
        cpu_state.check_invariants(self.primary)
        if self.shut_down:
            return  # the tiers dropped their unreported jobs in shutdown()
        jobs = jobs_in_flight(self.manager)
        in_flight = {job_id for tier in self.tiers for job_id in tier.unreported()}
        assert set(jobs) == in_flight, "the manager's jobs are not the tiers' unreported ones"
        for tier_idx, tier in enumerate(self.tiers):
            assert all(jobs[job_id].tier_idx == tier_idx for job_id in tier.unreported())
        cascades: Counter[OffloadKey] = Counter()
        promoted: set[OffloadKey] = set()
        for entry in jobs.values():
            if entry.job.is_promotion:
                promoted.update(entry.job.keys)
            else:
                cascades.update(entry.job.keys)
        promoted.update(queued_promotions(self.manager))
        assert promoted == set(promoting(self.manager))
        writing = {key for keys in self.stores.values() for key in keys}
        assert not writing & promoted
        for key, block in self.primary.policy.items():
            if block.ref_cnt < 0:
                assert key in writing or key in promoted, f"{key.hex()}: written by no one"
            else:
                pins = sum(pins[key] for pins in self.pins.values())
                assert block.ref_cnt == pins + cascades[key], (
                    f"{key.hex()}: ref_cnt {block.ref_cnt} != {pins} pins + "
                    f"{cascades[key]} cascades"
                )

    def teardown(self) -> None:
        try:
            if not self.shut_down:
                self._drain_and_check()
        finally:
            self.manager.shutdown()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _drain_and_check(self) -> None:
        for ctx in REQS:
            if self.stores[ctx.req_id]:
                self.manager.complete_store(self.stores[ctx.req_id], ctx)
            if self.pins[ctx.req_id]:
                self.manager.complete_load(list(self.pins[ctx.req_id].elements()), ctx)
            if ctx.req_id not in self.finished:
                self.manager.on_request_finished(ctx)
        for _ in range(3):
            for tier in self.tiers:
                tier.deliver = True
            self.manager.on_schedule_end()
        assert not self.manager.has_pending_work()
        for key, block in self.primary.policy.items():
            assert block.ref_cnt == 0, f"{key.hex()}: ref_cnt {block.ref_cnt} after draining"
        cpu_state.check_invariants(self.primary)
        assert request_states(self.manager) == {}
        for tier in self.tiers:
            calls = tier.finished_calls()
            assert all(count == 1 for count in calls.values()), calls


class ARCTieringManagerMachine(TieringManagerMachine):
    cache_policy = "arc"


_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

TestTieringManagerStateful = TieringManagerMachine.TestCase
TestTieringManagerStateful.settings = _SETTINGS


# The long fuzz: many more and longer runs, with both primary policies.
_LONG = settings(_SETTINGS, max_examples=400, stateful_step_count=120)
TestTieringManagerStatefulLong = long_fuzz(TieringManagerMachine, _LONG)
TestARCTieringManagerStatefulLong = long_fuzz(ARCTieringManagerMachine, _LONG)
