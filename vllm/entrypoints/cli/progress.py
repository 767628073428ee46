# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A run's progress on stderr: a ``tqdm`` bar on a terminal, else a line every few seconds.

On a terminal the bar is tqdm's (the progress bar of vLLM and most of the ML ecosystem). It is
fitted to the terminal's width on every update, so it never wraps and leaves no stale lines
behind on a narrow or resized terminal, and it is erased when the run ends (``leave=False``) so
that only the report stays on the screen. It stops two columns short of the edge: a Ctrl-C is
echoed by the terminal as ``^C`` where the cursor is, and on a full-width bar that echo would wrap
and push the bar up out of reach of the erase; ``close`` also erases the rest of the line, where
the echo was. When stderr is not a terminal (a CI log,
``2>&1 | tee``), carriage-return redraws would pile up into one endless line, so ``Progress``
prints instead one short, complete line every ``line_interval_s`` seconds, and a last one when
the run ends. ``--no-progress`` turns both off.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tqdm import tqdm
from typing_extensions import override

from vllm.entrypoints.cli.report.figures import Tier
from vllm.utils.closing import ClosingContextManager

LINE_INTERVAL_S = 5.0
"""Seconds between two progress lines when stderr is not a terminal."""
ECHO_MARGIN = 2
"""Columns the bar leaves free at the right edge, for the terminal's ``^C`` echo."""
_ERASE_TO_END_OF_LINE = "\x1b[K"


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def token_shares(tokens: Mapping[str, int]) -> dict[str, float]:
    """The progress line's shares (computed, GPU, CPU, fs, redis) of cumulative ``tokens``."""
    total = sum(tokens.values())
    if not total:
        return {}
    counts = {"computed": tokens.get("computed", 0)} | {
        name: tokens.get(t.value, 0)
        for name, t in (("GPU", Tier.GPU), ("CPU", Tier.CPU), ("fs", Tier.FS))
    }
    if tokens.get(Tier.REDIS.value):
        counts["redis"] = tokens[Tier.REDIS.value]
    return {name: n / total for name, n in counts.items()}


def format_shares(shares: Mapping[str, float]) -> str:
    """``computed 14% GPU 47% CPU 22% fs 18%`` from fractions (empty when there are none)."""
    return " ".join(f"{name} {100 * value:.0f}%" for name, value in shares.items())


class Progress(ClosingContextManager):
    """How far one run got: ``done`` of ``total`` requests, and where prompt tokens came from.

    Args:
        total: the number of requests that means done (>= 1).
        label: the run's name (``baseline`` or ``offload``), printed in front.
        stream: where to write (default: stderr).
        enabled: False writes nothing.
        tty: draw a tqdm bar (True) or print lines (False); None asks ``stream.isatty()``.
        line_interval_s: seconds between two lines when not drawing a bar.
        ncols: the bar's width; None follows the terminal, less ``ECHO_MARGIN``.
        clock: the time source (seconds, monotonic).
    """

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        enabled: bool = True,
        tty: bool | None = None,
        line_interval_s: float = LINE_INTERVAL_S,
        ncols: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.line_interval_s = line_interval_s
        self._clock = clock
        self._start = clock()
        self._last_line = self._start
        self._done = 0
        self._shares = ""
        self._closed = False
        self._fixed_ncols = ncols
        self._bar: tqdm[Any] | None = None
        if enabled and self.tty:
            self._bar = tqdm(
                total=self.total,
                desc=label,
                unit="req",
                file=self.stream,
                leave=False,
                ncols=self._ncols(),
                mininterval=0.1,
                # A bar per run, one after the other: never a second row, never a cursor move.
                position=0,
            )

    def _ncols(self) -> int:
        # Measured on every update (a resized terminal gets a bar of its new width). tqdm's own
        # dynamic_ncols would fill the last columns, where the ^C echo goes.
        if self._fixed_ncols is not None:
            return self._fixed_ncols
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 80
        return max(20, columns - ECHO_MARGIN)

    def update(self, done: int, shares: Mapping[str, float] | None = None) -> None:
        """Set the count of finished requests and the token shares so far."""
        self._done = min(done, self.total)
        if shares is not None:
            self._shares = format_shares(shares)
        if self._bar is not None:
            self._bar.ncols = self._ncols()
            self._bar.set_postfix_str(self._shares, refresh=False)
            self._bar.update(self._done - self._bar.n)
        self.tick()

    def tick(self) -> None:
        """Print a line if ``line_interval_s`` passed since the last; on a terminal, redraw.

        Called on every update and by a timer, so a line comes even while no request finishes.
        """
        if not self.enabled or self._closed:
            return
        if self._bar is not None:
            self._bar.ncols = self._ncols()
            self._bar.refresh()  # the elapsed time moves on while no request finishes
            return
        now = self._clock()
        if now - self._last_line >= self.line_interval_s:
            self._write_line(now)

    def line(self, now: float | None = None) -> str:
        """The text of one progress line (without the newline)."""
        elapsed = (self._clock() if now is None else now) - self._start
        text = f"{self.label}: {self._done}/{self.total} requests, {elapsed:.0f} s"
        return f"{text}; {self._shares}" if self._shares else text

    def _write_line(self, now: float) -> None:
        self._last_line = now
        self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Erase the bar, or print the last line. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            self.stream.write(_ERASE_TO_END_OF_LINE)  # e.g. a ^C echoed after the bar
            self.stream.flush()
        elif self.enabled:
            self._write_line(self._clock())

    @override
    def _release(self) -> None:
        self.close()
