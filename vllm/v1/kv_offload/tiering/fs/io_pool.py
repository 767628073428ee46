# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A thread pool with a load queue and a store queue, and per-job completion tracking.

Two kinds of workers share the two FIFO queues:

* read-priority workers (``n_read_threads``) take a queued load if there is one, else a store;
* write-priority workers (``n_write_threads``) take a queued store if there is one, else a load.

So neither queue starves (each has workers that prefer it), idle workers help the other queue,
and under pressure loads, which a request is waiting for, are served by their own workers
however many stores are queued.

A job is a list of tasks (a few chunks of its blocks). It finishes when its last task has run;
it succeeded iff every task returned True. Its ``on_done`` hook, if any, runs on the thread that
ran its last task, before the job is reported (the fs tier fsyncs a store job's directory
there). Finished jobs are collected by ``get_finished()``, each exactly once. ``shutdown()``
cancels queued tasks (their jobs finish as failed) and joins the workers, letting tasks already
running complete.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)


class IoTask(ABC):
    """One unit of work of a job (the fs tier's: a chunk of the job's blocks)."""

    @abstractmethod
    def run(self) -> bool:
        """Do the work on a pool thread; return success. Exceptions count as failure."""

    def cancel(self) -> None:  # noqa: B027
        """Called instead of ``run`` when the pool shuts down first (release what was
        acquired at submit time). Default: no-op."""


@dataclass(slots=True)
class _Job:
    job_id: int
    remaining: int
    on_done: Callable[[], None] | None
    success: bool = True


_Item = tuple[_Job, IoTask]


class DualQueueThreadPool:
    """Load/store task queues served by read-priority and write-priority daemon threads.

    Thread-safety: ``submit``, ``get_finished``, ``wait_idle`` and ``shutdown`` may be called from
    any thread; the tier calls them from the scheduler thread. ``get_finished`` must have a single
    consumer.

    Args:
        n_read_threads: workers that prefer loads (>= 1).
        n_write_threads: workers that prefer stores (>= 1).
        name_prefix: thread name prefix.
    """

    def __init__(self, n_read_threads: int, n_write_threads: int, name_prefix: str) -> None:
        if n_read_threads < 1 or n_write_threads < 1:
            raise ValueError(
                f"need at least one thread of each kind, got n_read_threads={n_read_threads}, "
                f"n_write_threads={n_write_threads}"
            )
        # ``_lock`` guards the queues and counts. Two conditions on it: idle workers wait for
        # tasks on ``_work``, ``wait_idle`` for the last job on ``_idle``. A job's end then
        # wakes no idle worker: with one condition, every finished job woke every idle thread
        # just to wait again, each wake-up a GIL round trip taken from the engine thread.
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._loads: deque[_Item] = deque()
        self._stores: deque[_Item] = deque()
        self._finished: deque[tuple[int, bool]] = deque()
        self._jobs_in_flight = 0
        self._closed = False
        self._threads = [
            threading.Thread(
                target=self._worker,
                args=(prefer_loads,),
                name=f"{name_prefix}_{'read' if prefer_loads else 'write'}_{i}",
                daemon=True,
            )
            for prefer_loads, count in ((True, n_read_threads), (False, n_write_threads))
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def num_jobs_in_flight(self) -> int:
        """Jobs submitted and not finished yet."""
        return self._jobs_in_flight

    def submit(
        self,
        job_id: int,
        tasks: Sequence[IoTask],
        *,
        is_load: bool,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Queue the tasks of job ``job_id``; returns at once.

        A job without tasks finishes at once, successfully (``on_done`` is not called).

        Args:
            on_done: called once, on the pool thread that ends the job's last task (run or
                cancelled), before the job is reported; an exception is logged.

        Raises:
            RuntimeError: the pool is shut down (nothing was queued).
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("the I/O pool is shut down")
            if not tasks:
                self._finished.append((job_id, True))
                return
            job = _Job(job_id, len(tasks), on_done)
            (self._loads if is_load else self._stores).extend((job, task) for task in tasks)
            self._jobs_in_flight += 1
            self._work.notify(len(tasks))

    def get_finished(self) -> list[tuple[int, bool]]:
        """Pop every ``(job_id, success)`` finished since the last call."""
        finished = self._finished
        out: list[tuple[int, bool]] = []
        while finished:
            out.append(finished.popleft())
        return out

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is in flight; returns False if ``timeout`` expired first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._jobs_in_flight == 0, timeout)

    def shutdown(self) -> None:
        """Cancel queued tasks (their jobs finish failed), then join every worker. Idempotent.

        Tasks already running complete normally.
        """
        with self._lock:
            self._closed = True
            dropped = list(self._loads) + list(self._stores)
            self._loads.clear()
            self._stores.clear()
            self._work.notify_all()
        for job, task in dropped:
            try:
                task.cancel()
            except Exception:
                logger.exception("fs tier: cancelling a task of job %d failed", job.job_id)
            self._task_done(job, False)
        for thread in self._threads:
            thread.join()

    def _worker(self, prefer_loads: bool) -> None:
        first, second = (self._loads, self._stores) if prefer_loads else (self._stores, self._loads)
        cond = self._work
        while True:
            with cond:
                while not first and not second:
                    if self._closed:
                        return
                    cond.wait()
                job, task = first.popleft() if first else second.popleft()
            try:
                ok = bool(task.run())
            except Exception:
                logger.exception("fs tier: a task of job %d raised", job.job_id)
                ok = False
            except BaseException:
                # The thread is going away (SystemExit, ...): still count the task, so that its
                # job is reported (as failed) exactly once instead of never.
                self._task_done(job, False)
                raise
            self._task_done(job, ok)
            del job, task  # drop references (and buffers they hold) before waiting again

    def _task_done(self, job: _Job, ok: bool) -> None:
        with self._lock:
            if not ok:
                job.success = False
            job.remaining -= 1
            assert job.remaining >= 0, f"job {job.job_id}: more tasks finished than submitted"
            if job.remaining:
                return
        if job.on_done is not None:
            try:
                job.on_done()
            except Exception:
                logger.exception("fs tier: finishing job %d failed", job.job_id)
        with self._lock:
            self._finished.append((job.job_id, job.success))
            self._jobs_in_flight -= 1
            if not self._jobs_in_flight:
                self._idle.notify_all()
