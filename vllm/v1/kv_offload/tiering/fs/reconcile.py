# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The reconcile thread of the filesystem tier: the start-up scan, then incremental passes.

Instances sharing a root see each other's files only by reading the directory. Lookups, loads
and stores reconcile the keys they touch; this thread reconciles the rest, so that every
instance's accounting (``usage()``) converges to the directory and its LRU order includes the
files others wrote:

* pass 0 is the start-up scan, at full speed (``RankDirWalker.scan``);
* then, every ``interval_s``, the thread lists the other writers (``WriterRegistry``) and, when
  there is something to learn, takes one step of a pass of ``RankDirWalker.walk``: at most
  ``batch`` directory entries (files and directories; a step may overrun by one directory).

When there is something to learn: while another writer is registered; for one complete pass
after the last one left (or was found gone: a crashed writer leaves temporary files and claimed
slots); and for one pass after a lookup, load or store found the directory different from the
index (``CapacityIndex.num_outside_changes``: an operator deleted or copied files). Otherwise this
instance is the only writer (``solo``): its index holds every block file of the directory, lookups
answer from it at once, and the thread costs one listing of ``writers/`` per interval, however
long the run.

Convergence: a pass over a directory of ``E`` entries takes ``S = ceil(E / batch)`` steps, i.e.
at most ``(S + 1) x interval_s`` plus the time of the I/O itself. A change made at time ``t``
by another writer (a file written, deleted or replaced) is reflected in this instance's usage
once the pass that reads its directory after ``t`` has done so, i.e. by
``t + 2 x (S + 1) x interval_s`` (at worst the current pass had just read that directory). Once
the directory stops changing, this instance's usage equals it after at most two complete passes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.fs.capacity import CapacityIndex
from vllm.v1.kv_offload.tiering.fs.meters import RateLimitedLog
from vllm.v1.kv_offload.tiering.fs.scan import RankDirWalker, ScanStats

logger = init_logger(__name__)

_MTIME_SLACK_S = 1.0
"""A file found by a pass counts as recent if modified at most this long before the previous
pass began: file times come from a coarse kernel clock (a few ms behind ``time.time()``) and, on
a network filesystem, from the server's clock."""


