# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``AsyncLookupManager``: answers from a local view, batching per step, generations,
cleanup, failures, the deferral counters."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator

import pytest
from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

WAIT_S = 10.0


def key(i: int) -> OffloadKey:
    return make_offload_key(f"block-{i}".encode(), 0)


class SetLookup(AsyncLookupManager):
    """Answers from a set; records every call; can be held at a gate or made to fail."""

    def __init__(self, present: Iterable[OffloadKey] = ()) -> None:
        self.present = set(present)
        self.calls: list[tuple[list[OffloadKey], str, str]] = []
        self.gate: threading.Event | None = None
        self.entered = threading.Event()
        self.fail = False
        self.wrong_length = False
        super().__init__("test")

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        self.calls.append((list(keys), req_context.req_id, threading.current_thread().name))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), "test gate never opened"
        if self.fail:
            raise OSError("injected probe failure")
        if self.wrong_length:
            return [True]
        return [k in self.present for k in keys]


@pytest.fixture
def mgr() -> Iterator[SetLookup]:
    manager = SetLookup(present=[key(1), key(2)])
    yield manager
    if manager.gate is not None:
        manager.gate.set()
    manager.shutdown()


def resolve(mgr: AsyncLookupManager) -> None:
    """End the step and wait until the worker has answered its batch."""
    mgr.flush()
    assert mgr.wait_idle(WAIT_S)


CTX_A = ReqContext(req_id="a")
CTX_B = ReqContext(req_id="b")


def hold_probe(mgr: SetLookup, k: OffloadKey) -> threading.Event:
    """Look ``k`` up for request a and end the step; return once the probe thread holds it.

    The probe stays in ``batch_lookup`` until the returned gate is set.
    """
    gate = mgr.gate = threading.Event()
    mgr.lookup(k, CTX_A)
    mgr.flush()
    assert mgr.entered.wait(WAIT_S)
    return gate


def test_new_key_returns_none(mgr: SetLookup) -> None:
    assert mgr.lookup(key(1), CTX_A) is None
    assert mgr.lookup(key(1), CTX_A) is None  # still unresolved: nothing flushed
    assert mgr.calls == []


def test_found_key_returns_true(mgr: SetLookup) -> None:
    assert mgr.lookup(key(1), CTX_A) is None
    resolve(mgr)
    assert mgr.lookup(key(1), CTX_A) is True


def test_not_found_key_returns_false(mgr: SetLookup) -> None:
    assert mgr.lookup(key(9), CTX_A) is None
    resolve(mgr)
    assert mgr.lookup(key(9), CTX_A) is False


def test_multiple_keys_single_step(mgr: SetLookup) -> None:
    for i in (1, 2, 3):
        assert mgr.lookup(key(i), CTX_A) is None
    assert mgr.lookup(key(4), CTX_B) is None
    assert mgr.lookup(key(1), CTX_B) is None  # shared with a: probed once
    resolve(mgr)
    # One batch for the step, one batch_lookup per request, on the lookup thread.
    assert sorted((keys, req) for keys, req, _ in mgr.calls) == [
        ([key(1), key(2), key(3)], "a"),
        ([key(4)], "b"),
    ]
    assert {name for _, _, name in mgr.calls} == {"vllm_offloading_lookup_test"}
    assert [mgr.lookup(key(i), CTX_A) for i in (1, 2, 3)] == [True, True, False]
    assert mgr.lookup(key(4), CTX_B) is False
    assert mgr.lookup(key(1), CTX_B) is True


def test_resolved_key_is_not_probed_again(mgr: SetLookup) -> None:
    mgr.lookup(key(1), CTX_A)
    resolve(mgr)
    assert mgr.lookup(key(1), CTX_B) is True  # another request reuses the answer
    resolve(mgr)
    assert len(mgr.calls) == 1


def test_flush_posts_one_item_per_step(mgr: SetLookup) -> None:
    mgr.flush()  # nothing queued: nothing posted
    assert mgr.wait_idle(WAIT_S)
    assert mgr.calls == []
    mgr.lookup(key(1), CTX_A)
    mgr.flush()
    mgr.flush()  # the key is in flight: not posted again
    mgr.lookup(key(2), CTX_A)
    mgr.flush()
    assert mgr.wait_idle(WAIT_S)
    assert [keys for keys, _, _ in mgr.calls] == [[key(1)], [key(2)]]


