# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Fleet mode of ``vllm-kv-offload run``: ``--engines N`` engine instances in N processes.

Owns the command's side of a fleet: the instances' processes, the router, and the sum of the
instances' figures. Each instance (``cli/fleet_instance.py``) runs in a process of its own
(multiprocessing's ``spawn`` context: a fresh interpreter, nothing inherited but what is sent)
with its own GPU pool, CPU tier (a shared region named ``fleet-<pid>-<index>``) and fs
directory (``<--fs-root>/engine-<index>``); the instances share only the redis server of
``--redis-url``.

The clients run here, in the command's process, as in a single-engine run; the front end's
router (``vllm/entrypoints/router/``, set up by ``fleet_events.FleetRouting``) sends each
request to an instance by the ``--routing`` policy: ``kv-aware`` (the default) by the KV each
instance announced in its published events (it subscribes to every instance's private loopback
endpoints, ``fleet_events.py``), ``session`` by session affinity, ``round-robin`` per request.
Each run gets a fresh router; the kv-aware index carries on (an engine that ends announces
``AllBlocksCleared``), and between runs the front end waits until it applied every batch each
instance sent. The baseline (N engines without offloading) is routed by the same policy, so a
request may run on another instance in each run: outputs compare request by request (the model
is the same on every instance), each instance's offloaded outputs against the baseline's
outputs of the same requests.

Cross-instance reuse: every instance records the keys of the blocks it stored from its GPU pool
(it computed them), and, per block promoted from a tier, whether it had stored that key itself
before loading it (``EngineConfig.record_block_origins``). Keys are a function of the token
prefix, so every instance names a block alike; a block promoted from the redis tier that this
instance had not stored but another instance of the fleet did is KV another instance computed.

Shutdown: the instances are always stopped before ``serve_fleet`` returns or raises, cancelled
(Ctrl-C, SIGTERM) included: each is told ``exit`` and shuts its engine down (unlinking its
shared region); one that does not end within ``STOP_TIMEOUT_S`` gets SIGTERM, then SIGKILL, and
every process is joined; the region of one that did not end cleanly (killed, crashed) is
unlinked here. An instance that ends while it is needed fails the run with its exit code.
A Ctrl-C reaches every process of the terminal's process group, so the instances are started
with SIGINT ignored: only this process decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import shutil
import signal
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from vllm.entrypoints.cli.clients import serve_workload
from vllm.entrypoints.cli.config import REDIS_TIER_TYPE, RunConfig
from vllm.entrypoints.cli.fleet_events import FleetRouting, routing_figures
from vllm.entrypoints.cli.fleet_instance import Message, fleet_instance_id, process_target
from vllm.entrypoints.cli.metrics_server import InstanceMetrics
from vllm.entrypoints.cli.progress import token_shares
from vllm.entrypoints.cli.report.figures import (
    FsTierState,
    InstanceResult,
    PolicyRun,
    Report,
    RoutingFigures,
    RunResult,
)
from vllm.entrypoints.cli.workloads import Session, Workload
from vllm.entrypoints.router.metrics import RouterPromMetrics
from vllm.entrypoints.router.policies import ROUTING_POLICIES
from vllm.entrypoints.router.router import Router
from vllm.logger import init_logger
from vllm.v1.engine.async_llm import GenerateOutput
from vllm.v1.engine.verification import BlockKey
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion

logger = init_logger(__name__)

STOP_TIMEOUT_S = 60.0
"""How long an instance gets to shut down after ``exit`` (then SIGTERM) and after SIGTERM (then
SIGKILL): shutting down drains the fs tier's writes."""
SHARED_TIER_TYPES = (REDIS_TIER_TYPE,)
"""Tiers the instances share: only blocks promoted from these can be another instance's."""


class InstanceGone(RuntimeError):
    """An instance's process ended (or its pipe broke) while it was needed."""


@dataclass(eq=False)
class _Instance:
    """The command's side of one instance: its process, pipe and pending answers."""

    index: int
    process: BaseProcess
    conn: Connection
    replies: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)
    streams: dict[str, asyncio.Queue[Message]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    metrics: InstanceMetrics | None = None
    gone: bool = False

    def send(self, message: Message) -> None:
        if self.gone:
            raise InstanceGone(self.gone_message())
        try:
            self.conn.send(message)
        except OSError:
            self.gone = True
            raise InstanceGone(self.gone_message()) from None

    def gone_message(self) -> str:
        # Its pipe closed: the process ended or is ending; reaped for its exit code (bounded).
        self.process.join(timeout=5)
        code = self.process.exitcode
        how = "" if code is None else f" (exit code {code})"
        return f"engine {self.index} ended unexpectedly{how}; see its messages above"

    def on_readable(self) -> None:
        """Reader callback: route every complete message; a closed pipe fails every waiter."""
        try:
            while self.conn.poll():
                self._dispatch(self.conn.recv())
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            self.gone = True
            gone = ("gone",)
            self.replies.put_nowait(gone)
            for queue in self.streams.values():
                queue.put_nowait(gone)

    def _dispatch(self, message: Message) -> None:
        kind = message[0]
        if kind in ("first", "done", "failed"):
            queue = self.streams.get(message[1])
            if kind == "done":
                self.tokens = message[3]
            if queue is not None:  # None: the client gave up on it already
                queue.put_nowait(message)
        elif kind == "metrics":
            if self.metrics is not None:
                self.metrics.update(self.index, message[1])
        else:
            self.replies.put_nowait(message)

    async def reply(self, expected: str) -> Message:
        """The instance's next answer, which must be ``expected``."""
        message = await self.replies.get()
        if message[0] == "error":
            raise RuntimeError(f"engine {self.index}: {message[1]}")
        if message[0] == "gone":
            raise InstanceGone(self.gone_message())
        assert message[0] == expected, f"engine {self.index}: {message[0]!r}, not {expected!r}"
        return message


class Fleet:
    """The instances' processes and the router (see the module docstring).

    Args:
        config: the invocation's settings (``config.fleet.engines`` instances).
        workload: what the clients send.
        metrics: where the instances' metrics go (``--metrics-port``), if anywhere.
        router_metrics: where the router's own series go (``--metrics-port``), if anywhere.
    """

    def __init__(
        self,
        config: RunConfig,
        workload: Workload,
        metrics: InstanceMetrics | None = None,
        router_metrics: RouterPromMetrics | None = None,
    ) -> None:
        self.config = config
        self.workload = workload
        self.metrics = metrics
        self.instances: list[_Instance] = []
        # The current run's routes (request id -> instance) and router.
        self.routes: dict[str, int] = {}
        self.routing: FleetRouting | None = None
        self.router: Router | None = None
        # Per instance, the KV event batches its publisher sent so far (end of the last run).
        self.batches_sent = [0] * config.fleet.engines
        # The router's series (--metrics-port), labelled with the current run.
        self.router_metrics = router_metrics
        self.run_label = ""

    async def connect_events(self) -> None:
        """Wait for every instance's event endpoints and set up the front end's routing."""
        answers = [await i.reply("events") for i in self.instances]
        endpoints = [a[1] for a in answers]
        self.routing = FleetRouting(
            self.config.fleet.routing,
            len(self.instances),
            endpoints if all(e is not None for e in endpoints) else None,
            self.config.engine.effective_hash_block_size,
        )

    def start(self) -> None:
        """Start every instance's process (they import and wait for ``start``)."""
        ctx = multiprocessing.get_context("spawn")
        loop = asyncio.get_running_loop()
        for index in range(self.config.fleet.engines):
            parent_end, child_end = ctx.Pipe(duplex=True)
            process = ctx.Process(
                target=process_target,
                args=(child_end, self.config.for_instance(index), index, os.getpid()),
                name=f"vllm-kv-offload engine {index}",
                # Terminated by multiprocessing's exit handler should this process end without
                # stopping it (a second Ctrl-C during the shutdown).
                daemon=True,
            )
            # Ignored while it starts: the child inherits SIG_IGN through exec, so a Ctrl-C
            # during its start-up (imports) cannot kill it with a traceback; it keeps ignoring.
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                process.start()
            finally:
                signal.signal(signal.SIGINT, previous)
                child_end.close()
            instance = _Instance(index, process, parent_end, metrics=self.metrics)
            self.instances.append(instance)
            loop.add_reader(parent_end.fileno(), instance.on_readable)

    async def stop(self) -> None:
        """End every instance (``exit``, then SIGTERM, then SIGKILL) and join it, then the
        router's event feed."""
        for instance in self.instances:
            with contextlib.suppress(InstanceGone):
                instance.send(("exit",))
        await asyncio.gather(*(self._end(i) for i in self.instances))
        if self.routing is not None:
            self.routing.stop()

    async def _end(self, instance: _Instance) -> None:
        process = instance.process
        for escalate in (process.terminate, process.kill, None):
            if await _wait_exit(process, STOP_TIMEOUT_S):
                break
            if escalate is not None:
                escalate()
        process.join()
        asyncio.get_running_loop().remove_reader(instance.conn.fileno())
        instance.conn.close()
        if process.exitcode != 0:
            # The region's name is normally gone already (removed once its scheduler side and
            # worker joined); this covers an instance killed before that: this process knows
            # the name, so nothing is left in /dev/shm either way.
            path = SharedOffloadRegion.region_path(fleet_instance_id(os.getpid(), instance.index))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                logger.warning(
                    "engine %d ended with exit code %s; removed its shared region %s",
                    instance.index,
                    process.exitcode,
                    path,
                )

    async def generate(
        self, session: Session, t: int, prompt: list[int]
    ) -> AsyncIterator[GenerateOutput]:
        """The router's ``GenerateFn``: serve the turn on its instance, stream its outputs."""
        req_id = session.request_id(t)
        router = self.router
        assert router is not None, "generate outside a run"
        decision = router.route(req_id, session.session_id, prompt)
        index = decision.instance
        if self.router_metrics is not None:
            self.router_metrics.observe(self.run_label, router.policy.name, decision)
            feed = self.routing.feed_stats() if self.routing is not None else None
            if feed is not None:
                self.router_metrics.update_feed(self.run_label, router.policy.name, feed)
        self.routes[req_id] = index
        instance = self.instances[index]
        queue: asyncio.Queue[Message] = asyncio.Queue()
        instance.streams[req_id] = queue
        finished = False
        try:
            instance.send(("gen", req_id, prompt, session.turns[t].max_tokens))
            while not finished:
                message = await queue.get()
                kind = message[0]
                if kind == "gone":
                    raise InstanceGone(instance.gone_message())
                if kind == "failed":
                    raise RuntimeError(f"engine {index}: request {req_id}: {message[2]}")
                finished = kind == "done"
                if kind == "first":
                    router.on_first_token(req_id)
                elif finished and message[4] is not None:
                    router.on_measured_costs(index, message[4])
                tokens = tuple(message[2])
                yield GenerateOutput(req_id, () if finished else tokens, tokens, finished, None)
        finally:
            router.on_finished(req_id)
            instance.streams.pop(req_id, None)
            if not finished and not instance.gone:
                instance.send(("abort", req_id))

    async def run(
        self,
        offload: bool,
        on_fs_start: Callable[[FsTierState], None] | None = None,
        policy: str | None = None,
        tag: str | None = None,
        reference: Mapping[BlockKey, bytes] | None = None,
    ) -> tuple[list[RunResult], RoutingFigures, dict[BlockKey, bytes]]:
        """One run of the fleet (every instance baseline, or every one offloading).

        Args:
            offload: every instance offloading (else the baseline).
            on_fs_start: called with the fs directories' state before the first request.
            policy: route by this policy instead of ``--routing`` (``--compare-routing``).
            tag: run the offloaded tiers on fresh storage named by it (``--compare-routing``:
                every policy starts from the same empty fs directories and redis namespace).
            reference: block digests every instance's oracle checks against (the baseline's):
                a block one instance loads is checked against whichever instance computed it.

        Returns:
            Each instance's result, with its share of the requests, outputs and timings; how
            the run was routed; and the digests of the blocks the instances computed, merged.
        """
        config, workload = self.config, self.workload
        label = "offload" if offload else "baseline"
        assert self.routing is not None, "connect_events first"
        self.router = self.routing.new_router(policy)
        self.routes = {}
        self.run_label = label if policy is None else f"compare-{policy}"
        for instance in self.instances:
            tiers = (
                None
                if tag is None
                else config.tiers.for_comparison(tag).for_instance(instance.index)
            )
            instance.send(("start", offload, tiers, dict(reference or {})))
            instance.tokens = {}
        ready = [await i.reply("ready") for i in self.instances]
        fs_root = None if config.tiers.fs is None else config.tiers.fs.root
        if offload and fs_root is not None and on_fs_start is not None:
            fs = FsTierState(str(fs_root), _total_bound(config))
            fs.files_at_start = sum(r[1] for r in ready)
            fs.bytes_at_start = sum(r[2] for r in ready)
            on_fs_start(fs)

        def shares() -> Mapping[str, float]:
            tokens: dict[str, int] = {}
            for instance in self.instances:
                for name, n in instance.tokens.items():
                    tokens[name] = tokens.get(name, 0) + n
            return token_shares(tokens)

        def on_start(t0: float) -> None:
            for instance in self.instances:
                instance.send(("go", t0))

        log = await serve_workload(
            self.generate,
            workload,
            label,
            config.timeout_s,
            config.output.progress,
            shares,
            on_start,
        )
        for instance in self.instances:
            instance.send(("finish",))
        answers = [await i.reply("result") for i in self.instances]
        self.batches_sent = [a[4] for a in answers]
        # Off the event loop: it waits on the feed's thread (at once, unless a stream lags).
        caught_up = await asyncio.get_running_loop().run_in_executor(
            None, self.routing.catch_up, self.batches_sent
        )
        if not caught_up:
            logger.warning("the router's event feed did not catch up with every instance")
        figures = routing_figures(self.router, self.routing)
        wall_s = log.wall_s
        results: list[RunResult] = []
        digests: dict[BlockKey, bytes] = {}
        for index, (_, result, _, _, _, theirs) in enumerate(answers):
            digests.update(theirs)
            mine = sorted(r for r, i in self.routes.items() if i == index and r in log.outputs)
            result.wall_s = wall_s
            result.num_requests = sum(1 for i in self.routes.values() if i == index)
            result.outputs = {r: log.outputs[r] for r in mine}
            result.ttft_ms = [log.timings_ms[r][0] for r in mine]
            result.latency_ms = [log.timings_ms[r][1] for r in mine]
            results.append(result)
        if offload:
            stored = [a[2] for a in answers]
            for index, (result, answer) in enumerate(zip(results, answers, strict=True)):
                others = [s for j, s in enumerate(stored) if j != index]
                result.cross_instance_tokens = cross_instance_tokens(answer[3], others)
        return results, figures, digests


def cross_instance_tokens(
    served_not_stored_here: dict[tuple[str, bytes], int],
    stored_by_others: Sequence[frozenset[bytes]],
) -> int:
    """Tokens an instance served from shared-tier blocks that another instance stored.

    Args:
        served_not_stored_here: the instance's ``EngineStats.served_not_stored_here``.
        stored_by_others: the keys each other instance stored from its GPU pool.
    """
    return sum(
        n
        for (tier, key), n in served_not_stored_here.items()
        if tier in SHARED_TIER_TYPES and any(key in keys for keys in stored_by_others)
    )


async def _wait_exit(process: BaseProcess, timeout_s: float) -> bool:
    # The sentinel becomes readable when the process ends: no polling.
    if process.exitcode is not None:
        return True
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[None] = loop.create_future()
    sentinel = process.sentinel

    def on_end() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(sentinel, on_end)
    try:
        await asyncio.wait_for(ended, timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        loop.remove_reader(sentinel)


def _total_bound(config: RunConfig) -> int | None:
    # --fs-max-bytes bounds each instance's directory.
    fs = config.tiers.fs
    return None if fs is None else fs.max_bytes * config.fleet.engines


def _fleet_fs(config: RunConfig, parts: Sequence[RunResult]) -> FsTierState | None:
    states = [p.fs for p in parts if p.fs is not None]
    if config.tiers.fs is None or not states:
        return None
    return FsTierState.sum_of(str(config.tiers.fs.root), _total_bound(config), states)


async def serve_fleet(
    config: RunConfig,
    workload: Workload,
    on_fs_start: Callable[[FsTierState], None] | None = None,
    metrics: InstanceMetrics | None = None,
    router_metrics: RouterPromMetrics | None = None,
) -> Report:
    """Serve ``workload`` on the fleet without, then with offloading; the report of both.

    The instances are started once and serve every run (each run builds fresh engines), and
    are stopped before this returns or raises. With ``--compare-routing`` the offloaded run is
    served once more per policy, each on fresh storage (``TiersConfig.for_comparison``).

    Args:
        config: the invocation's settings.
        workload: what the clients send.
        on_fs_start: called with the instances' fs directories' state (added up) once every
            instance scanned its own, before the offloaded run's first request.
        metrics: where the instances' metrics go (``--metrics-port``), if anywhere.
        router_metrics: where the router's own series go (``--metrics-port``), if anywhere.
    """
    fleet = Fleet(config, workload, metrics, router_metrics)
    policy_runs: list[PolicyRun] = []
    try:
        fleet.start()
        await fleet.connect_events()
        baseline_parts, _, digests = await fleet.run(offload=False)
        offload_parts, routing, _ = await fleet.run(True, on_fs_start, reference=digests)
        if config.fleet.compare_routing:
            for policy in ROUTING_POLICIES:
                tag = f"{os.getpid()}-{policy}"
                parts, figures, _ = await fleet.run(
                    offload=True, policy=policy, tag=tag, reference=digests
                )
                for part in parts:
                    part.samples = []
                policy_runs.append(PolicyRun(figures, RunResult.sum_of(policy, True, parts)))
                _remove_comparison_storage(config, tag)
    finally:
        await fleet.stop()
    baseline = RunResult.sum_of("baseline", False, baseline_parts)
    offload = RunResult.sum_of("offload", True, offload_parts)
    offload.fs = _fleet_fs(config, offload_parts)
    for part in (*baseline_parts, *offload_parts):
        part.samples = []  # the merged run carries them (and the JSON would repeat them)
    baseline.check_accounting()
    offload.check_accounting()
    # Each instance's offloaded outputs are checked against the baseline's outputs of the
    # same requests (the baseline may have served them on another instance).
    for b, o in zip(baseline_parts, offload_parts, strict=True):
        b.outputs = {r: baseline.outputs[r] for r in o.outputs if r in baseline.outputs}
    instances = [
        InstanceResult(i, b, o)
        for i, (b, o) in enumerate(zip(baseline_parts, offload_parts, strict=True))
    ]
    report = Report(
        settings=dict(config.settings),
        baseline=baseline,
        offload=offload,
        instances=instances,
        routing=routing,
        policy_runs=policy_runs,
    )
    if config.events.enable_kv_cache_events:
        report.kv_events = {"batches_sent": sum(fleet.batches_sent)}
    return report


def _remove_comparison_storage(config: RunConfig, tag: str) -> None:
    # Only this invocation's fresh directories; the redis namespace's blocks expire.
    fs = config.tiers.for_comparison(tag).fs
    if fs is not None:
        shutil.rmtree(fs.root, ignore_errors=True)


__all__ = [
    "Fleet",
    "InstanceGone",
    "cross_instance_tokens",
    "serve_fleet",
]
