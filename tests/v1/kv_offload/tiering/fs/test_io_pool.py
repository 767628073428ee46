# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``DualQueueThreadPool``: completion, priorities, no starvation, shutdown."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field

import pytest
from typing_extensions import override

from vllm.v1.kv_offload.tiering.fs.io_pool import DualQueueThreadPool, IoTask


@dataclass(eq=False)
class Task(IoTask):
    """Records where and in which order it ran; optionally waits for ``go`` first."""

    name: str
    log: list[tuple[str, str]]
    _: KW_ONLY
    ok: bool = True
    go: threading.Event | None = None
    started: threading.Event | None = None
    raises: bool = False
    cancelled: bool = field(default=False, init=False)

    @override
    def run(self) -> bool:
        self.log.append((self.name, threading.current_thread().name))
        if self.started is not None:
            self.started.set()
        if self.go is not None:
            assert self.go.wait(30), f"task {self.name} never released"
        if self.raises:
            raise RuntimeError(f"task {self.name} fails")
        return self.ok

    @override
    def cancel(self) -> None:
        self.cancelled = True


PoolFactory = Callable[[int, int], DualQueueThreadPool]


@pytest.fixture
def make_pool() -> Iterator[PoolFactory]:
    """``make_pool(n_read, n_write)``: a pool shut down at teardown."""
    created: list[DualQueueThreadPool] = []

    def make(n_read: int, n_write: int) -> DualQueueThreadPool:
        created.append(DualQueueThreadPool(n_read, n_write, "test_pool"))
        return created[-1]

    yield make
    for pool in created:
        pool.shutdown()


def test_each_job_is_reported_once_with_its_outcome(make_pool: PoolFactory) -> None:
    pool = make_pool(2, 2)
    log: list[tuple[str, str]] = []
    pool.submit(1, [Task("a", log), Task("b", log)], is_load=True)
    pool.submit(2, [Task("c", log), Task("d", log, ok=False)], is_load=False)
    pool.submit(3, [Task("e", log, raises=True)], is_load=False)
    pool.submit(4, [], is_load=True)  # nothing to do: succeeds at once
    assert pool.wait_idle(10)
    assert sorted(pool.get_finished()) == [(1, True), (2, False), (3, False), (4, True)]
    assert pool.get_finished() == []
    assert sorted(name for name, _ in log) == ["a", "b", "c", "d", "e"]
    assert pool.num_jobs_in_flight == 0


class ExitingTask(IoTask):
    """Raises SystemExit, which ends the worker thread that runs it."""

    @override
    def run(self) -> bool:
        raise SystemExit("worker thread exits")

    @override
    def cancel(self) -> None:
        pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_job_is_reported_even_if_a_task_ends_its_thread(
    make_pool: PoolFactory,
) -> None:
    pool = make_pool(2, 2)
    pool.submit(7, [ExitingTask()], is_load=True)
    assert pool.wait_idle(10)
    assert pool.get_finished() == [(7, False)]
    assert pool.num_jobs_in_flight == 0


@pytest.mark.parametrize("prefer_loads", [True, False])
def test_neither_queue_starves(make_pool: PoolFactory, prefer_loads: bool) -> None:
    """Both workers are busy with the other kind and more of it is queued; when the worker that
    prefers this kind frees up, it takes this kind's task first, however much of the other kind
    was queued earlier. So a flood of stores never holds back a load, nor loads a store."""
    pool = make_pool(1, 1)
    log: list[tuple[str, str]] = []
    gos = {name: threading.Event() for name in ("busy0", "busy1")}
    both_started = [threading.Event(), threading.Event()]
    other_kind_is_load = not prefer_loads
    busy = [Task(name, log, go=gos[name], started=both_started[i]) for i, name in enumerate(gos)]
    pool.submit(1, busy, is_load=other_kind_is_load)
    assert all(e.wait(10) for e in both_started)
    pool.submit(2, [Task(f"other_kind{i}", log) for i in range(10)], is_load=other_kind_is_load)
    pool.submit(3, [Task("preferred", log)], is_load=prefer_loads)
    preferring_thread = "read" if prefer_loads else "write"
    holder = next(name for name, thread in log if f"_{preferring_thread}_" in thread)
    done = threading.Event()
    pool.submit(4, [Task("marker", log, started=done)], is_load=prefer_loads)
    try:
        # Free the preferring worker, the only one that can run: it must take its own kind's
        # two tasks before any of the ten queued earlier.
        gos[holder].set()
        assert done.wait(10)
        order = [name for name, _ in log]
        assert order[2:4] == ["preferred", "marker"], order  # before any queued other kind
    finally:
        for go in gos.values():
            go.set()
    assert pool.wait_idle(10)


def test_wait_idle_times_out_while_a_task_runs(make_pool: PoolFactory) -> None:
    pool = make_pool(1, 1)
    go, started = threading.Event(), threading.Event()
    pool.submit(1, [Task("held", [], go=go, started=started)], is_load=True)
    assert started.wait(10)
    assert not pool.wait_idle(0.05)
    assert pool.num_jobs_in_flight == 1
    go.set()
    assert pool.wait_idle(10)


def test_shutdown_cancels_queued_tasks_and_lets_running_ones_finish(
    make_pool: PoolFactory,
) -> None:
    pool = make_pool(1, 1)
    log: list[tuple[str, str]] = []
    go = threading.Event()
    started = [threading.Event(), threading.Event()]
    running = [Task(f"run{i}", log, go=go, started=started[i]) for i in range(2)]
    pool.submit(1, running, is_load=True)
    assert all(e.wait(10) for e in started)
    queued = [Task("q0", log), Task("q1", log), Task("q2", log)]
    pool.submit(2, queued[:1], is_load=True)
    pool.submit(3, queued[1:], is_load=False)
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    go.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert sorted(pool.get_finished()) == [(1, True), (2, False), (3, False)]
    assert all(t.cancelled for t in queued)
    assert sorted(name for name, _ in log) == ["run0", "run1"]
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(4, [Task("late", log)], is_load=True)
    assert not [t for t in threading.enumerate() if t.name.startswith("test_pool")]


def test_thread_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        DualQueueThreadPool(0, 1, "bad")
