# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of OffloadingWorker routing and its every-job-reported-exactly-once guarantee."""

from __future__ import annotations

from collections.abc import Collection

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import override

from vllm.v1.kv_offload.base import GPULoadStoreSpec, LoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.worker.worker import (
    OffloadingHandler,
    OffloadingWorker,
    TransferResult,
    TransferSpec,
)


class DiskSpec(LoadStoreSpec):
    @staticmethod
    @override
    def medium() -> str:
        return "DISK"


class ScriptedHandler(OffloadingHandler):
    """Test double: accepts, refuses or raises per job id; jobs finish when told to."""

    def __init__(self, refuse: Collection[int] = (), raise_on: Collection[int] = ()) -> None:
        self.refuse = set(refuse)
        self.raise_on = set(raise_on)
        self.pending: list[int] = []
        self.done: list[int] = []
        self.waited: list[set[int]] = []
        self.specs: dict[int, TransferSpec] = {}
        self.shut = False

    @override
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if job_id in self.raise_on:
            raise RuntimeError(f"boom {job_id}")
        if job_id in self.refuse:
            return False
        self.pending.append(job_id)
        self.specs[job_id] = spec
        return True

    def complete(self, job_id: int) -> None:
        self.pending.remove(job_id)
        self.done.append(job_id)

    @override
    def get_finished(self) -> list[TransferResult]:
        out = [TransferResult(j, True, 10, 0.5, ("GPU", "CPU")) for j in self.done]
        self.done = []
        return out

    @override
    def wait(self, job_ids: Collection[int]) -> None:
        self.waited.append(set(job_ids))
        for j in list(job_ids):
            if j in self.pending:
                self.complete(j)

    @override
    def shutdown(self) -> None:
        self.shut = True


def store_spec() -> TransferSpec:
    return TransferSpec(GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([5]))


def load_spec() -> TransferSpec:
    return TransferSpec(CPULoadStoreSpec([5]), GPULoadStoreSpec([1, 2], [2], [0]))


def make_worker(store: ScriptedHandler, load: ScriptedHandler) -> OffloadingWorker:
    w = OffloadingWorker()
    w.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    w.register_handler(CPULoadStoreSpec, GPULoadStoreSpec, load)
    return w


def test_routes_by_medium_pair_and_reports_once() -> None:
    store, load = ScriptedHandler(), ScriptedHandler()
    w = make_worker(store, load)
    assert w.transfer_async(1, store_spec())
    assert w.transfer_async(2, load_spec())
    assert store.pending == [1] and load.pending == [2]
    assert isinstance(store.specs[1].src, GPULoadStoreSpec)
    assert w.get_finished() == []
    store.complete(1)
    assert [r.job_id for r in w.get_finished()] == [1]
    assert w.get_finished() == []
    load.complete(2)
    assert [(r.job_id, r.success) for r in w.get_finished()] == [(2, True)]


def test_plain_tuple_spec_is_accepted() -> None:
    store, load = ScriptedHandler(), ScriptedHandler()
    w = make_worker(store, load)
    src, dst = store_spec()
    assert w.transfer_async(1, (src, dst))
    assert store.specs[1] == TransferSpec(src, dst)


def test_duplicate_registration_is_refused() -> None:
    w = make_worker(ScriptedHandler(), ScriptedHandler())
    with pytest.raises(ValueError, match="already registered"):
        w.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, ScriptedHandler())


def test_handler_exception_becomes_failed_result() -> None:
    store = ScriptedHandler(raise_on={7})
    w = make_worker(store, ScriptedHandler())
    assert w.transfer_async(7, store_spec()) is False
    results = w.get_finished()
    assert results == [TransferResult(7, False, transfer_type=("GPU", "CPU"))]
    assert w.get_finished() == []
    # The id is free again once reported, and a later job with it works.
    assert w.transfer_async(7, load_spec())


def test_refused_job_and_missing_handler_are_reported_failed() -> None:
    store = ScriptedHandler(refuse={3})
    w = OffloadingWorker()
    w.register_handler(GPULoadStoreSpec, CPULoadStoreSpec, store)
    assert w.transfer_async(3, store_spec()) is False
    assert w.transfer_async(4, load_spec()) is False  # no CPU -> GPU handler
    assert w.transfer_async(5, TransferSpec(DiskSpec(), CPULoadStoreSpec([1]))) is False
    got = {r.job_id: r for r in w.get_finished()}
    assert set(got) == {3, 4, 5}
    assert all(not r.success for r in got.values())
    assert got[3].transfer_type == ("GPU", "CPU")
    assert got[4].transfer_type is None


def test_job_id_in_flight_cannot_be_reused() -> None:
    store = ScriptedHandler()
    w = make_worker(store, ScriptedHandler(raise_on={9}))
    assert w.transfer_async(1, store_spec())
    with pytest.raises(ValueError, match="already in flight"):
        w.transfer_async(1, load_spec())
    assert w.transfer_async(9, load_spec()) is False
    with pytest.raises(ValueError, match="already in flight"):
        w.transfer_async(9, store_spec())  # its failed result is not reported yet
    with pytest.raises(ValueError, match="pair"):
        w.transfer_async(2, (store_spec().src,))


def test_wait_goes_only_to_the_holding_handler_with_its_ids() -> None:
    store, load = ScriptedHandler(), ScriptedHandler()
    w = make_worker(store, load)
    for j in (1, 2):
        w.transfer_async(j, store_spec())
    w.transfer_async(3, load_spec())
    w.wait({2, 99})
    assert store.waited == [{2}] and load.waited == []
    assert store.pending == [1]
    # Waiting does not report: the job still comes out of get_finished, once.
    assert [r.job_id for r in w.get_finished()] == [2]
    w.wait({2})  # already reported: ignored
    assert store.waited == [{2}]


def test_shutdown_fans_out() -> None:
    store, load = ScriptedHandler(), ScriptedHandler()
    w = make_worker(store, load)
    w.transfer_async(1, store_spec())
    w.shutdown()
    assert store.shut and load.shut
    assert w.get_finished() == []


def test_handler_reporting_a_foreign_job_is_a_bug() -> None:
    store = ScriptedHandler()
    w = make_worker(store, ScriptedHandler())
    store.done.append(42)
    with pytest.raises(AssertionError, match="job 42"):
        w.get_finished()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["ok", "refuse", "raise", "finish", "wait", "poll"]), st.booleans()
        ),
        max_size=40,
    )
)
def test_every_job_reported_exactly_once(ops: list[tuple[str, bool]]) -> None:
    store, load = ScriptedHandler(), ScriptedHandler()
    w = make_worker(store, load)
    submitted: list[int] = []
    reported: list[int] = []
    for i, (op, is_store) in enumerate(ops):
        h = store if is_store else load
        spec = store_spec() if is_store else load_spec()
        if op in ("ok", "refuse", "raise"):
            if op == "refuse":
                h.refuse.add(i)
            elif op == "raise":
                h.raise_on.add(i)
            accepted = w.transfer_async(i, spec)
            assert accepted == (op == "ok")
            submitted.append(i)
        elif op == "finish" and h.pending:
            h.complete(h.pending[0])
        elif op == "wait":
            w.wait(set(submitted))
        else:
            reported += [r.job_id for r in w.get_finished()]
    w.wait(set(submitted))
    reported += [r.job_id for r in w.get_finished()]
    assert sorted(reported) == sorted(submitted)
