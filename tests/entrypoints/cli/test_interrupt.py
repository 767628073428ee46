# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``run_interruptible``: a signal cancels the main task, its cleanup runs, ``Interrupted`` says so.

The signals are sent to this very process; the coroutines wait on an event that is never set, so
only the cancellation can end them (no sleeps).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from vllm.entrypoints.cli.interrupt import Interrupted, run_interruptible


async def _wait_for_signal(sig: signal.Signals, cleaned: list[str]) -> None:
    child_done = asyncio.Event()

    async def client() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("client")
            child_done.set()

    task = asyncio.ensure_future(client())
    await asyncio.sleep(0)  # let the client start
    try:
        os.kill(os.getpid(), sig)
        await asyncio.Event().wait()
    finally:
        task.cancel()
        await child_done.wait()
        cleaned.append("main")


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
def test_a_signal_cancels_the_task_after_its_cleanup(sig: signal.Signals, code: int) -> None:
    cleaned: list[str] = []
    before = signal.getsignal(sig)
    with pytest.raises(Interrupted) as info:
        run_interruptible(_wait_for_signal(sig, cleaned), signals=(signal.SIGINT, signal.SIGTERM))
    assert (info.value.signum, info.value.exit_code) == (sig, code)
    assert cleaned == ["client", "main"]
    assert signal.getsignal(sig) == before  # the handler is gone with the loop


def test_a_keyboard_interrupt_raised_elsewhere_is_handled_the_same_way() -> None:
    # As when another component installed a handler that raises KeyboardInterrupt.
    cleaned: list[str] = []

    async def main() -> None:
        def interrupt() -> None:
            raise KeyboardInterrupt

        asyncio.get_running_loop().call_soon(interrupt)
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("main")

    with pytest.raises(Interrupted) as info:
        run_interruptible(main())
    assert info.value.exit_code == 130
    assert cleaned == ["main"]


def test_a_run_that_completes_returns_its_value() -> None:
    async def main() -> int:
        return 42

    assert run_interruptible(main()) == 42
