# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""One engine instance of a fleet (``vllm-kv-offload run --engines N``), in a process of its own.

``cli/fleet.py`` starts one process per instance (multiprocessing's ``spawn`` context) with
``process_target`` as its target and talks to it over a pipe (a ``multiprocessing`` connection).
This module owns the instance's side: the message loop, and one ``EngineRun`` per run (the same
engine run as a single-engine command's, ``cli/engine_run.py``), so an instance owns an
``EngineCore`` behind an ``AsyncLLM``, its own CPU tier (a shared region
named after ``fleet_instance_id``), its own fs directory and GPU pool; the only thing it
shares with the other instances is the redis server.

Instance -> parent, first: ``("events", endpoints)``: the private ``InstanceEndpoints`` its KV
event publisher bound for the front end's router (``fleet_events.py``), or None.

Messages, parent -> instance (tuples, the first item names them):
    ``("start", offload, tiers, reference)``: build the engine of a run (baseline or
        offloaded; ``tiers``: a ``TiersConfig`` replacing the instance's for this run, or None;
        ``reference``: the block digests the oracle checks the run's blocks against, the fleet's
        baseline's, every instance's merged, empty for the baseline itself); answered with
        ``("ready", fs_files, fs_bytes)`` once the fs tier scanned its directory.
    ``("go", t0)``: the run starts at ``time.monotonic() == t0`` (one clock for the machine).
    ``("gen", request_id, prompt, max_tokens)``: serve a request; answered with
        ``("first", request_id, token_ids)`` at its first tokens and
        ``("done", request_id, output_token_ids, cumulative_tokens_by_source, measured)``
        (``measured``: the ``MeasuredCosts`` its connector's load guard published last, or
        None; the router scores the instance with them).
    ``("abort", request_id)``: the client gave up on a request.
    ``("finish",)``: every request was answered: wait for the transfers, shut the engine down
        check what the oracle recorded, publish ``AllBlocksCleared`` and answer ``("result",
        RunResult, stored_keys, served_not_stored_here, batches_sent, digests)``
        (``batches_sent``: the publisher's count so far, so the router can wait until it applied
        them all; ``digests``: the blocks this run computed).
    ``("exit",)``, or the pipe closing: shut down and end the process.
Instance -> parent, besides the answers: ``("error", message)`` when the run failed, and with
``--metrics-port`` ``("metrics", families)`` (its recorder's metric families, every
``SEND_INTERVAL_S`` during a run and once more before ``result``).

Signals: SIGINT is ignored (a Ctrl-C reaches the whole process group, and the parent decides:
it sends ``exit``); SIGTERM shuts the engine down cleanly, like ``exit``. An instance whose
parent died sees its pipe close and shuts down too, so no instance outlives the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from vllm.distributed.kv_event_publisher import ZmqEventPublisher
from vllm.entrypoints.cli.config import RunConfig, TiersConfig
from vllm.entrypoints.cli.engine_run import EngineRun, StepSampler
from vllm.entrypoints.cli.fleet_events import (
    announce_engine_end,
    instance_publisher,
    private_endpoints,
)
from vllm.entrypoints.cli.interrupt import Interrupted, run_interruptible
from vllm.entrypoints.cli.metrics_server import SEND_INTERVAL_S, EngineMetrics
from vllm.entrypoints.router.policies import KVAware
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.verification import BlockKey

Message = tuple[Any, ...]


def fleet_instance_id(fleet_pid: int, index: int) -> str:
    """The id naming instance ``index``'s shared region: the command's pid, then the index."""
    return f"fleet-{fleet_pid}-{index}"


class _Exit(Exception):
    """The parent asked the instance to end (or went away)."""


class _Instance:
    """The instance's side of the pipe and its runs (everything on the process's event loop)."""

    def __init__(self, conn: Connection, config: RunConfig, index: int, fleet_pid: int) -> None:
        self.publisher: ZmqEventPublisher | None = None
        self.conn = conn
        self.config = config
        self.index = index
        self.instance_id = fleet_instance_id(fleet_pid, index)
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()
        # The command's process serves them; one recorder for both runs (labelled by run).
        self.metrics = EngineMetrics(index) if config.output.metrics_port is not None else None

    def send(self, message: Message) -> None:
        """Send ``message`` to the parent (a closed pipe means the parent is gone: dropped)."""
        with contextlib.suppress(OSError):
            self.conn.send(message)

    def on_readable(self) -> None:
        """Reader callback: queue every complete message; a closed pipe queues ``exit``."""
        try:
            while self.conn.poll():
                self.inbox.put_nowait(self.conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.inbox.put_nowait(("exit",))

    async def next_message(self) -> Message:
        """The next message; ``exit`` raises ``_Exit``."""
        message = await self.inbox.get()
        if message[0] == "exit":
            raise _Exit
        return message

    async def main(self) -> None:
        """Announce the event endpoints, then serve runs until the parent says ``exit`` (or
        goes away); the publisher is shut down last."""
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self.on_readable)
        for_router = self.config.fleet.routing == KVAware.name or self.config.fleet.compare_routing
        self.publisher = instance_publisher(self.config.events, self.index, for_router)
        try:
            private = (
                private_endpoints(self.publisher)
                if self.publisher is not None and for_router
                else None
            )
            self.send(("events", private))
            while True:
                message = await self.next_message()
                assert message[0] == "start", f"unexpected {message[0]!r} between runs"
                await self.serve(offload=bool(message[1]), tiers=message[2], reference=message[3])
        except _Exit:
            return
        finally:
            loop.remove_reader(self.conn.fileno())
            if self.publisher is not None:
                self.publisher.shutdown()

    async def serve(
        self,
        offload: bool,
        tiers: TiersConfig | None = None,
        reference: Mapping[BlockKey, bytes] | None = None,
    ) -> None:
        """One run: build the engine, serve the parent's requests, answer the result.

        Args:
            offload: with the offloading connector (else the baseline).
            tiers: this run's tiers instead of the instance's (``--compare-routing``).
            reference: the digests the oracle checks this run's blocks against.
        """
        config = self.config if tiers is None else dataclasses.replace(self.config, tiers=tiers)
        instance_id = self.instance_id if offload else None
        requests: dict[str, asyncio.Task[None]] = {}
        publisher = self.publisher
        sink = None if publisher is None else publisher.publish
        async with EngineRun(config, offload, instance_id, self.metrics, event_sink=sink) as run:
            sender = asyncio.ensure_future(self.send_metrics_every(SEND_INTERVAL_S))
            try:
                fs = run.result.fs
                self.send(("ready", fs.files_at_start if fs else 0, fs.bytes_at_start if fs else 0))
                while True:
                    message = await self.next_message()
                    kind = message[0]
                    if kind == "go":
                        run.sampler.t0 = message[1]
                        await run.start_window()
                    elif kind == "gen":
                        _, req_id, prompt, max_tokens = message
                        requests[req_id] = asyncio.ensure_future(
                            self.generate(run.llm, run.sampler, req_id, prompt, max_tokens)
                        )
                    elif kind == "abort":
                        task = requests.pop(message[1], None)
                        if task is not None:
                            task.cancel()
                    elif kind == "finish":
                        break
                    else:
                        raise AssertionError(f"unexpected message {kind!r} during a run")
                await asyncio.gather(*requests.values())
                snapshot = await run.finish(reference)
            finally:
                for task in (*requests.values(), sender):
                    task.cancel()
                await asyncio.gather(*requests.values(), sender, return_exceptions=True)
        self.send_metrics()
        run.result.num_requests = len(requests)
        origins = snapshot.engine_stats.served_not_stored_here or {}
        sent = 0 if publisher is None else await announce_engine_end(publisher)
        self.send(("result", run.result, snapshot.stored_keys, origins, sent, run.digests))

    def send_metrics(self) -> None:
        """Send the recorder's families to the parent (with ``--metrics-port`` only)."""
        if self.metrics is not None:
            self.send(("metrics", self.metrics.families()))

    async def send_metrics_every(self, interval_s: float) -> None:
        """Send the metrics every ``interval_s`` (cancelled by the caller)."""
        if self.metrics is None:
            return
        # A timer, not a synchronisation: the parent's scrapes see figures at most this old.
        while True:
            await asyncio.sleep(interval_s)
            self.send_metrics()

    async def generate(
        self,
        llm: AsyncLLM,
        sampler: StepSampler,
        req_id: str,
        prompt: list[int],
        max_tokens: int,
    ) -> None:
        """Serve one request, telling the parent its first tokens and its whole output."""
        first = True
        output: tuple[int, ...] = ()
        try:
            async for out in llm.generate(req_id, prompt, max_tokens):
                if first and out.new_token_ids:
                    first = False
                    self.send(("first", req_id, out.new_token_ids))
                output = out.output_token_ids
        except Exception as e:
            # The client waits for this request: tell it why it will not come.
            self.send(("failed", req_id, f"{type(e).__name__}: {e}"))
            return
        # The engine thread appends samples: the last one is a snapshot of the counters. The
        # costs the instance measured of itself go with it (the router scores it with them).
        tokens = dict(sampler.samples[-1].tokens) if sampler.samples else {}
        self.send(("done", req_id, output, tokens, sampler.measured_costs))


def instance_main(conn: Connection, config: RunConfig, index: int, fleet_pid: int) -> int:
    """Process target of instance ``index``: serve until told to exit; the exit code.

    Returns (as the process's exit code): 0 after ``exit``, 1 after an error (reported to the
    parent first), 143 after SIGTERM (everything shut down first).
    """
    # Ignored before anything else: the parent stops the instances on a Ctrl-C.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its lines go to the inherited stderr, each prefixed with the instance's index.
    logging.basicConfig(
        level=config.output.log_level,
        format=f"engine {index}: %(levelname)s %(name)s: %(message)s",
    )
    instance = _Instance(conn, config, index, fleet_pid)
    try:
        run_interruptible(instance.main(), signals=(signal.SIGTERM,))
        return 0
    except Interrupted as e:
        return e.exit_code
    except (OSError, ValueError, RuntimeError) as e:
        instance.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    except BaseException as e:
        # Unexpected: the traceback goes to stderr (inherited) for the bug report.
        traceback.print_exc(file=sys.stderr)
        instance.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    finally:
        conn.close()


def process_target(conn: Connection, config: RunConfig, index: int, fleet_pid: int) -> None:
    """The instance process's target (see ``instance_main``)."""
    # multiprocessing ignores a target's return value: the exit code goes through sys.exit.
    sys.exit(instance_main(conn, config, index, fleet_pid))
