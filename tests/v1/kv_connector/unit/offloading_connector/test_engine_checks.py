# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The connector's scheduler half refuses engine calls that contradict its books, changing nothing.

A real ``CPUOffloadingManager`` behind the connector (through ``scheduler_harness``'s scripted
spec, which only hands it over); requests are real ``Request`` s. Each bad call must
raise an exception naming the request (never an ``AssertionError``) and leave the connector's
books and the manager as they were.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from tests.v1.kv_connector.unit.offloading_connector.scheduler_harness import (
    CountingManager,
    ScriptedSpec,
    make_request,
    offload_all,
    offload_keys,
    setup_scheduler,
    snapshot,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.request import Request

_BLOCKS = ([1, 2, 3, 4],)


def _looked_up(
    loaded: int | None = None,
) -> tuple[OffloadingConnectorScheduler, CountingManager, Request]:
    """A scheduler half and a request of 3 full blocks, all offloaded; looked up (48 tokens to
    load) and, given ``loaded``, allocated GPU blocks 1-4 with ``loaded`` tokens to load."""
    sched, manager = setup_scheduler()
    request = make_request(49)
    offload_all(manager, offload_keys(request))
    assert sched.get_num_new_matched_tokens(request, 0) == (48, True)
    if loaded is not None:
        sched.update_state_after_alloc(request, _BLOCKS, loaded)
    return sched, manager, request


@contextmanager
def _refused(
    sched: OffloadingConnectorScheduler,
    manager: CountingManager,
    match: str,
    error: type[Exception] = ValueError,
) -> Iterator[None]:
    """The call in the ``with`` block must raise ``error`` matching ``match`` (never an
    ``AssertionError``) and leave the connector's books and the manager as they were."""
    before = snapshot(sched, manager)
    with pytest.raises(error, match=match) as info:
        yield
    assert not isinstance(info.value, AssertionError)
    assert snapshot(sched, manager) == before


# -- update_state_after_alloc -------------------------------------------------------------------


def test_alloc_of_a_request_never_looked_up() -> None:
    sched, manager = setup_scheduler()
    with _refused(sched, manager, r"update_state_after_alloc: request 'r49' was never looked up"):
        sched.update_state_after_alloc(make_request(49), ([1, 2, 3, 4],), 0)


@pytest.mark.parametrize(
    "loaded, blocks, num_tokens, match",
    [
        (None, ([1], [2]), 48, r"'r49' has 2 block groups, expected 1"),
        (0, _BLOCKS, 48, r"'r49': a load of 48 tokens without a lookup"),
        (None, _BLOCKS, 40, r"'r49': load ends at token 40, not on an offloaded block"),
        (None, ([1, 2],), 48, r"'r49': load ends at token 48, beyond its 2 GPU blocks"),
        (None, ([1, 2, 3, 4, 5],), 64, r"'r49': load ends at token 64, beyond its 3 offloaded"),
        (48, ([1, 9, 3, 4, 5],), 0, r"'r49': group 0 blocks changed without a restart"),
        (48, ([1, 2],), 0, r"'r49': group 0 blocks changed"),
    ],
)
def test_an_allocation_that_contradicts_the_books(
    loaded: int | None, blocks: tuple[list[int], ...], num_tokens: int, match: str
) -> None:
    """A request of 3 offloaded blocks, looked up, maybe allocated once (``loaded``: the tokens
    that allocation loads), then allocated again in a way its books refuse."""
    sched, manager, request = _looked_up(loaded)
    with _refused(sched, manager, match):
        sched.update_state_after_alloc(request, blocks, num_tokens)


def test_a_load_the_manager_refuses_leaves_the_books_unchanged() -> None:
    """More tokens than the lookup found: the manager's prepare_load refuses, nothing stays."""
    sched, manager = setup_scheduler()
    request = make_request(65)
    offload_all(manager, offload_keys(request)[:3])
    assert sched.get_num_new_matched_tokens(request, 0) == (48, True)
    with _refused(sched, manager, r"prepare_load: key .* of request 'r65' is not offloaded"):
        sched.update_state_after_alloc(request, ([1, 2, 3, 4, 5],), 64)
    sched.update_state_after_alloc(request, ([1, 2, 3, 4, 5],), 48)  # the right call works


def test_two_requests_may_not_load_the_same_blocks_at_once() -> None:
    sched, manager, first = _looked_up()
    second = Request("twin", list(range(49)), 1, block_hasher=get_request_block_hasher(16))
    assert sched.get_num_new_matched_tokens(second, 0) == (48, True)
    sched.update_state_after_alloc(first, ([1, 2, 3, 4],), 48)
    with _refused(sched, manager, r"'twin' loads blocks that another request's load job"):
        sched.update_state_after_alloc(second, ([5, 6, 7, 8],), 48)


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
    sched, manager, _ = _looked_up(loaded=48)
    sched.build_connector_meta(SchedulerOutput())  # the load job is now in flight
    with _refused(sched, manager, match):
        sched.build_connector_meta(output())


# -- request_finished, reset_cache --------------------------------------------------------------


def test_request_finished_twice() -> None:
    sched, manager, request = _looked_up(loaded=48)
    sched.build_connector_meta(SchedulerOutput())
    assert sched.request_finished(request) == (False, None)  # its load keeps the state alive
    with _refused(sched, manager, r"request_finished: request 'r49' finished twice"):
        sched.request_finished(request)
    assert manager.finished == ["r49"]


def test_reset_cache_in_the_middle_of_a_step() -> None:
    sched, manager, request = _looked_up(loaded=48)
    with _refused(sched, manager, r"reset_cache: called in the middle of a step", RuntimeError):
        sched.reset_cache()
    assert manager.lookup(offload_keys(request)[0], ReqContext("x")) is True  # not reset


# -- found by test_engine_checks_fuzz ----------------------------------------------------------


def _running(cached: list[str], preempted: set[str] | None = None) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(cached, [None] * len(cached), [48] * len(cached)),
        num_scheduled_tokens=dict.fromkeys(cached, 1),
        preempted_req_ids=preempted or set(),
    )


