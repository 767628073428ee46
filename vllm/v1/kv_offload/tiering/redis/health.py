# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's view of the server's health: the circuit breaker, refused commands, and the
health thread that probes what is down.

* ``CircuitBreaker``: while the server cannot be used (unreachable, or refusing this client's
  credentials) every job would wait for a connect or read timeout, or fail anyway, and every lookup
  would miss. The breaker turns that into an immediate answer: a thread that sees the server cut
  off (``client.cuts_off``) trips it; while it is open, lookups answer False at once and jobs fail
  at once, without touching the network. It says why: *unreachable* (refused, reset, timed out)
  or *authentication failed* (a wrong or missing password, a disabled user), which is a
  misconfiguration, not an outage.
* ``PermissionGates``: a command the server refuses for this user (ACL ``NOPERM``, e.g. a user
  without ``SET``) fails the jobs that need it at once for ``GATE_RETRY_S``, then is tried again.
* ``HealthThread``: PINGs the server while the breaker is open, with exponential back-off
  (``MIN_BACKOFF_S`` doubling up to ``MAX_BACKOFF_S``; an authentication failure is retried every
  ``MAX_BACKOFF_S`` only: a wrong password is not fixed by retrying), and closes the breaker on
  the first answer. In a cluster it also probes each master found unreachable (``client.Router``
  keeps their state), so that one dead master only misses its own slots.

One log line per state change (the breaker opening, its cause changing, it closing; a command
refused, then allowed again), none per attempt; every line names the server with its credentials
masked (``redaction``).

The same thread refreshes the server's figures for ``get_stats`` (keys and memory) every
``STATS_INTERVAL_S`` while the breaker is closed, so that ``get_stats`` never does I/O.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.redis.client import ErrorKind, error_kind
from vllm.v1.kv_offload.tiering.redis.redaction import Redactor

logger = init_logger(__name__)

MIN_BACKOFF_S = 0.25
MAX_BACKOFF_S = 8.0
STATS_INTERVAL_S = 2.0
GATE_RETRY_S = MAX_BACKOFF_S
"""How long a command the server refused (NOPERM) fails at once before it is tried again."""

_CAUSES = {
    ErrorKind.AUTH: (
        "authentication failed",
        "check the credentials (url, url_env or password_file); lookups miss and jobs fail, "
        f"retried every {MAX_BACKOFF_S:g} s",
    ),
    ErrorKind.UNREACHABLE: (
        "server unreachable",
        "lookups miss and jobs fail until it answers again",
    ),
}


def _cause(exc: BaseException) -> ErrorKind:
    return ErrorKind.AUTH if error_kind(exc) is ErrorKind.AUTH else ErrorKind.UNREACHABLE


class CircuitBreaker:
    """Open while the server cannot be used. Thread-safe.

    ``is_open`` is a plain attribute read without the lock (a bool assignment is atomic), so the
    scheduler thread checks it for free; transitions take the lock so each is logged once.

    Attributes:
        is_open: True while the server is considered cut off.
        cause: why it is open (``ErrorKind.UNREACHABLE`` or ``ErrorKind.AUTH``); None when
            closed.
        trips: how many times it opened.
        auth_failures: how many times it opened, or its probe failed, for authentication.
    """

    def __init__(self, name: str, redactor: Redactor) -> None:
        self.name = name
        self.is_open = False
        self.cause: ErrorKind | None = None
        self.trips = 0
        self.auth_failures = 0
        self._redactor = redactor
        self._lock = threading.Lock()
        self._opened_at = 0.0
        # Set when the breaker opens, so the health thread starts probing at once.
        self.changed = threading.Event()
        # Set while closed (for callers that wait for the server to come back).
        self.closed = threading.Event()
        self.closed.set()

    def trip(self, exc: BaseException) -> None:
        """Open the breaker, or record a failed probe while open; ``exc`` is what showed the
        server cut off. Logs when it opens and when its cause changes."""
        cause = _cause(exc)
        with self._lock:
            if cause is ErrorKind.AUTH:
                self.auth_failures += 1
            if self.is_open and cause is self.cause:
                return
            opened = not self.is_open
            if opened:
                self.is_open = True
                self.trips += 1
                self._opened_at = time.monotonic()
                self.closed.clear()
            self.cause = cause
        what, then = _CAUSES[cause]
        logger.warning(
            "redis tier %s: %s (%s); %s",
            self.name,
            what if opened else f"still cut off, now: {what}",
            self._redactor.error(exc),
            then,
        )
        if opened:
            self.changed.set()

    def reset(self) -> None:
        """Close the breaker (no-op if closed)."""
        with self._lock:
            if not self.is_open:
                return
            self.is_open = False
            self.cause = None
            down_s = time.monotonic() - self._opened_at
            # Logged before ``closed`` is set, so a waiter of ``closed`` finds the line written.
            logger.warning("redis tier %s: server answers again after %.1f s", self.name, down_s)
            self.closed.set()


