# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Hypothesis state machine: an engine that calls the connector's scheduler half out of order.

The engine's calls (lookups, allocations with or without loads, step ends with arbitrary
scheduled, running and preempted requests, workers' job reports, finished requests, cache
resets) are drawn at random, right or wrong, over a real ``CPUOffloadingManager`` whose blocks
the requests hit. Whatever the call, it either succeeds or raises a clean error (``ValueError``,
``TypeError`` or ``RuntimeError``, never an ``AssertionError`` or a bare ``KeyError``) and
leaves the connector's books and the manager exactly as they were; after every call the
manager's invariants hold and its pins are exactly those of the connector's load jobs in flight.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.v1.kv_connector.unit.offloading_connector.scheduler_harness import (
    job_table,
    offload_all,
    offload_keys,
    request_states,
    setup_scheduler,
    snapshot,
)
from tests.v1.kv_offload.cpu.manager_state import check_invariants, load_pins
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

NUM_REQS = 3
BLOCK_CHOICES = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 2], [1, 9, 3, 4, 5], []]
CLEAN_ERRORS = (ValueError, TypeError, RuntimeError)


class EngineMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched, self.manager = setup_scheduler()
        hasher = get_request_block_hasher(16)
        self.reqs = [
            Request(f"q{i}", [i * 1000 + t for t in range(49)], 1, block_hasher=hasher)
            for i in range(NUM_REQS)
        ]
        for request in self.reqs:  # every block offloaded: lookups hit 48 tokens
            offload_all(self.manager, offload_keys(request))
        self.issued: list[int] = []  # job ids the connector issued (load and store)

    def call(self, act: Any) -> Any:
        before = snapshot(self.sched, self.manager)
        try:
            return act()
        except AssertionError:
            raise
        except CLEAN_ERRORS:
            assert snapshot(self.sched, self.manager) == before, "a refused call changed state"
            return None

    @rule(i=st.integers(0, NUM_REQS - 1), computed=st.sampled_from([0, 0, 16, 48]))
    def lookup(self, i: int, computed: int) -> None:
        self.call(lambda: self.sched.get_num_new_matched_tokens(self.reqs[i], computed))

    @rule(
        i=st.integers(0, NUM_REQS - 1),
        blocks=st.sampled_from(BLOCK_CHOICES),
        num_external=st.sampled_from([0, 0, 16, 32, 40, 48, 64]),
    )
    def alloc(self, i: int, blocks: list[int], num_external: int) -> None:
        self.call(
            lambda: self.sched.update_state_after_alloc(self.reqs[i], (list(blocks),), num_external)
        )

    @rule(i=st.integers(0, NUM_REQS - 1))
    def start_load(self, i: int) -> None:
        """A well-behaved placement: lookup, then allocation of 4 blocks loading 48 tokens."""
        if self.call(lambda: self.sched.get_num_new_matched_tokens(self.reqs[i], 0)) == (
            48,
            True,
        ):
            blocks = [10 * i + b for b in range(1, 5)]
            self.call(lambda: self.sched.update_state_after_alloc(self.reqs[i], (blocks,), 48))

    @rule()
    def quiet_step(self) -> None:
        meta = self.call(lambda: self.sched.build_connector_meta(SchedulerOutput()))
        if meta is not None:
            self.issued += [*meta.load_jobs, *meta.store_jobs]

    @rule(
        new=st.lists(st.tuples(st.integers(0, NUM_REQS), st.sampled_from(BLOCK_CHOICES))),
        cached=st.lists(
            st.tuples(
                st.integers(0, NUM_REQS),
                st.sampled_from([None, None, ([20],), ([20, 21],), ([20], [21])]),
                st.sampled_from([16, 16, 0, 48]),
            ),
            unique_by=lambda c: c[0],
        ),
        preempted=st.sets(st.integers(0, NUM_REQS)),
    )
    def step_end(
        self,
        new: list[tuple[int, list[int]]],
        cached: list[tuple[int, tuple[list[int], ...] | None, int] | int],
        preempted: set[int],
    ) -> None:
        """A step naming any requests (index NUM_REQS: one the connector never saw); a running
        request (index, its new blocks, its computed tokens) may be given as its index only."""

        def rid(i: int) -> str:
            return f"q{i}"

        running = [(c, None, 16) if isinstance(c, int) else c for c in cached]
        output = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(rid(i), [], (list(b),), 0) for i, b in new],
            scheduled_cached_reqs=CachedRequestData(
                [rid(i) for i, _, _ in running],
                [None if b is None else tuple(list(g) for g in b) for _, b, _ in running],
                [n for _, _, n in running],
            ),
            num_scheduled_tokens={rid(i): 1 for i, _ in new} | {rid(i): 1 for i, _, _ in running},
            preempted_req_ids={rid(i) for i in preempted},
        )
        meta = self.call(lambda: self.sched.build_connector_meta(output))
        if meta is not None:
            self.issued += [*meta.load_jobs, *meta.store_jobs]

    @precondition(lambda self: self.issued)
    @rule(data=st.data(), success=st.booleans())
    def report(self, data: st.DataObject, success: bool) -> None:
        """Workers report jobs in flight, issued jobs (maybe again), or ids never issued."""
        recent = self.issued[-8:]  # the likeliest to be in flight still
        ids = data.draw(
            st.lists(
                st.one_of(
                    st.sampled_from(recent), st.sampled_from(self.issued), st.integers(-1, 50)
                ),
                max_size=3,
            )
        )
        counts = {job_id: data.draw(st.sampled_from([1, 1, 0, 2]), label="n") for job_id in ids}
        meta = OffloadingWorkerMetadata(
            completed_jobs=counts if success else {}, failed_jobs={} if success else counts
        )
        self.call(
            lambda: self.sched.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=meta)
            )
        )

    @rule(i=st.integers(0, NUM_REQS - 1))
    def finish(self, i: int) -> None:
        self.call(lambda: self.sched.request_finished(self.reqs[i]))

    @rule()
    def reset_cache(self) -> None:
        self.call(self.sched.reset_cache)

    @invariant()
    def pins_are_the_load_jobs_in_flight(self) -> None:
        check_invariants(self.manager)
        jobs = job_table(self.sched)
        # The load jobs in flight are the connector's books: no public view of them.
        for req_id, state in request_states(self.sched).items():
            loads = [jobs[j] for j in state.transfer_jobs if not jobs[j].is_store]
            expected: dict[bytes, int] = {}
            for job in loads:
                for key in job.keys:
                    expected[key] = expected.get(key, 0) + 1
            assert load_pins(self.manager, req_id) == expected, req_id


# Hypothesis has no ``@example`` for state machines: the sequences a run found are replayed
# here, rule by rule, with the invariants checked after each rule as in a generated run.
EXAMPLES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    # Issue 22: a request allocated no blocks, then named as running and computing a token.
    "no-blocks-then-running": [
        ("reset_cache", {}),
        ("start_load", {"i": 1}),
        ("alloc", {"i": 1, "blocks": [], "num_external": 0}),
        ("step_end", {"new": [], "cached": [1], "preempted": set()}),
    ],
}


@pytest.mark.parametrize("steps", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_found_sequences(steps: list[tuple[str, dict[str, Any]]]) -> None:
    machine = EngineMachine()
    machine.pins_are_the_load_jobs_in_flight()
    for name, kwargs in steps:
        getattr(machine, name)(**kwargs)
        machine.pins_are_the_load_jobs_in_flight()
    machine.teardown()


TestEngineChecksFuzz = EngineMachine.TestCase
TestEngineChecksFuzz.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.slow
class TestEngineChecksFuzzLong(EngineMachine.TestCase):  # type: ignore[name-defined]
    settings = settings(TestEngineChecksFuzz.settings, max_examples=400, stateful_step_count=60)