def test_cleanup_removes_entries(mgr: SetLookup) -> None:
    mgr.lookup(key(1), CTX_A)
    mgr.lookup(key(2), CTX_A)
    mgr.lookup(key(2), CTX_B)
    resolve(mgr)
    assert mgr.lookup(key(1), CTX_A) is True
    assert mgr.num_tracked_keys == 2 and mgr.num_tracked_requests == 2
    mgr.cleanup("a")
    assert mgr.num_tracked_keys == 1  # key 2 is still wanted by b
    assert mgr.num_tracked_requests == 1
    mgr.cleanup("b")
    assert mgr.num_tracked_keys == 0 and mgr.num_tracked_requests == 0
    mgr.cleanup("never-seen")  # harmless
    # A dropped key is probed afresh.
    mgr.present.discard(key(1))
    assert mgr.lookup(key(1), CTX_A) is None
    resolve(mgr)
    assert mgr.lookup(key(1), CTX_A) is False


def test_cleanup_before_flush_cancels_the_probe(mgr: SetLookup) -> None:
    mgr.lookup(key(1), CTX_A)
    mgr.cleanup("a")
    resolve(mgr)
    assert mgr.calls == []
    assert mgr.num_tracked_keys == 0


def test_in_flight_probe_survives_cleanup(mgr: SetLookup) -> None:
    gate = hold_probe(mgr, key(1))
    mgr.cleanup("a")
    assert mgr.num_tracked_keys == 1, "in-flight probe dropped"
    # A later request shares the in-flight probe instead of starting another.
    assert mgr.lookup(key(1), CTX_B) is None
    gate.set()
    assert mgr.wait_idle(WAIT_S)
    assert mgr.lookup(key(1), CTX_B) is True
    mgr.flush()
    assert mgr.wait_idle(WAIT_S)
    assert len(mgr.calls) == 1


def test_orphaned_in_flight_result_is_dropped(mgr: SetLookup) -> None:
    gate = hold_probe(mgr, key(1))
    mgr.cleanup("a")
    gate.set()
    assert mgr.wait_idle(WAIT_S)
    mgr.flush()  # applies the result: nobody wants it any more
    assert mgr.num_tracked_keys == 0


def test_stale_result_is_discarded_after_mark_miss(mgr: SetLookup) -> None:
    gate = hold_probe(mgr, key(1))  # present: the probe would answer True
    mgr.mark_miss([key(1)])
    assert mgr.lookup(key(1), CTX_A) is False
    gate.set()
    assert mgr.wait_idle(WAIT_S)
    assert mgr.lookup(key(1), CTX_A) is False, "a superseded probe overwrote mark_miss"


def test_mark_miss_and_present(mgr: SetLookup) -> None:
    mgr.lookup(key(1), CTX_A)
    mgr.lookup(key(9), CTX_A)
    resolve(mgr)
    assert mgr.lookup(key(1), CTX_A) is True
    mgr.mark_miss([key(1)])
    assert mgr.lookup(key(1), CTX_A) is False
    mgr.mark_present([key(9), key(42)])  # key 42 has no state: ignored
    assert mgr.lookup(key(9), CTX_A) is True
    assert mgr.num_tracked_keys == 2
    # A pending (unflushed) key forced present is answered at once and never probed.
    assert mgr.lookup(key(5), CTX_A) is None
    mgr.mark_present([key(5)])
    assert mgr.lookup(key(5), CTX_A) is True
    resolve(mgr)
    assert [keys for keys, _, _ in mgr.calls] == [[key(1), key(9)]]


def test_batch_lookup_exception_is_a_miss(mgr: SetLookup, caplog: pytest.LogCaptureFixture) -> None:
    mgr.fail = True
    with caplog.at_level(logging.ERROR):
        mgr.lookup(key(1), CTX_A)
        resolve(mgr)
        assert mgr.lookup(key(1), CTX_A) is False
    assert "injected probe failure" in caplog.text
    # The thread survived: later batches are still answered.
    mgr.fail = False
    mgr.lookup(key(2), CTX_B)
    resolve(mgr)
    assert mgr.lookup(key(2), CTX_B) is True


def test_wrong_result_length_is_a_miss(mgr: SetLookup, caplog: pytest.LogCaptureFixture) -> None:
    mgr.wrong_length = True
    mgr.lookup(key(1), CTX_A)
    mgr.lookup(key(2), CTX_A)
    resolve(mgr)
    assert [mgr.lookup(key(1), CTX_A), mgr.lookup(key(2), CTX_A)] == [False, False]
    assert "returned 1 result(s) for 2 key(s)" in caplog.text


def test_wait_idle_times_out_while_busy(mgr: SetLookup) -> None:
    gate = hold_probe(mgr, key(1))
    assert mgr.wait_idle(0.01) is False
    gate.set()
    assert mgr.wait_idle(WAIT_S) is True


def _lookup_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"vllm_offloading_lookup_{name}"]


