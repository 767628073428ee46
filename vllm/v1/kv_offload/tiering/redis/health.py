# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's circuit breaker and the health thread that closes it again.

While the server cannot be reached, every job would wait for a connect or read timeout and every
lookup would miss anyway. The breaker turns that into an immediate answer: an I/O or lookup thread
that sees the server unreachable (``client.is_unreachable``) trips it; while it is open, lookups
answer False at once and jobs fail at once, without touching the network. The health thread
PINGs the server with exponential back-off (``MIN_BACKOFF_S`` doubling up to ``MAX_BACKOFF_S``)
and closes the breaker on the first answer. One log line per state change, none per attempt.

The same thread refreshes the server's figures for ``get_stats`` (keys and memory) every
``STATS_INTERVAL_S`` while the breaker is closed, so that ``get_stats`` never does I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vllm.logger import init_logger

logger = init_logger(__name__)

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0
STATS_INTERVAL_S = 2.0


class CircuitBreaker:
    """Open while the server is unreachable. Thread-safe.

    ``is_open`` is a plain attribute read without the lock (a bool assignment is atomic), so the
    scheduler thread checks it for free; transitions take the lock so each is logged once.

    Attributes:
        is_open: True while the server is considered unreachable.
        trips: how many times it opened.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.is_open = False
        self.trips = 0
        self._lock = threading.Lock()
        self._opened_at = 0.0
        # Set when the breaker opens, so the health thread starts probing at once.
        self.changed = threading.Event()
        # Set while closed (for callers that wait for the server to come back).
        self.closed = threading.Event()
        self.closed.set()

    def trip(self, exc: BaseException) -> None:
        """Open the breaker (no-op if open already); ``exc`` is what showed the server is down."""
        with self._lock:
            if self.is_open:
                return
            self.is_open = True
            self.trips += 1
            self._opened_at = time.monotonic()
            self.closed.clear()
        logger.warning(
            "redis tier %s: server unreachable (%s: %s); lookups miss and jobs fail until it "
            "answers again",
            self.name,
            type(exc).__name__,
            exc,
        )
        self.changed.set()

    def reset(self) -> None:
        """Close the breaker (no-op if closed)."""
        with self._lock:
            if not self.is_open:
                return
            self.is_open = False
            self.closed.set()
            down_s = time.monotonic() - self._opened_at
        logger.warning("redis tier %s: server reachable again after %.1f s", self.name, down_s)


class HealthThread:
    """Probes the server while the breaker is open and refreshes the stats while it is closed.

    Ownership: owns its thread; ``ping`` and ``refresh_stats`` are the tier's callables (run on
    this thread only; each bounded by the client's timeouts).
    """

    def __init__(
        self,
        name: str,
        breaker: CircuitBreaker,
        ping: Callable[[], None],
        refresh_stats: Callable[[], None],
    ) -> None:
        self._breaker = breaker
        self._ping = ping
        self._refresh_stats = refresh_stats
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"vllm_redis_tier_{name}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread; False if it is still inside a probe after ``timeout_s``."""
        self._stop.set()
        self._breaker.changed.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        backoff = MIN_BACKOFF_S
        next_stats = 0.0
        while not self._stop.is_set():
            breaker = self._breaker
            if breaker.is_open:
                try:
                    self._ping()
                except Exception:
                    delay = backoff
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                else:
                    breaker.reset()
                    backoff = MIN_BACKOFF_S
                    next_stats = 0.0
                    continue
            else:
                now = time.monotonic()
                if now >= next_stats:
                    try:
                        self._refresh_stats()
                    except Exception as e:
                        breaker.trip(e)
                        continue
                    next_stats = now + STATS_INTERVAL_S
                delay = max(0.0, next_stats - time.monotonic())
            # Not a synchronisation sleep: the back-off / refresh timer, cut short by a trip or
            # by stop().
            breaker.changed.wait(delay)
            breaker.changed.clear()
