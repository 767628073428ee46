# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run``: serve a workload twice (without and with offloading) and report.

Owns the command's sequence: print the report's header, serve the baseline and then the
offloaded run, print the body, write ``--json`` and ``--plot``, and the exit code.

With one engine, each run is an ``EngineRun`` in this process (the baseline without a
connector; the offloaded run with the offloading connector, the CPU tier and, unless
``--no-fs``, the fs tier, and the redis tier with ``--redis-url``) whose front end the
workload's clients (``clients.py``) send their sessions' turns to, concurrently, with the
workload's think times. With ``--engines N`` > 1 the engines run in N processes of their own
and the clients' requests are routed to them (``fleet.py``).

Both runs share one event loop, run by ``interrupt.run_interruptible``: a Ctrl-C (or SIGTERM)
cancels the main task, whose ``async with`` blocks shut the engines down, and the command ends
with one line.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TextIO

from vllm.distributed.kv_event_publisher import ZmqEventPublisher
from vllm.entrypoints.cli.clients import GenerateFn, serve_workload
from vllm.entrypoints.cli.config import RunConfig
from vllm.entrypoints.cli.engine_run import EngineRun
from vllm.entrypoints.cli.fleet import serve_fleet
from vllm.entrypoints.cli.fleet_events import announce_engine_end, instance_publisher
from vllm.entrypoints.cli.interrupt import run_interruptible
from vllm.entrypoints.cli.metrics_server import (
    EngineMetrics,
    InstanceMetrics,
    MetricsServer,
    final_values,
)
from vllm.entrypoints.cli.progress import token_shares
from vllm.entrypoints.cli.report.figures import FsTierState, Report, RunResult
from vllm.entrypoints.cli.report.json_doc import report_json
from vllm.entrypoints.cli.report.plot import write_plot
from vllm.entrypoints.cli.report.text import PROG, render_body, render_fs_start, render_header
from vllm.entrypoints.cli.report.verdict import judge_report
from vllm.entrypoints.cli.workloads import Session, Workload, generate_workload
from vllm.entrypoints.router.metrics import RouterPromMetrics
from vllm.v1.engine.async_llm import AsyncLLM, GenerateOutput
from vllm.v1.engine.verification import BlockKey


def engine_generate(llm: AsyncLLM) -> GenerateFn:
    """The ``GenerateFn`` of one engine in this process."""

    def generate(session: Session, t: int, prompt: list[int]) -> AsyncIterator[GenerateOutput]:
        return llm.generate(session.request_id(t), prompt, session.turns[t].max_tokens)

    return generate


async def serve(
    config: RunConfig,
    workload: Workload,
    offload: bool,
    on_fs_start: Callable[[FsTierState], None] | None = None,
    metrics: EngineMetrics | None = None,
    publisher: ZmqEventPublisher | None = None,
    reference: Mapping[BlockKey, bytes] | None = None,
) -> tuple[RunResult, dict[BlockKey, bytes]]:
    """Serve ``workload`` on a fresh engine in this process; return what the run measured and
    the digests of the blocks it computed.

    Args:
        config: the invocation's settings.
        workload: what to serve.
        offload: with the offloading connector and its tiers (else the baseline).
        on_fs_start: called with the fs tier's state once its start-up scan counted what is on
            disk, before the first request (the command prints it at once).
        metrics: fed the run's metrics, labelled with the run (``--metrics-port``).
        publisher: where the engine's KV events go (``--kv-events-endpoint``); it outlives the
            run, which ends by announcing ``AllBlocksCleared``.
        reference: digests of blocks computed by another run (the baseline's), which the
            oracle checks this run's blocks against after its timed window.
    """
    sink = None if publisher is None else publisher.publish
    async with EngineRun(config, offload, metrics=metrics, event_sink=sink) as run:
        if run.result.fs is not None and on_fs_start is not None:
            on_fs_start(run.result.fs)
        samples = run.sampler.samples

        def shares() -> Mapping[str, float]:
            # The engine thread appends samples; reading the last one from the loop is a
            # snapshot.
            return token_shares(samples[-1].tokens) if samples else {}

        def on_start(t0: float) -> None:
            run.sampler.t0 = t0

        await run.start_window()
        log = await serve_workload(
            engine_generate(run.llm),
            workload,
            run.label,
            config.timeout_s,
            config.output.progress,
            shares,
            on_start,
        )
        await run.finish(reference)
    if publisher is not None:
        await announce_engine_end(publisher)
    result = run.result
    result.num_requests = workload.num_requests
    result.wall_s = log.wall_s
    result.outputs = log.outputs
    result.ttft_ms = log.ttft_ms
    result.latency_ms = log.latency_ms
    return result, run.digests


