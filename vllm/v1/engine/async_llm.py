# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``AsyncLLM``: an asyncio front end over the synchronous ``EngineCore``.

Like vLLM's ``AsyncLLM``, it lets many coroutines stream generations concurrently::

    async with AsyncLLM(EngineCore(config)) as llm:
        async for out in llm.generate("r0", prompt_token_ids, max_tokens=16):
            print(out.new_token_ids)

Threads and ownership:
    * The engine is not thread-safe. From construction until ``shutdown()`` it belongs to one
      background thread (the *engine thread*), which is the only code that touches it: it applies
      queued commands (add, abort, call) between steps and runs ``engine.step()`` while the
      engine has work. No other thread may use the engine meanwhile; use ``call()`` to run code
      on it (e.g. to read stats).
    * Outputs are handed to the event loop with ``loop.call_soon_threadsafe`` and routed to one
      ``asyncio.Queue`` per request; ``generate`` consumes its queue.
    * Cancelling a ``generate`` (or leaving its ``async for`` early and closing it) aborts the
      request: the engine frees its GPU blocks at the next command drain (or, if a connector
      load is writing them, once the load is reported).

While the engine only waits for transfers (no token scheduled), the engine thread polls every
``idle_poll_s`` instead of spinning, so that I/O threads keep the CPU.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

from typing_extensions import Self

from vllm.v1.engine.core import IDLE_POLL_S, EngineCore
from vllm.v1.engine.scheduler import RequestOutput

_T = TypeVar("_T")

StepCallback = Callable[[EngineCore, list[RequestOutput]], None]
"""Called on the engine thread after every engine step that ran, with the step's outputs (e.g. to
sample stats).
It may read the engine but must not call ``step``, ``add_request`` or ``abort_request``."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (it raised, or ``shutdown()`` was called)."""


