# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Run the command's coroutine so that an interrupt (Ctrl-C) ends it cleanly, in one line.

An interrupt must stop the run without a traceback and still clean up: the engine thread
stopped and joined, the fs tier's I/O threads drained, the CPU tier's shared region in
``/dev/shm`` unlinked. ``asyncio.run`` does not give that: a ``KeyboardInterrupt`` raised wherever
the main thread happens to be leaves tasks half-run and logs their exceptions ("exception was
never retrieved"). ``run_interruptible`` instead turns each signal of ``signals`` into a
cancellation of the one main task (``loop.add_signal_handler``, so the signal is handled between
two callbacks, never inside one); the task's ``finally`` and ``async with`` blocks shut
everything down, and ``Interrupted`` is raised for the caller to report in one line.

A second signal of the same kind while the cleanup runs is no longer caught: SIGINT raises
``KeyboardInterrupt`` and SIGTERM terminates, for the user who does not want to wait. A
``KeyboardInterrupt`` that reaches the loop some other way (a handler installed elsewhere that
raises it) is treated like a caught SIGINT: cancel, clean up, ``Interrupted``.

The signals are a parameter; by default (``INTERRUPT_SIGNALS``) SIGINT and SIGTERM, so a terminated
run cleans up exactly as an interrupted one (``Interrupted.exit_code`` 130 or 143).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")

INTERRUPT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
"""Signals that end a run cleanly (see the module docstring)."""


class Interrupted(Exception):
    """The run was interrupted by a signal and has cleaned up.

    Attributes:
        signum: the signal; the conventional exit code is ``128 + signum``.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """``128 + signum``: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


def run_interruptible(
    main: Coroutine[Any, Any, _T], signals: Sequence[signal.Signals] = INTERRUPT_SIGNALS
) -> _T:
    """Run ``main`` on a new event loop until it completes; a signal cancels it cleanly.

    Returns:
        What ``main`` returned (also when a signal came too late to cancel it).

    Raises:
        Interrupted: a signal of ``signals`` (or a ``KeyboardInterrupt``) cancelled ``main``,
            after ``main`` ran its cleanup.
    """
    loop = asyncio.new_event_loop()
    task = loop.create_task(main)
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        task.cancel()
        # Uninstalled, so that a second one is handled the default way (see the docstring).
        loop.remove_signal_handler(signum)

    try:
        for signum in signals:
            loop.add_signal_handler(signum, on_signal, signum)
        try:
            return loop.run_until_complete(task)
        except KeyboardInterrupt:
            if task.done():
                raise
            received.append(signal.SIGINT)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(task)
            raise Interrupted(signal.SIGINT) from None
        except asyncio.CancelledError:
            if received:
                raise Interrupted(received[0]) from None
            raise
    finally:
        try:
            for signum in signals:
                loop.remove_signal_handler(signum)
            _cancel_leftovers(loop)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    # Tasks the main task left behind: cancelled and awaited, their outcomes retrieved, so that
    # none is logged as "never retrieved" when the loop closes.
    leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in leftovers:
        t.cancel()
    if leftovers:
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
