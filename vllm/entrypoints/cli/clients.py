# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The workload's clients: concurrent sessions sending their turns, and what they saw.

Owns the client side of a run, the same for one engine in this process (``run.py``) and for a
fleet's router (``fleet.py``): ``serve_workload`` runs every client of the workload as an
asyncio task against a ``GenerateFn``, with the workload's think times, draws the run's progress
and records each request's output and timings in a ``ClientLog``. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

from vllm.entrypoints.cli.progress import Progress
from vllm.entrypoints.cli.workloads import Session, Workload
from vllm.v1.engine.async_llm import GenerateOutput

PROGRESS_TICK_S = 1.0
"""How often the progress line's timer looks at the clock (lines come every few seconds)."""

GenerateFn = Callable[[Session, int, list[int]], AsyncIterator[GenerateOutput]]
"""Sends turn ``t`` of a session with its prompt and streams the outputs (an engine, or a
fleet's router)."""


@dataclass
class ClientLog:
    """What the clients saw: outputs and timings per request (ms), when the run started and when
    its last output came (``time.monotonic()``)."""

    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    t0: float = 0.0
    last_output_time: float = 0.0
    timings_ms: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        """Seconds from the start of the run to its last output."""
        return max(self.last_output_time - self.t0, 0.0)


async def _run_session(
    generate: GenerateFn, session: Session, log: ClientLog, on_done: Callable[[], None]
) -> None:
    history: list[int] = list(session.prefix)
    for t, turn in enumerate(session.turns):
        if turn.delay_s > 0:
            await asyncio.sleep(turn.delay_s)
        prompt = session.prompt(t, history)
        req_id = session.request_id(t)
        start = time.monotonic()
        first: float | None = None
        output: tuple[int, ...] = ()
        async for out in generate(session, t, prompt):
            if first is None and out.new_token_ids:
                first = time.monotonic()
            output = out.output_token_ids
        end = time.monotonic()
        log.outputs[req_id] = output
        log.ttft_ms.append(((first or end) - start) * 1e3)
        log.latency_ms.append((end - start) * 1e3)
        log.timings_ms[req_id] = (log.ttft_ms[-1], log.latency_ms[-1])
        log.last_output_time = max(log.last_output_time, end)
        if session.keeps_history:
            history = [*prompt, *output]
        on_done()


async def _run_client(
    generate: GenerateFn, sessions: list[Session], log: ClientLog, on_done: Callable[[], None]
) -> None:
    for session in sessions:
        await _run_session(generate, session, log, on_done)


async def _tick(progress: Progress) -> None:
    # A timer, not a synchronisation: lets the progress line come while no request finishes.
    while True:
        await asyncio.sleep(PROGRESS_TICK_S)
        progress.tick()


async def _serve_clients(
    generate: GenerateFn,
    workload: Workload,
    log: ClientLog,
    on_done: Callable[[], None],
    timeout_s: float | None,
) -> bool:
    # The clients are tasks that are always cancelled and awaited before this returns (also when
    # it is cancelled itself), so that no client outlives its engine and none of their exceptions
    # goes unretrieved. False when timeout_s passed first.
    clients = [
        asyncio.ensure_future(_run_client(generate, workload.sessions_of_client(c), log, on_done))
        for c in sorted({s.client for s in workload.sessions})
    ]
    try:
        finished, pending = await asyncio.wait(
            clients, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION
        )
        for task in finished:
            task.result()  # a client's error is the run's error
        return not pending
    finally:
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)


async def serve_workload(
    generate: GenerateFn,
    workload: Workload,
    label: str,
    timeout_s: float | None,
    progress: bool,
    token_shares: Callable[[], Mapping[str, float]],
    on_start: Callable[[float], None],
) -> ClientLog:
    """Run every client of ``workload`` to the end and return what they saw.

    Args:
        generate: where the clients send their requests.
        workload: what they send.
        label: the run's name, in the progress line and in errors.
        timeout_s: longest time the clients may take (None: no limit).
        progress: draw progress on stderr (``progress.Progress``).
        token_shares: where prompt tokens came from so far, for the progress line.
        on_start: called with the run's start time (``time.monotonic()``) just before the first
            client starts.

    Raises:
        RuntimeError: ``timeout_s`` passed before every request finished.
    """
    log = ClientLog()
    with Progress(workload.num_requests, label, enabled=progress) as bar:

        def on_done() -> None:
            bar.update(len(log.outputs), token_shares())

        ticker = asyncio.ensure_future(_tick(bar))
        try:
            log.t0 = time.monotonic()
            on_start(log.t0)
            if not await _serve_clients(generate, workload, log, on_done, timeout_s):
                raise RuntimeError(
                    f"{label} run: {len(log.outputs)} of {workload.num_requests} requests "
                    f"finished within the --timeout of {timeout_s:g} s"
                )
        finally:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
    return log
