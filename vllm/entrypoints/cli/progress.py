"""A plain-text progress bar on stderr (no dependency).

It redraws one line with ``\\r`` at most every ``min_interval_s`` and is disabled (prints nothing)
when the stream is not a terminal or the user passed ``--no-progress``, so logs and pipes stay
clean.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

from typing_extensions import Self


class ProgressBar:
    """``[label] [#####.....]  done/total requests  elapsed  extra``.

    Args:
        total: the count that means done (> 0).
        label: a short name printed in front.
        stream: where to draw (default: stderr).
        enabled: None decides by ``stream.isatty()``; False draws nothing.
        width: characters of the bar itself.
        min_interval_s: the shortest time between two redraws.
    """

    def __init__(
        self,
        total: int,
        label: str,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 30,
        min_interval_s: float = 0.1,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.min_interval_s = min_interval_s
        self._start = time.monotonic()
        self._last_draw = -float("inf")
        self._done = 0
        self._extra = ""
        self._drawn = False

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        """Set the count of finished items and redraw if enough time passed (or ``force``)."""
        self._done = min(done, self.total)
        self._extra = extra
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval_s:
            return
        self._last_draw = now
        self.stream.write("\r" + self.line(now - self._start))
        self.stream.flush()
        self._drawn = True

    def line(self, elapsed_s: float) -> str:
        """The text of the bar (without the carriage return)."""
        filled = round(self.width * self._done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{self.label}] [{bar}] {self._done}/{self.total} requests  {elapsed_s:5.1f} s"
        return f"{text}  {self._extra}" if self._extra else text

    def close(self) -> None:
        """Draw the final state and end the line."""
        if not self.enabled:
            return
        self.update(self._done, self._extra, force=True)
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
