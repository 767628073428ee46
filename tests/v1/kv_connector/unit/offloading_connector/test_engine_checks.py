# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The connector's scheduler half refuses engine calls that contradict its books, changing nothing.

A real ``CPUOffloadingManager`` behind the connector (through the scripted spec of
``test_scheduler``, which only hands it over); requests are real ``Request`` s. Each bad call must
raise an exception naming the request (never an ``AssertionError``) and leave the connector's
books and the manager as they were.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.v1.kv_connector.unit.offloading_connector.test_scheduler import ScriptedSpec, _req
from tests.v1.kv_offload.cpu.manager_state import load_pins
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.request import Request


class CountingManager(CPUOffloadingManager):
    """The real CPU manager, counting the step ends and finished requests it is told of."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.schedule_ends = 0
        self.finished: list[str] = []

    def on_schedule_end(self) -> None:
        self.schedule_ends += 1

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished.append(req_context.req_id)


def _setup() -> tuple[OffloadingConnectorScheduler, CountingManager]:
    manager = CountingManager(32)
    return OffloadingConnectorScheduler(ScriptedSpec(manager, (16,), None)), manager


def _keys(request: Request) -> list[OffloadKey]:
    return [make_offload_key(h, 0) for h in request.block_hashes]


def _offload(manager: CountingManager, keys: list[OffloadKey]) -> None:
    ctx = ReqContext("writer")
    output = manager.prepare_store(keys, ctx)
    assert output is not None
    manager.complete_store(output.keys_to_store, ctx)


def snapshot(sched: OffloadingConnectorScheduler, manager: CountingManager) -> Any:
    """The connector's books and the manager's state."""
    states = {
        req_id: (
            [list(ids) for ids in s.block_ids],
            s.expect_fresh_alloc,
            s.finished,
            sorted(s.transfer_jobs),
            s.next_stored_block_idx,
            s.num_locally_computed_tokens,
        )
        for req_id, s in sched._req_status.items()
    }
    return (
        states,
        sorted(sched._current_batch_load_jobs),
        list(sched._current_batch_allocated_blocks),
        len(sched._jobs),
        sorted((k, b.block_id, b.ref_cnt) for k, b in manager.policy.items()),
        {r: load_pins(manager, r) for r in sched._req_status},
        manager.schedule_ends,
        list(manager.finished),
    )


def _looked_up(sched: OffloadingConnectorScheduler, manager: CountingManager) -> Request:
    """A request of 3 full blocks, all offloaded; looked up (48 tokens to load)."""
    request = _req(49)
    _offload(manager, _keys(request))
    assert sched.get_num_new_matched_tokens(request, 0) == (48, True)
    return request


def _refused(
    sched: OffloadingConnectorScheduler,
    manager: CountingManager,
    error: type[Exception],
    match: str,
    call: Any,
) -> None:
    before = snapshot(sched, manager)
    with pytest.raises(error, match=match) as info:
        call()
    assert not isinstance(info.value, AssertionError)
    assert snapshot(sched, manager) == before


# -- update_state_after_alloc -------------------------------------------------------------------


def test_alloc_of_a_request_never_looked_up() -> None:
    sched, manager = _setup()
    _refused(
        sched,
        manager,
        ValueError,
        r"update_state_after_alloc: request 'r49' was never looked up",
        lambda: sched.update_state_after_alloc(_req(49), ([1, 2, 3, 4],), 0),
    )


def test_alloc_with_the_wrong_number_of_groups() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49' has 2 block groups, expected 1",
        lambda: sched.update_state_after_alloc(request, ([1], [2]), 48),
    )


def test_a_load_without_a_lookup() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 0)  # no load this time
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49': a load of 48 tokens without a lookup",
        lambda: sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 48),
    )


def test_a_load_off_a_block_boundary() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49': load ends at token 40, not on an offloaded block",
        lambda: sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 40),
    )


def test_blocks_changed_without_a_restart() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 48)
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49': group 0 blocks changed without a restart",
        lambda: sched.update_state_after_alloc(request, ([1, 9, 3, 4, 5],), 0),
    )
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49': group 0 blocks changed",
        lambda: sched.update_state_after_alloc(request, ([1, 2],), 0),
    )


def test_a_load_the_manager_refuses_leaves_the_books_unchanged() -> None:
    """More tokens than the lookup found: the manager's prepare_load refuses, nothing stays."""
    sched, manager = _setup()
    request = _req(65)
    _offload(manager, _keys(request)[:3])
    assert sched.get_num_new_matched_tokens(request, 0) == (48, True)
    _refused(
        sched,
        manager,
        ValueError,
        r"prepare_load: key .* of request 'r65' is not offloaded",
        lambda: sched.update_state_after_alloc(request, ([1, 2, 3, 4, 5],), 64),
    )
    sched.update_state_after_alloc(request, ([1, 2, 3, 4, 5],), 48)  # the right call works