class Reconciler:
    """Owns the scan/reconcile daemon thread of one tier.

    Thread-safety: ``start``/``stop``/``wait_*`` may be called from any thread; the passes run
    on the thread only. ``solo`` may be read from any thread (a bool, set by the thread).

    Args:
        walker: does the passes: pass 0 with ``scan`` (at full speed until done or the thread is
            stopped), the later ones with ``walk``.
        index: the capacity index (``num_outside_changes``).
        count_writers: ``() -> (live, gone)``: other writers registered now, and those found gone
            by this call (``WriterRegistry.count_others``).
        after_first: called with pass 0's stats (evict down to the bound, log).
        after_step: called after every step of later passes (evict down to the bound when only
            the index enforces it); may be None.
        interval_s: seconds between two steps.
        batch: entries per step.
        name: the thread's name.
    """

    def __init__(
        self,
        walker: RankDirWalker,
        *,
        index: CapacityIndex,
        count_writers: Callable[[], tuple[int, int]],
        after_first: Callable[[ScanStats], None],
        after_step: Callable[[], None] | None,
        interval_s: float,
        batch: int,
        name: str,
    ) -> None:
        self._walker = walker
        self._index = index
        self._count_writers = count_writers
        self._after_first = after_first
        self._after_step = after_step
        self._interval_s = interval_s
        self._batch = batch
        self._stop = threading.Event()
        self._scan_done = threading.Event()
        self._cond = threading.Condition()
        self._rounds_started = 0
        self._last_complete = 0  # number of the last round that completed (pass 0 is number 1)
        self._log = RateLimitedLog(logger)
        self.solo = False
        """Whether this instance is the only writer of the run directory and its index holds
        every block file in it: set once a complete pass saw no other writer, cleared when one
        registers."""
        self.scan_stats: ScanStats | None = None
        """Pass 0's stats once it ended."""
        self.last_pass: ScanStats | None = None
        """The last complete pass's stats."""
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def stop(self, timeout: float | None) -> bool:
        """Ask the thread to stop (at its next directory) and wait for it.

        Returns:
            False if it is still running after ``timeout`` (blocked in the filesystem).
        """
        self._stop.set()
        if self.thread.ident is not None:
            self.thread.join(timeout)
        return not self.thread.is_alive()

    def wait_for_scan(self, timeout: float | None) -> ScanStats | None:
        """Block until pass 0 ended; its stats, or None if ``timeout`` expired."""
        if not self._scan_done.wait(timeout):
            return None
        return self.scan_stats

    def wait_for_round(self, timeout: float | None) -> bool:
        """Block until a complete round that started after this call ended (the tier's
        ``wait_reconciled``): a
        complete pass, or, with nothing to learn (``solo``, nothing changed behind the index's
        back), a listing of the writers that found none.

        Returns:
            False if ``timeout`` expired first (or the thread stopped).
        """
        with self._cond:
            started = self._rounds_started
            self._cond.wait_for(
                lambda: self._last_complete > started or not self.thread.is_alive(), timeout
            )
            return self._last_complete > started

    # -----------------------------------------------------------------------------------------
    # The thread
    # -----------------------------------------------------------------------------------------

    def _begin_round(self) -> int:
        with self._cond:
            self._rounds_started += 1
            return self._rounds_started

    def _end_round(self, number: int, stats: ScanStats | None) -> None:
        with self._cond:
            if stats is None or stats.completed:
                self._last_complete = number
                if stats is not None:
                    self.last_pass = stats
            self._cond.notify_all()

    def _run(self) -> None:
        completed = False
        try:
            started = time.time()
            number = self._begin_round()
            live_before, _ = self._count_writers()
            stats = self._walker.scan(self._stop)
            self._after_first(stats)
            self.scan_stats = stats
            completed = stats.completed and not self._stop.is_set()
            live_after, _ = self._count_writers()
            self.solo = completed and live_before == live_after == 0
            self._end_round(number, stats)
        except Exception:
            logger.exception("fs tier: start-up scan failed")
        finally:
            self._scan_done.set()
            if not completed:
                with self._cond:
                    self._cond.notify_all()
        if completed:
            self._loop(hot_since=started - _MTIME_SLACK_S)
        with self._cond:
            self._cond.notify_all()

    def _loop(self, hot_since: float) -> None:
        """Every interval until stopped: list the writers, and take one step of a pass when
        there is something to learn. Files modified since the previous pass began count as
        recently used when first found."""
        steps: Generator[int, None, None] | None = None
        stats = ScanStats()
        number = 0
        started = 0.0
        saw_writer = False
        outside_changes = self._index.num_outside_changes
        try:
            while not self._stop.wait(self._interval_s):
                try:
                    live, gone = self._count_writers()
                except OSError as e:
                    self._log(logging.WARNING, "writers", "fs tier: cannot list writers: %s", e)
                    live, gone = 1, 0  # cannot tell: assume others
                if live:
                    self.solo = False
                    saw_writer = True
                if steps is None:
                    changed = self._index.num_outside_changes != outside_changes
                    if self.solo and not (gone or changed):
                        self._end_round(self._begin_round(), None)
                        continue
                    number, stats, started = self._begin_round(), ScanStats(), time.time()
                    saw_writer = live > 0
                    outside_changes = self._index.num_outside_changes
                    steps = self._walker.walk(stats, hot_since=hot_since)
                try:
                    ended = self._step(steps)
                except Exception:
                    self._log(
                        logging.ERROR, "pass", "fs tier: reconcile pass failed", exc_info=True
                    )
                    ended = False
                    steps.close()
                    steps = None
                if self._after_step is not None:
                    self._after_step()
                if ended:
                    steps = None
                    hot_since = started - _MTIME_SLACK_S
                    self._end_round(number, stats)
                    if not saw_writer:
                        self.solo = True
        finally:
            if steps is not None:
                steps.close()

    def _step(self, steps: Generator[int, None, None]) -> bool:
        """Walk up to ``batch`` entries of the pass; True if the pass ended."""
        budget = self._batch
        for n in steps:
            budget -= n
            if budget <= 0:
                return False
        return True
