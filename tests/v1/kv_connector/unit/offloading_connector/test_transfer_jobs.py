# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``TransferJobTable``: the connector's jobs in flight, through the table's own interface.

Each test checks one invariant of the module docstring: every job is handed back exactly once,
once every worker reported it; fenced GPU blocks flush exactly the store jobs still reading them;
the key indexes cover exactly the jobs in flight; jobs issued before a reset are flushed once and
their reports ignored.
"""

from __future__ import annotations

import pytest

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.transfer_jobs import TransferJobTable
from vllm.v1.kv_offload.base import OffloadKey, make_offload_key


def _keys(*ints: int) -> list[OffloadKey]:
    return [make_offload_key(bytes([i]), 0) for i in ints]


def _report(
    table: TransferJobTable, done: dict[int, int], failed: dict[int, int] | None = None
) -> list[int]:
    """Account one batch of reports; the ids of the jobs it finished."""
    return [job.job_id for job in table.account_reports(done, failed or {}).finished]


# ---------------------------------------------------------------------------------------------
# Every job is reported exactly once
# ---------------------------------------------------------------------------------------------


def test_a_job_is_handed_back_once_every_worker_reported_it() -> None:
    table = TransferJobTable(num_workers=2)
    store = table.add_store("r", _keys(1, 2), [(0, 10), (0, 11)])
    load = table.add_load("r", _keys(3), [(0, 12)], (32, 48))
    assert (store, load) == (0, 1)  # one counter for loads and stores
    assert len(table) == 2

    assert _report(table, {store: 1, load: 1}) == []  # one worker of two
    result = table.account_reports({load: 1, store: 1}, {})
    assert [job.job_id for job in result.finished] == [store, load]  # in id order
    assert result.num_stale == 0
    (store_job, load_job) = result.finished
    assert store_job.keys == _keys(1, 2) and store_job.success
    assert load_job.keys == _keys(3) and load_job.token_range == (32, 48)
    assert len(table) == 0 and not table.has_pending_work()
    with pytest.raises(ValueError, match="unknown job 0"):
        _report(table, {store: 1})  # never handed back twice


def test_a_job_any_worker_failed_is_handed_back_failed() -> None:
    table = TransferJobTable(num_workers=3)
    job_id = table.add_store("r", _keys(1), [(0, 1)])
    assert _report(table, {job_id: 2}) == []
    (job,) = table.account_reports({}, {job_id: 1}).finished
    assert not job.success and job.num_failed == 1


def test_more_reports_than_workers_is_an_error() -> None:
    table = TransferJobTable(num_workers=1)
    job_id = table.add_store("r", _keys(1), [(0, 1)])
    with pytest.raises(ValueError, match=r"job 0 reported 2 more time\(s\), but only 1 of its 1"):
        _report(table, {job_id: 1}, {job_id: 1})


@pytest.mark.parametrize(
    ("done", "failed", "match"),
    [
        ({7: 1}, {}, "unknown job 7"),
        ({0: 3}, {}, "only 2 of its 2"),
        ({0: -1}, {}, "negative"),
        ({}, {1: -1}, "negative"),
    ],
)
def test_a_bad_report_is_refused_and_changes_nothing(
    done: dict[int, int], failed: dict[int, int], match: str
) -> None:
    # A valid report of job 1 in the same call is not counted either: validate, then mutate.
    table = TransferJobTable(num_workers=2)
    store = table.add_store("r", _keys(1), [(0, 1)])
    load = table.add_load("r", _keys(2), [(0, 2)], (0, 16))
    with pytest.raises(ValueError, match=match):
        table.account_reports({load: 1, **done}, failed)
    assert len(table) == 2 and table.is_being_stored(_keys(1)[0])
    # Both jobs still owe both workers' reports.
    assert _report(table, {store: 1, load: 1}) == []
    assert _report(table, {store: 1, load: 1}) == [store, load]


# ---------------------------------------------------------------------------------------------
# Fences
# ---------------------------------------------------------------------------------------------


def test_fenced_blocks_flush_the_stores_reading_them_until_reported() -> None:
    table = TransferJobTable(num_workers=1)
    first = table.add_store("a", _keys(1, 2), [(0, 1), (0, 2)])
    second = table.add_store("a", _keys(3), [(0, 2)])
    other = table.add_store("b", _keys(4), [(0, 3)])
    assert table.take_flushes([(0, 1), (0, 2), (0, 3)]) == set()  # nothing fenced yet
    table.fence([first, second])
    assert table.take_flushes([(1, 1), (0, 3), (0, 4)]) == set()  # other groups, other blocks
    assert table.take_flushes([(0, 1)]) == {first}
    assert table.take_flushes([(0, 2)]) == {first, second}
    assert table.take_flushes([(0, 1)]) == {first}, "a fence holds until the job is reported"
    assert _report(table, {first: 1}) == [first]
    assert table.take_flushes([(0, 1), (0, 2)]) == {second}
    assert _report(table, {second: 1, other: 1}) == [second, other]
    assert table.take_flushes([(0, 1), (0, 2), (0, 3)]) == set()


def test_loads_are_never_fenced() -> None:
    table = TransferJobTable(num_workers=1)
    load = table.add_load("a", _keys(1), [(0, 1)], (0, 16))
    table.fence([load])
    assert table.take_flushes([(0, 1)]) == set()


# ---------------------------------------------------------------------------------------------
# Key indexes
# ---------------------------------------------------------------------------------------------


def test_keys_are_being_loaded_or_stored_exactly_while_their_jobs_are_in_flight() -> None:
    table = TransferJobTable(num_workers=1)
    load = table.add_load("a", _keys(1, 2), [(0, 1), (0, 2)], (0, 32))
    store1 = table.add_store("b", _keys(3), [(0, 3)])
    store2 = table.add_store("c", _keys(3, 4), [(0, 4), (0, 5)])
    assert table.any_being_loaded(_keys(9, 2)) and not table.any_being_loaded(_keys(3, 4))
    assert table.is_being_stored(_keys(3)[0]) and not table.is_being_stored(_keys(1)[0])
    with pytest.raises(AssertionError, match="loaded twice at once"):
        table.add_load("d", _keys(2), [(0, 6)], (0, 16))

    _report(table, {load: 1, store1: 1})
    assert not table.any_being_loaded(_keys(1, 2))
    assert table.is_being_stored(_keys(3)[0]), "store2 still writes it"
    _report(table, {store2: 1})
    assert not any(table.is_being_stored(k) for k in _keys(3, 4))
    table.add_load("d", _keys(2), [(0, 6)], (0, 16))  # free to load again


# ---------------------------------------------------------------------------------------------
# Reset
# ---------------------------------------------------------------------------------------------


def test_reset_flushes_jobs_in_flight_once_and_ignores_their_reports() -> None:
    table = TransferJobTable(num_workers=2)
    load = table.add_load("a", _keys(1), [(0, 1)], (0, 16))
    store = table.add_store("b", _keys(2), [(0, 2)])
    table.fence([store])
    _report(table, {store: 1})  # one of two workers

    table.reset()
    assert len(table) == 0
    assert not table.any_being_loaded(_keys(1)) and not table.is_being_stored(_keys(2)[0])
    assert table.awaiting_pre_reset_reports and table.has_pending_work()
    assert table.take_flushes([]) == {load, store}
    assert table.take_flushes([(0, 2)]) == set(), "flushed once; the fence is gone"

    new = table.add_store("c", _keys(1), [(0, 1)])
    assert new == 2, "ids keep increasing across a reset"
    result = table.account_reports({load: 2, store: 1, new: 2}, {})
    assert [job.job_id for job in result.finished] == [new]
    assert result.num_stale == 2
    assert not table.awaiting_pre_reset_reports and not table.has_pending_work()


def test_pre_reset_reports_are_awaited_from_every_worker_across_resets() -> None:
    table = TransferJobTable(num_workers=2)
    first = table.add_store("a", _keys(1), [(0, 1)])
    table.reset()
    second = table.add_store("a", _keys(2), [(0, 2)])
    table.reset()
    assert table.take_flushes([]) == {first, second}
    assert table.account_reports({first: 2, second: 1}, {}).num_stale == 2
    assert table.awaiting_pre_reset_reports, "a worker has not reported the second job yet"
    assert table.account_reports({}, {second: 1}).num_stale == 1  # failures count too
    assert not table.awaiting_pre_reset_reports