def load_average() -> float | None:
    """The machine's 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _write(stream: TextIO, lines: list[str]) -> None:
    # Flushed at once: the header must show before the run starts, and before stderr's progress.
    if lines:
        stream.write("\n".join(lines) + "\n")
        stream.flush()


async def _serve_both(
    config: RunConfig,
    workload: Workload,
    out: TextIO,
    recorder: EngineMetrics | None,
    instance_metrics: InstanceMetrics | None,
    router_metrics: RouterPromMetrics | None = None,
) -> Report:
    def on_fs_start(fs: FsTierState) -> None:
        _write(out, render_fs_start(fs))

    if config.fleet.enabled:
        return await serve_fleet(config, workload, on_fs_start, instance_metrics, router_metrics)
    # One publisher for both runs: one sequence of batch numbers across them.
    publisher = instance_publisher(config.events, 0, for_router=False)
    try:
        baseline, digests = await serve(
            config, workload, False, metrics=recorder, publisher=publisher
        )
        offload, _ = await serve(config, workload, True, on_fs_start, recorder, publisher, digests)
    finally:
        if publisher is not None:
            publisher.shutdown()
    report = Report(settings=dict(config.settings), baseline=baseline, offload=offload)
    if publisher is not None:
        report.kv_events = {
            "batches_sent": publisher.sent_batches,
            "batches_dropped": publisher.dropped_batches,
        }
    return report


def run_command(config: RunConfig) -> int:
    """Run the baseline and the offloaded run, print the report, write ``--json``/``--plot``.

    The report's header is printed before the baseline starts, the fs tier's state when the
    offloaded run's tier has scanned its root, the rest at the end. With ``--json -`` the JSON
    document goes to stdout and the human report to stderr.

    Returns:
        0 when the verdict passed (or, with ``--verify none``, no check failed), 1 when it
        failed or the run hit an error.

    Raises:
        Interrupted: a signal stopped the run (everything was shut down first).
    """
    output = config.output
    out = sys.stderr if output.json_to_stdout else sys.stdout
    workload = generate_workload(config.workload)
    load_at_start = load_average()
    _write(out, render_header(config.settings, workload.num_requests, load_average=load_at_start))
    recorder: EngineMetrics | None = None
    instance_metrics: InstanceMetrics | None = None
    router_metrics: RouterPromMetrics | None = None
    server: MetricsServer | None = None
    try:
        if output.metrics_port is not None:
            # One engine feeds a recorder here; a fleet's instances record their own and send it.
            if config.fleet.enabled:
                instance_metrics = InstanceMetrics()
                server = MetricsServer(instance_metrics.registry(), output.metrics_port)
                # The router's own series, in the same registry (docs/metrics.md).
                router_metrics = RouterPromMetrics(server.registry)
            else:
                recorder = EngineMetrics()
                server = MetricsServer(recorder.registry, output.metrics_port)
        # SIGINT and SIGTERM (INTERRUPT_SIGNALS): a fleet's processes, shared regions and fs files
        # are cleaned up alike.
        report = run_interruptible(
            _serve_both(config, workload, out, recorder, instance_metrics, router_metrics)
        )
    except (OSError, ValueError, RuntimeError) as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 1
    finally:
        if server is not None:
            server.close()
    load_at_end = load_average()
    if load_at_start is not None and load_at_end is not None:
        report.load_average = (load_at_start, load_at_end)
    _write(out, list(render_body(report)))
    try:
        if output.json_path is not None:
            doc = report_json(report)
            if server is not None:
                # The metrics' final values, per run (docs/metrics.md).
                runs = ("baseline", "offload")
                doc["metrics"] = {r: final_values(server.registry, r) for r in runs}
            text = json.dumps(doc, indent=2) + "\n"
            if output.json_to_stdout:
                sys.stdout.write(text)
                sys.stdout.flush()
            else:
                output.json_path.write_text(text)
        if output.plot_path is not None:
            write_plot(output.plot_path, report.offload, report.baseline, report.settings)
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot write the report: {e}\n")
        return 1
    return 1 if judge_report(report).status == "FAIL" else 0