def test_two_requests_may_not_load_the_same_blocks_at_once() -> None:
    sched, manager = _setup()
    first = _looked_up(sched, manager)
    second = Request("twin", list(range(49)), 1, block_hasher=first._block_hasher)
    assert sched.get_num_new_matched_tokens(second, 0) == (48, True)
    sched.update_state_after_alloc(first, ([1, 2, 3, 4],), 48)
    _refused(
        sched,
        manager,
        ValueError,
        r"'twin' loads blocks that another request's load job",
        lambda: sched.update_state_after_alloc(second, ([5, 6, 7, 8],), 48),
    )


# -- build_connector_meta -----------------------------------------------------------------------


def _new(req_id: str, blocks: list[int]) -> NewRequestData:
    return NewRequestData(req_id, list(range(49)), (blocks,), 0)


@pytest.mark.parametrize(
    "output, match",
    [
        (
            lambda: SchedulerOutput(scheduled_new_reqs=[_new("ghost", [1])]),
            r"build_connector_meta: scheduled request 'ghost' was never looked up",
        ),
        (
            lambda: SchedulerOutput(scheduled_new_reqs=[_new("r49", [7, 7])]),
            r"request 'r49': scheduled blocks differ",
        ),
        (
            lambda: SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["ghost"], [None], [16])
            ),
            r"running request 'ghost' is unknown to the connector",
        ),
        (
            lambda: SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["r49"], [None], [48]),
                num_scheduled_tokens={"r49": 1},
            ),
            r"request 'r49' is scheduled while its load job \d+ is in flight",
        ),
        (
            lambda: SchedulerOutput(preempted_req_ids={"r49"}),
            r"request 'r49' is preempted while its load job \d+ is in flight",
        ),
    ],
)
def test_a_scheduler_output_that_contradicts_the_books(output: Any, match: str) -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 48)
    sched.build_connector_meta(SchedulerOutput())  # the load job is now in flight
    _refused(sched, manager, ValueError, match, lambda: sched.build_connector_meta(output()))


# -- request_finished, reset_cache --------------------------------------------------------------


def test_request_finished_twice() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 48)
    sched.build_connector_meta(SchedulerOutput())
    assert sched.request_finished(request) == (False, None)  # its load keeps the state alive
    _refused(
        sched,
        manager,
        ValueError,
        r"request_finished: request 'r49' finished twice",
        lambda: sched.request_finished(request),
    )
    assert manager.finished == ["r49"]


def test_reset_cache_in_the_middle_of_a_step() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 48)
    _refused(
        sched,
        manager,
        RuntimeError,
        r"reset_cache: called in the middle of a step",
        sched.reset_cache,
    )
    assert manager.lookup(_keys(request)[0], ReqContext("x")) is True  # not reset


# -- found by test_engine_checks_fuzz ----------------------------------------------------------


def test_a_load_past_the_allocated_or_keyed_blocks() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49': load ends at token 48, beyond its 2 GPU blocks",
        lambda: sched.update_state_after_alloc(request, ([1, 2],), 48),
    )
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49': load ends at token 64, beyond its 3 offloaded",
        lambda: sched.update_state_after_alloc(request, ([1, 2, 3, 4, 5],), 64),
    )


def _running(cached: list[str], preempted: set[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(cached, [None] * len(cached), [48] * len(cached)),
        num_scheduled_tokens=dict.fromkeys(cached, 1),
        preempted_req_ids=preempted or set(),
    )


def test_scheduled_without_an_allocation_twice_or_while_preempted() -> None:
    sched, manager = _setup()
    request = _looked_up(sched, manager)
    _refused(
        sched,
        manager,
        ValueError,
        r"'r49' is scheduled without update_state_after_alloc",
        lambda: sched.build_connector_meta(_running(["r49"])),
    )
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 0)
    _refused(
        sched,
        manager,
        ValueError,
        r"scheduled twice in one step",
        lambda: sched.build_connector_meta(_running(["r49", "r49"])),
    )
    _refused(
        sched,
        manager,
        ValueError,
        r"\['r49'\] are both scheduled and preempted",
        lambda: sched.build_connector_meta(_running(["r49"], {"r49"})),
    )
    sched.build_connector_meta(_running(["r49"]))  # the right call works