def test_scheduled_without_an_allocation_twice_or_while_preempted() -> None:
    sched, manager, request = _looked_up()
    with _refused(sched, manager, r"'r49' is scheduled without update_state_after_alloc"):
        sched.build_connector_meta(_running(["r49"]))
    sched.update_state_after_alloc(request, ([1, 2, 3, 4],), 0)
    with _refused(sched, manager, r"scheduled twice in one step"):
        sched.build_connector_meta(_running(["r49", "r49"]))
    with _refused(sched, manager, r"\['r49'\] are both scheduled and preempted"):
        sched.build_connector_meta(_running(["r49"], {"r49"}))
    sched.build_connector_meta(_running(["r49"]))  # the right call works


def test_a_step_scheduling_tokens_beyond_the_requests_blocks() -> None:
    """Issue 22: an allocation of no blocks, then a step naming the request as running and
    computing token 17. An engine allocates blocks before scheduling their tokens, so the step
    is refused before anything changes (it used to fail an assert building the store job)."""
    sched, manager = setup_scheduler()
    manager.reset_cache()  # nothing offloaded: the step's store would take block 0
    request = make_request(49)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, ([],), 0)
    step = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["r49"], [None], [16]),
        num_scheduled_tokens={"r49": 1},
    )
    with _refused(
        sched,
        manager,
        r"'r49' is scheduled to compute up to token 17 but holds 0 GPU blocks of group 0",
    ):
        sched.build_connector_meta(step)
    with _refused(
        sched, manager, r"'r49' is scheduled to compute up to token 49 but holds 2 GPU blocks"
    ):
        sched.build_connector_meta(
            SchedulerOutput(
                scheduled_cached_reqs=CachedRequestData(["r49"], [([1, 2],)], [16]),
                num_scheduled_tokens={"r49": 40},  # capped at the request's 49 tokens
            )
        )
    # The same step with blocks for its tokens stores the request's first block.
    step.scheduled_cached_reqs.new_block_ids = [([1, 2],)]
    meta = sched.build_connector_meta(step)
    assert [job.transfer_spec.src.block_ids for job in meta.store_jobs.values()] == [[1]]


def test_a_new_request_scheduled_beyond_its_blocks() -> None:
    sched, manager = setup_scheduler()
    request = make_request(49)
    manager.reset_cache()
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, ([1],), 0)
    with _refused(
        sched, manager, r"'r49' is scheduled to compute up to token 32 but holds 1 GPU blocks"
    ):
        sched.build_connector_meta(
            SchedulerOutput(scheduled_new_reqs=[_new("r49", [1])], num_scheduled_tokens={"r49": 32})
        )


def test_running_requests_described_inconsistently() -> None:
    sched, manager, _ = _looked_up(loaded=0)
    with _refused(sched, manager, r"running request 'r49' has new blocks for 2 groups, expected 1"):
        sched.build_connector_meta(
            SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r49"], [([5], [6])], [48]))
        )
    with _refused(
        sched, manager, r"the running requests' lists differ in length \(1 ids, 0 block lists"
    ):
        sched.build_connector_meta(
            SchedulerOutput(scheduled_cached_reqs=CachedRequestData(["r49"], [], [48]))
        )


class RefusingOnceManager(CountingManager):
    """The counting CPU manager whose first ``prepare_store`` finds no room (None)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.refuse = True

    def prepare_store(self, keys: Any, req_context: ReqContext) -> Any:
        if self.refuse:
            self.refuse = False
            return None
        return super().prepare_store(keys, req_context)


def test_a_deferred_store_offers_only_blocks_the_request_holds() -> None:
    """A store deferred for lack of room is offered again at the next step even if the request
    is not scheduled; the request's computed tokens then come from the engine's ``Request``,
    which no check of that step covers: only blocks its recorded GPU blocks hold are offered."""
    manager = RefusingOnceManager(32)
    sched = OffloadingConnectorScheduler(ScriptedSpec(manager, (16,), None))
    request = make_request(49)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, ([7],), 0)
    step = SchedulerOutput(scheduled_new_reqs=[_new("r49", [7])], num_scheduled_tokens={"r49": 16})
    assert not sched.build_connector_meta(step).store_jobs  # no room: deferred
    request.num_computed_tokens = 48  # more than its one block holds
    meta = sched.build_connector_meta(SchedulerOutput())
    assert [job.transfer_spec.src.block_ids for job in meta.store_jobs.values()] == [[7]]
