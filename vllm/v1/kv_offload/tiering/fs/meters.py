# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Small thread-safe meters of the filesystem tier: its counters, a rate-limited log, the I/O busy
clocks and the free-space guard."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

_LOG_INTERVAL_S = 10.0


COUNTER_NAMES = (
    "store_jobs",
    "store_jobs_failed",
    "load_jobs",
    "load_jobs_failed",
    "blocks_written",
    "blocks_skipped",
    "blocks_loaded",
    "blocks_evicted",
    "corrupt_removed",
    "forged_removed",
    "unauthenticated_misses",
    "store_failures",
    "load_failures",
    "reads_given_up",
    "slots_lost",
    "claim_misses",
)
"""Every counter ``Counters.snapshot`` reports (0 until counted), besides the busy times; see
docs/fs_tier.md ("Statistics")."""


class Counters:
    """The tier's cumulative counters and its store/load busy clocks; thread-safe.

    I/O threads add a job's (or a chunk's) counts at once (``add``); ``snapshot`` reads them all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()
        self.store_clock = BusyClock()
        """Wall time during which at least one store ran."""
        self.load_clock = BusyClock()
        """Wall time during which at least one load ran."""

    def add(self, counts: Mapping[str, int]) -> None:
        """Add ``counts`` (name -> increment; names from ``COUNTER_NAMES``)."""
        if counts:
            with self._lock:
                self._values.update(counts)

    def incr(self, name: str) -> None:
        """Add one to ``name``."""
        with self._lock:
            self._values[name] += 1

    def snapshot(self) -> dict[str, int]:
        """Every counter of ``COUNTER_NAMES``, and ``store_busy_us`` / ``load_busy_us``: the wall
        time (microseconds) during which at least one store / load was running."""
        with self._lock:
            values = dict.fromkeys(COUNTER_NAMES, 0) | self._values
        values["store_busy_us"] = round(self.store_clock.seconds() * 1e6)
        values["load_busy_us"] = round(self.load_clock.seconds() * 1e6)
        return values


class RateLimitedLog:
    """Logs at most one message per kind every ``_LOG_INTERVAL_S``; counts the rest.

    Args:
        log: the logger to write to (default: this module's).
    """

    def __init__(self, log: logging.Logger | None = None) -> None:
        self._logger = log or logger
        self._lock = threading.Lock()
        self._last: dict[Any, float] = {}
        self._suppressed: Counter[Any] = Counter()

    def __call__(self, level: int, kind: Any, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < _LOG_INTERVAL_S:
                self._suppressed[kind] += 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        if suppressed:
            msg += f" ({suppressed} similar message(s) suppressed)"
        self._logger.log(level, msg, *args, exc_info=exc_info)


class BusyClock:
    """Wall time during which at least one operation was running; overlaps count once.

    The fs tier's I/O threads run several blocks at once, so summing per-block durations would
    count the same second once per thread. Thread-safe; use as a context manager around each
    operation.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.monotonic()
            self._active += 1

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._active -= 1
            assert self._active >= 0, "BusyClock: more exits than entries"
            if self._active == 0:
                self._total += time.monotonic() - self._since

    def seconds(self) -> float:
        """Busy seconds so far, the running stretch included."""
        with self._lock:
            running = time.monotonic() - self._since if self._active else 0.0
            return self._total + running


class FreeSpaceGuard:
    """Whether the filesystem has room for one more block file above ``min_free_bytes``.

    Logs once when space runs low and once when it is back (not once per store). Thread-safe.

    Args:
        dir_fd: a directory on the filesystem (borrowed).
        min_free_bytes: free bytes to leave.
        file_size: bytes of one block file.
        root_dir: for log messages.
    """

    def __init__(self, dir_fd: int, min_free_bytes: int, file_size: int, root_dir: str) -> None:
        self._dir_fd = dir_fd
        self._min_free_bytes = min_free_bytes
        self._needed = min_free_bytes + file_size
        self._root_dir = root_dir
        self._low = False
        self._lock = threading.Lock()

    def has_room(self) -> bool:
        """False (logged once per episode) when a write would leave too little free space."""
        try:
            st = os.statvfs(self._dir_fd)
        except OSError:
            return True  # cannot tell: the write itself will tell
        free = st.f_bavail * st.f_frsize
        low = free < self._needed
        if low != self._low:
            with self._lock:
                if low and not self._low:
                    logger.warning(
                        "fs tier: %d bytes free under %s (min_free_bytes=%d): stopped storing "
                        "blocks until space is freed",
                        free,
                        self._root_dir,
                        self._min_free_bytes,
                    )
                elif not low and self._low:
                    logger.info("fs tier: space freed under %s: storing resumed", self._root_dir)
                self._low = low
        return not low