def test_shutdown_stops_the_thread() -> None:
    before = len(_lookup_threads("test"))
    mgr = SetLookup()
    threads = _lookup_threads("test")
    assert len(threads) == before + 1 and all(t.daemon for t in threads)
    mgr.lookup(key(1), CTX_A)
    mgr.flush()
    assert mgr.shutdown() is True
    assert len(_lookup_threads("test")) == before
    assert len(mgr.calls) == 1  # batches posted before shutdown are still processed
    assert mgr.shutdown() is True  # idempotent
    mgr.lookup(key(2), CTX_A)
    mgr.flush()  # after shutdown: nothing is posted
    assert len(mgr.calls) == 1


class StepLookup(AsyncLookupManager):
    """Answers a whole step at once (``step_lookup``); records the groups of every call."""

    def __init__(self, present: Iterable[OffloadKey]) -> None:
        self.present = set(present)
        self.steps: list[list[tuple[list[OffloadKey], str]]] = []
        self.wrong_shape = False
        super().__init__("step")

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        raise AssertionError("step_lookup answers every step")

    @override
    def step_lookup(
        self, groups: list[tuple[list[OffloadKey], ReqContext]]
    ) -> list[list[bool]] | None:
        self.steps.append([(list(keys), ctx.req_id) for keys, ctx in groups])
        if self.wrong_shape:
            return [[True]]
        return [[k in self.present for k in keys] for keys, _ in groups]


def test_step_lookup_answers_every_request_of_a_step_in_one_call() -> None:
    mgr = StepLookup(present=[key(1), key(3)])
    try:
        a, b = ReqContext("a"), ReqContext("b")
        assert [mgr.lookup(key(i), a) for i in (1, 2)] == [None, None]
        assert mgr.lookup(key(3), b) is None
        resolve(mgr)
        assert mgr.steps == [[([key(1), key(2)], "a"), ([key(3)], "b")]]
        assert [mgr.lookup(key(i), a) for i in (1, 2)] == [True, False]
        assert mgr.lookup(key(3), b) is True
        mgr.wrong_shape = True
        assert mgr.lookup(key(4), a) is None and mgr.lookup(key(5), b) is None
        resolve(mgr)
        assert mgr.lookup(key(4), a) is False and mgr.lookup(key(5), b) is False
    finally:
        mgr.shutdown()


class LocalViewLookup(SetLookup):
    """Knows some keys locally (``answer_now``); the rest goes to the probe."""

    def __init__(self, known: dict[OffloadKey, bool], present: Iterable[OffloadKey]) -> None:
        self.known = known
        super().__init__(present)

    @override
    def answer_now(self, key: OffloadKey) -> bool | None:
        return self.known.get(key)


def test_answer_now_decides_in_the_step_that_asks_and_only_the_rest_is_deferred() -> None:
    mgr = LocalViewLookup(known={key(1): True, key(2): False}, present=[key(3)])
    try:
        assert mgr.counters() == dict.fromkeys(
            ("lookup_requests", "lookup_deferred_requests", "lookup_deferred_keys"), 0
        )
        assert [mgr.lookup(key(i), CTX_A) for i in (1, 2)] == [True, False]
        assert [mgr.lookup(key(i), CTX_B) for i in (1, 3, 4)] == [True, None, None]
        resolve(mgr)
        assert mgr.calls and all(k not in (key(1), key(2)) for c in mgr.calls for k in c[0])
        assert [mgr.lookup(key(i), CTX_B) for i in (1, 3, 4)] == [True, True, False]
        assert mgr.counters() == {
            "lookup_requests": 2,
            "lookup_deferred_requests": 1,  # b waited a step; a never did
            "lookup_deferred_keys": 2,
        }
        # What the local view learns takes over: no probe, no deferral.
        mgr.known[key(4)] = True
        mgr.cleanup("b")
        assert mgr.lookup(key(4), CTX_B) is True
        assert mgr.counters()["lookup_requests"] == 3  # b, cleaned up, asked again
        assert mgr.counters()["lookup_deferred_requests"] == 1
    finally:
        mgr.shutdown()


def test_a_request_deferred_over_several_steps_counts_once(mgr: SetLookup) -> None:
    gate = hold_probe(mgr, key(1))
    assert mgr.lookup(key(1), CTX_A) is None  # still in flight: a second step of waiting
    assert mgr.lookup(key(2), CTX_A) is None
    gate.set()
    resolve(mgr)
    assert mgr.lookup(key(1), CTX_A) is True
    assert mgr.counters()["lookup_deferred_requests"] == 1
    assert mgr.counters()["lookup_deferred_keys"] == 2