class PermissionGates:
    """Commands the server refuses for this user (``NOPERM``), each failing at once for
    ``GATE_RETRY_S`` and then tried again. Thread-safe (the lookup and I/O threads share it).

    Attributes:
        refusals: commands refused so far (every refused round, also while a gate is shut).
    """

    def __init__(self, name: str, redactor: Redactor) -> None:
        self._name = name
        self._redactor = redactor
        self._lock = threading.Lock()
        # Command -> when it may be tried again; replaced whole, so reads need no lock.
        self._shut: dict[str, float] = {}
        self.refusals = 0

    def is_shut(self, command: str) -> bool:
        """Whether ``command`` is refused now (fail its work without sending it)."""
        until = self._shut.get(command)
        return until is not None and time.monotonic() < until

    def refused(self, command: str, exc: BaseException) -> None:
        """The server refused ``command`` (``exc``: its NOPERM reply); logs only if the command
        was not refused before."""
        with self._lock:
            self.refusals += 1
            first = command not in self._shut
            self._shut = {**self._shut, command: time.monotonic() + GATE_RETRY_S}
        if first:
            logger.warning(
                "redis tier %s: the server refuses %s for this user (%s): the work that needs "
                "it fails until the ACL allows it; tried again every %g s",
                self._name,
                command,
                self._redactor.error(exc),
                GATE_RETRY_S,
            )

    def allowed(self, command: str) -> None:
        """``command`` succeeded: open its gate if it was shut (logged once)."""
        if command not in self._shut:
            return
        with self._lock:
            if command not in self._shut:
                return
            self._shut = {c: t for c, t in self._shut.items() if c != command}
        logger.warning("redis tier %s: the server allows %s again", self._name, command)


class HealthThread:
    """Probes the server while the breaker is open, probes cluster masters found unreachable,
    and refreshes the stats while the breaker is closed.

    Ownership: owns its thread; ``ping``, ``refresh_stats`` and ``probe_masters`` are the tier's
    callables (run on this thread only; each bounded by the client's timeouts).
    """

    def __init__(
        self,
        name: str,
        breaker: CircuitBreaker,
        ping: Callable[[], None],
        refresh_stats: Callable[[], None],
        probe_masters: Callable[[], float | None],
    ) -> None:
        """Args:
        ping: raises unless the server (a cluster: some master) answers.
        refresh_stats: refreshes the server figures; raises when the server is cut off.
        probe_masters: probes the cluster masters marked unreachable whose retry time has
            come; returns the seconds until the next one is due, None when none is down.
        """
        self._breaker = breaker
        self._ping = ping
        self._refresh_stats = refresh_stats
        self._probe_masters = probe_masters
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
                except Exception as e:
                    breaker.trip(e)  # logs only if the cause changed
                    if breaker.cause is ErrorKind.AUTH:
                        delay = MAX_BACKOFF_S
                    else:
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
                master_due = self._probe_masters()
                if master_due is not None:
                    delay = min(delay, master_due)
            # Not a synchronisation sleep: the back-off / refresh timer, cut short by a trip or
            # by stop().
            breaker.changed.wait(delay)
            breaker.changed.clear()
