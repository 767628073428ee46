# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The reconcile thread of the filesystem tier: the start-up scan, then incremental passes.

Instances sharing a root see each other's files only by reading the directory. Lookups, loads
and stores reconcile the keys they touch; this thread reconciles the rest, so that every
instance's accounting (``usage()``) converges to the directory and its LRU order includes the
files others wrote:

* pass 0 is the start-up scan, at full speed (``first_pass``);
* then, forever, passes of ``RankDirWalker.walk``, throttled: at most ``batch`` directory entries
  (files and directories; a step may overrun by one directory) every ``interval_s`` seconds,
  and one interval between two passes, so an idle or small directory costs one short step per
  interval.

Convergence: a pass over a directory of ``E`` entries takes ``S = ceil(E / batch)`` steps, i.e.
at most ``(S + 1) x interval_s`` plus the time of the I/O itself. A change made at time ``t``
(a file written, deleted or replaced by anyone) is reflected in this instance's usage once the
pass that reads its directory after ``t`` has done so, i.e. by ``t + 2 x (S + 1) x interval_s``
(at worst the current pass had just read that directory). Once the directory stops changing,
this instance's usage equals it after at most two complete passes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from vllm.logger import init_logger
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
    on the thread only.

    Args:
        walker: does the passes.
        first_pass: runs pass 0 (the start-up scan) at full speed until done or the event is set.
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
        first_pass: Callable[[threading.Event], ScanStats],
        after_first: Callable[[ScanStats], None],
        after_step: Callable[[], None] | None,
        interval_s: float,
        batch: int,
        name: str,
    ) -> None:
        self._walker = walker
        self._first_pass = first_pass
        self._after_first = after_first
        self._after_step = after_step
        self._interval_s = interval_s
        self._batch = batch
        self._stop = threading.Event()
        self._scan_done = threading.Event()
        self._cond = threading.Condition()
        self._passes_started = 0
        self._last_complete = 0  # number of the last pass that completed (pass 0 is number 1)
        self._log = RateLimitedLog(logger)
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

    def wait_for_pass(self, timeout: float | None) -> bool:
        """Block until a complete pass that started after this call ended (tests, tools).

        Returns:
            False if ``timeout`` expired first (or the thread stopped).
        """
        with self._cond:
            started = self._passes_started
            self._cond.wait_for(
                lambda: self._last_complete > started or not self.thread.is_alive(), timeout
            )
            return self._last_complete > started

    # -----------------------------------------------------------------------------------------
    # The thread
    # -----------------------------------------------------------------------------------------

    def _begin_pass(self) -> int:
        with self._cond:
            self._passes_started += 1
            return self._passes_started

    def _end_pass(self, number: int, stats: ScanStats) -> None:
        with self._cond:
            if stats.completed:
                self._last_complete = number
                self.last_pass = stats
            self._cond.notify_all()

    def _run(self) -> None:
        completed = False
        try:
            started = time.time()
            number = self._begin_pass()
            stats = self._first_pass(self._stop)
            self._after_first(stats)
            self.scan_stats = stats
            completed = stats.completed and not self._stop.is_set()
            self._end_pass(number, stats)
        except Exception:
            logger.exception("fs tier: start-up scan failed")
        finally:
            self._scan_done.set()
            if not completed:
                with self._cond:
                    self._cond.notify_all()
        if completed:
            self._passes(hot_since=started - _MTIME_SLACK_S)
        with self._cond:
            self._cond.notify_all()

    def _passes(self, hot_since: float) -> None:
        """Pass after pass until stopped; files modified since the previous pass began count as
        recently used when first found."""
        while not self._stop.wait(self._interval_s):
            started = time.time()
            number = self._begin_pass()
            stats = ScanStats()
            steps = self._walker.walk(stats, hot_since=hot_since)
            budget = self._batch
            try:
                for n in steps:
                    budget -= n
                    if budget > 0:
                        continue
                    self._step_done()
                    if self._stop.wait(self._interval_s):
                        return
                    budget = self._batch
                self._step_done()
            except Exception:
                self._log(logging.ERROR, "pass", "fs tier: reconcile pass failed", exc_info=True)
                continue
            finally:
                steps.close()
            hot_since = started - _MTIME_SLACK_S
            self._end_pass(number, stats)

    def _step_done(self) -> None:
        if self._after_step is not None:
            self._after_step()