@dataclass(frozen=True)
class GenerateOutput:
    """One streamed update of a request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens generated since the previous update.
        output_token_ids: every token generated so far.
        finished: True on the request's last update.
        finish_reason: ``"length"`` or ``"abort"`` once finished.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    kv_transfer_params: dict[str, Any] | None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[EngineCore], Any]
    future: Future[Any]


@dataclass
class _WaitIdle:
    future: Future[None]


_Command = _Add | _Abort | _Call | _WaitIdle
_END = object()  # queue sentinel: the engine stopped


class AsyncLLM:
    """Streams generations from an ``EngineCore`` driven by a background thread.

    Args:
        engine: the engine; owned from now on (shut down by ``shutdown()``).
        step_callback: called on the engine thread after each step (see ``StepCallback``).
        idle_poll_s: how long the engine thread waits for a command between steps that
            scheduled no token (only transfers pending).
    """

    def __init__(
        self,
        engine: EngineCore,
        *,
        step_callback: StepCallback | None = None,
        idle_poll_s: float = IDLE_POLL_S,
    ) -> None:
        self.engine = engine
        self._step_callback = step_callback
        self._idle_poll_s = idle_poll_s
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side: request id -> its output queue.
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException | object]] = {}
        # Shared with the engine thread, under _cond.
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._abort_ids = itertools.count()

    # -----------------------------------------------------------------------------------------
    # Lifecycle
    # -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread, bound to the running event loop (idempotent).

        Raises:
            EngineDeadError: ``shutdown()`` was called.
        """
        if self._thread is not None:
            return
        if self._stopping:
            raise EngineDeadError("the engine was shut down")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="vllm_engine_core", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread (after the step in progress), then shut the engine down.

        Streams still open end with ``EngineDeadError``. Idempotent.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            self._fail_streams(EngineDeadError("the engine was shut down"))
        self.engine.shutdown()

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and did not fail."""
        return self._thread is not None and self._thread.is_alive() and self._error is None

    # -----------------------------------------------------------------------------------------
    # Requests
    # -----------------------------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncGenerator[GenerateOutput, None]:
        """Submit a request and yield its outputs as the engine produces them.

        The last output has ``finished=True``. If the caller stops early (cancellation,
        ``break`` followed by ``aclose()``), the request is aborted.

        Raises:
            ValueError: a duplicate ``request_id``, an empty prompt or ``max_tokens < 1``.
            EngineDeadError: the engine stopped before the request finished.
        """
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must not be empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        self.start()
        queue: asyncio.Queue[RequestOutput | BaseException | object] = asyncio.Queue()
        self._streams[request_id] = queue
        finished = False
        output: list[int] = []
        try:
            self._send(_Add(request_id, list(prompt_token_ids), max_tokens, kv_transfer_params))
            while True:
                item = await queue.get()
                if item is _END:
                    raise EngineDeadError(f"the engine stopped before {request_id!r} finished")
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"request {request_id!r} failed: {item}") from item
                assert isinstance(item, RequestOutput), f"unexpected stream item {item!r}"
                output.extend(item.new_token_ids)
                finished = item.finished
                yield GenerateOutput(
                    request_id=request_id,
                    new_token_ids=tuple(item.new_token_ids),
                    output_token_ids=tuple(output),
                    finished=item.finished,
                    finish_reason=item.finish_reason,
                )
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and self.is_running:
                self._send(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its stream ends with ``abort``."""
        self._send(_Abort(request_id))

    async def call(self, fn: Callable[[EngineCore], _T]) -> _T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        future: Future[_T] = Future()
        self.start()
        self._send(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def wait_until_idle(self) -> None:
        """Wait until the engine has no request and no transfer in flight.

        Cascades to slower tiers keep the engine busy after the last output; this returns once
        they are finished too.
        """
        future: Future[None] = Future()
        self.start()
        self._send(_WaitIdle(future))
        await asyncio.wrap_future(future)

    # -----------------------------------------------------------------------------------------
    # Engine thread
    # -----------------------------------------------------------------------------------------

    def _send(self, command: _Command) -> None:
        with self._cond:
            if self._error is not None or self._stopping:
                err = EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")
                if isinstance(command, (_Call, _WaitIdle)):
                    command.future.set_exception(err)
                    return
                if isinstance(command, _Abort):
                    return
                raise err
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        engine = self.engine
        idle_waiters: list[Future[None]] = []
        idle_step = False
        try:
            while True:
                with self._cond:
                    if not self._commands and not self._stopping:
                        if not engine.has_pending_work():
                            for waiter in idle_waiters:
                                waiter.set_result(None)
                            idle_waiters.clear()
                            self._idle_wait(None)
                        elif idle_step:
                            self._idle_wait(self._idle_poll_s)
                    commands = list(self._commands)
                    self._commands.clear()
                    stopping = self._stopping
                for command in commands:
                    self._apply(command, idle_waiters)
                if stopping:
                    break
                # With nothing to do, step() only returns the outputs of requests aborted
                # between steps (and drains events).
                steps_before = engine.stats.steps
                idle_before = engine.stats.idle_steps
                outputs = engine.step()
                idle_step = engine.stats.idle_steps > idle_before and not outputs
                if self._step_callback is not None and engine.stats.steps > steps_before:
                    self._step_callback(engine, outputs)
                if outputs:
                    self._post(self._dispatch, outputs)
        except BaseException as e:
            with self._cond:
                self._error = e
                leftover = list(self._commands)
                self._commands.clear()
            for command in leftover:
                if isinstance(command, (_Call, _WaitIdle)):
                    command.future.set_exception(EngineDeadError(f"the engine failed: {e!r}"))
            for waiter in idle_waiters:
                waiter.set_exception(EngineDeadError(f"the engine failed: {e!r}"))
            self._post(self._fail_streams, e)
            return
        err = EngineDeadError("the engine was shut down")
        with self._cond:
            leftover = list(self._commands)
            self._commands.clear()
        for command in leftover:
            if isinstance(command, (_Call, _WaitIdle)):
                command.future.set_exception(err)
        for waiter in idle_waiters:
            waiter.set_exception(err)

    def _idle_wait(self, timeout: float | None) -> None:
        # Engine thread, self._cond held: sleep until a command arrives (or the timeout), as
        # the engine's idle time (EngineStats.idle_wait_seconds).
        start = time.perf_counter()
        self._cond.wait(timeout)
        self.engine.stats.idle_wait_seconds += time.perf_counter() - start

    def _apply(self, command: _Command, idle_waiters: list[Future[None]]) -> None:
        engine = self.engine
        if isinstance(command, _Add):
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.max_tokens,
                    kv_transfer_params=command.kv_transfer_params,
                )
            except Exception as e:  # a bad request fails its own stream, not the engine
                self._post(self._fail_stream, command.request_id, e)
        elif isinstance(command, _Abort):
            engine.abort_request(command.request_id)
        elif isinstance(command, _Call):
            try:
                command.future.set_result(command.fn(engine))
            except Exception as e:
                command.future.set_exception(e)
        else:
            idle_waiters.append(command.future)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        assert loop is not None, "the engine thread runs without an event loop"
        if not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)

    # -----------------------------------------------------------------------------------------
    # Event-loop side
    # -----------------------------------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            queue = self._streams.get(out.request_id)
            if queue is not None:  # None: its consumer went away (already aborted)
                queue.put_nowait(out)

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _fail_streams(self, error: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error if not isinstance(error, EngineDeadError) else _END)
