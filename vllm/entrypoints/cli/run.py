# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run``: serve a workload twice (without and with offloading) and report.

Each run builds a fresh ``EngineCore`` (the baseline without a connector; the offloaded run with
the offloading connector, the CPU tier and, unless ``--no-fs``, the fs tier), wraps it in the
asyncio front end ``AsyncLLM`` and lets the workload's clients send their sessions' turns
concurrently, with the workload's think times. A step callback on the engine thread samples the
engine's counters after every step for the plot. Once the last output arrived, the run waits
until every transfer (including cascades to the fs tier) finished, so the next invocation over
the same fs root starts warm with everything this one stored.

Both runs share one event loop, run by ``interrupt.run_interruptible``: a Ctrl-C (or SIGTERM)
cancels the main task, whose ``async with`` blocks shut the engines down, and the command ends
with one line.

With ``--engines N`` > 1 the engines run in N processes of their own and the clients' requests
are routed to them; ``cli/fleet.py`` does that, with this module's pieces.

What a run measured (the step sampler, the end-of-run snapshot and the ``RunResult`` filled from
it) is read from the engine by ``run_figures.py``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from vllm.entrypoints.cli.checks import STDOUT, clear_fs_root
from vllm.entrypoints.cli.interrupt import run_interruptible
from vllm.entrypoints.cli.metrics_server import MetricsExporter
from vllm.entrypoints.cli.options import RunOptions
from vllm.entrypoints.cli.progress import Progress
from vllm.entrypoints.cli.report import (
    FsTierState,
    Report,
    RunResult,
    redact_url,
    token_shares,
)
from vllm.entrypoints.cli.report_text import (
    format_bytes,
    render_body,
    render_fs_start,
    render_header,
)
from vllm.entrypoints.cli.run_figures import (
    FS_TIER_TYPE,
    REDIS_TIER_TYPE,
    StepSampler,
    fill_result,
    fs_usage_after_scan,
    snapshot_engine,
)
from vllm.entrypoints.cli.workloads import Session, Workload, generate_workload, max_request_tokens
from vllm.v1.engine.async_llm import AsyncLLM, GenerateOutput
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.model import ModelStandIn, hybrid_stand_in

PROG = "vllm-kv-offload"
IDLE_TIMEOUT_S = 600.0
"""Longest wait for in-flight transfers after the last output before the run gives up."""
PROGRESS_TICK_S = 1.0
"""How often the progress line's timer looks at the clock (lines come every few seconds)."""

GenerateFn = Callable[[Session, int, list[int]], AsyncIterator[GenerateOutput]]
"""Sends turn ``t`` of a session with its prompt and streams the outputs (an engine, or a
fleet's router)."""


def extra_config(opts: RunOptions) -> dict[str, Any]:
    """The offloading connector's ``kv_connector_extra_config`` for ``opts``."""
    cfg: dict[str, Any] = {
        "cpu_bytes_to_use": opts.cpu_bytes,
        "eviction_policy": opts.eviction_policy,
        "block_size": opts.offload_block_size,
    }
    if opts.fs_root is None and opts.redis_url is None:
        cfg["spec_name"] = "CPUOffloadingSpec"
        return cfg
    cfg["spec_name"] = "TieringOffloadingSpec"
    tiers: list[dict[str, Any]] = []
    if opts.fs_root is not None:
        tier: dict[str, Any] = {
            "type": FS_TIER_TYPE,
            "root_dir": str(opts.fs_root),
            "n_read_threads": opts.fs_read_threads,
            "n_write_threads": opts.fs_write_threads,
        }
        if opts.fs_max_bytes is not None:
            tier["max_bytes"] = opts.fs_max_bytes
        tiers.append(tier)
    if opts.redis_url is not None:
        # After the fs tier: lookups ask the local disk before the network.
        tiers.append({"type": REDIS_TIER_TYPE, "url": opts.redis_url})
    cfg["secondary_tiers"] = tiers
    return cfg


def engine_config(opts: RunOptions, offload: bool, instance_id: str | None = None) -> EngineConfig:
    """The engine settings of one run (identical for both runs but for the connector).

    Args:
        opts: the run's options.
        offload: with the offloading connector.
        instance_id: names the CPU tier's shared region (default: unique per process).
    """
    extra: dict[str, Any] = {} if instance_id is None else {"instance_id": instance_id}
    block_sizes: tuple[int, ...] = (opts.block_size,)
    windows: tuple[int | None, ...] = ()
    if ModelStandIn(opts.model_stand_in) is ModelStandIn.HYBRID:
        block_sizes, windows = hybrid_stand_in(opts.block_size, opts.sliding_window)
    return EngineConfig(
        gpu_block_sizes=block_sizes,
        sliding_windows=windows,
        num_gpu_blocks=opts.gpu_blocks,
        num_layers=opts.num_layers,
        num_kv_heads=opts.num_kv_heads,
        head_size=opts.head_size,
        dtype=opts.dtype,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        vocab_size=opts.workload.vocab_size,
        kv_connector_extra_config=extra_config(opts) if offload else None,
        device=opts.device,
        async_scheduling=opts.async_scheduling,
        # A fleet tells KV another instance computed from an instance's own.
        record_block_origins=opts.fleet,
        **extra,
    )


def _token_shares(sampler: StepSampler) -> dict[str, float]:
    # The engine thread appends samples; reading the last one from the loop is a snapshot.
    if not sampler.samples:
        return {}
    return token_shares(sampler.samples[-1].tokens)


@dataclass
class ClientLog:
    """What the clients saw: outputs and timings per request (ms), the time of the last output."""

    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)
    ttft_ms: list[float] = field(default_factory=list)
    latency_ms: list[float] = field(default_factory=list)
    last_output_time: float = 0.0
    timings_ms: dict[str, tuple[float, float]] = field(default_factory=dict)


def engine_generate(llm: AsyncLLM) -> GenerateFn:
    """The ``GenerateFn`` of one engine in this process."""

    def generate(session: Session, t: int, prompt: list[int]) -> AsyncIterator[GenerateOutput]:
        return llm.generate(session.request_id(t), prompt, session.turns[t].max_tokens)

    return generate


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


async def tick(progress: Progress) -> None:
    """Let the progress line come while no request finishes (cancelled by the caller)."""
    # A timer, not a synchronisation: lets the progress line come while no request finishes.
    while True:
        await asyncio.sleep(PROGRESS_TICK_S)
        progress.tick()


async def serve_clients(
    generate: GenerateFn,
    workload: Workload,
    log: ClientLog,
    on_done: Callable[[], None],
    timeout_s: float | None,
) -> bool:
    """Run every client to the end; False when ``timeout_s`` passed first.

    The clients are tasks that are always cancelled and awaited before this returns (also when
    it is cancelled itself), so that no client outlives its engine and none of their exceptions
    goes unretrieved.
    """
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


async def serve(
    opts: RunOptions,
    workload: Workload,
    offload: bool,
    on_fs_start: Callable[[FsTierState], None] | None = None,
    exporter: MetricsExporter | None = None,
) -> RunResult:
    """Serve ``workload`` on a fresh engine and return what the run measured.

    Args:
        opts: the run's options.
        workload: what to serve.
        offload: with the offloading connector and its tiers (else the baseline).
        on_fs_start: called with the fs tier's state once its start-up scan counted what is on
            disk, before the first request (the command prints it at once).
        exporter: fed the run's metrics, labelled with the run (``--metrics-port``).
    """
    label = "offload" if offload else "baseline"
    engine = EngineCore(engine_config(opts, offload))
    result = RunResult(label=label, offload=offload, num_requests=workload.num_requests)
    if offload and opts.redis_url is not None:
        result.redis_url = redact_url(opts.redis_url)
    if offload and opts.fs_root is not None:
        result.fs = FsTierState(root_dir=str(opts.fs_root), max_bytes=opts.fs_max_bytes)
    sampler = StepSampler(t0=time.monotonic())
    log = ClientLog()
    done = 0

    callback = sampler if exporter is None else exporter.attach(engine, label, sampler)
    # From here on the engine belongs to the front end's thread (and is shut down by it).
    async with AsyncLLM(engine, step_callback=callback) as llm:
        if result.fs is not None:
            # Only to report what was on disk before the run: the tier serves during its scan.
            files, size = await llm.call(fs_usage_after_scan)
            result.fs.files_at_start, result.fs.bytes_at_start = files, size
            if on_fs_start is not None:
                on_fs_start(result.fs)
        with Progress(workload.num_requests, label, enabled=opts.progress) as progress:

            def on_done() -> None:
                nonlocal done
                done += 1
                progress.update(done, _token_shares(sampler))

            ticker = asyncio.ensure_future(tick(progress))
            try:
                t0 = sampler.t0 = time.monotonic()
                if not await serve_clients(
                    engine_generate(llm), workload, log, on_done, opts.timeout_s
                ):
                    raise RuntimeError(
                        f"{label} run: {done} of {workload.num_requests} requests finished within "
                        f"the --timeout of {opts.timeout_s:g} s"
                    )
                try:
                    await asyncio.wait_for(llm.wait_until_idle(), IDLE_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise RuntimeError(
                        f"{label} run: transfers still in flight {IDLE_TIMEOUT_S:.0f} s after the "
                        "last output"
                    ) from None
            finally:
                ticker.cancel()
                await asyncio.gather(ticker, return_exceptions=True)
        if exporter is not None:
            await llm.call(lambda e: exporter.flush(e, label))
        snapshot = await llm.call(snapshot_engine)
    result.wall_s = max(log.last_output_time - t0, 0.0)
    result.outputs = log.outputs
    result.ttft_ms = log.ttft_ms
    result.latency_ms = log.latency_ms
    result.samples = sampler.samples
    result.overhead_us = sampler.overhead_us
    result.worker_overhead_us = sampler.worker_overhead_us
    fill_result(result, snapshot, opts)
    result.check_accounting()
    return result


def settings_of(opts: RunOptions) -> dict[str, Any]:
    """The options echoed in the report (JSON-serialisable)."""
    w = opts.workload
    return {
        "workload": w.kind.value,
        "seed": w.seed,
        "num_clients": w.num_clients,
        "num_sessions": w.num_sessions,
        "turns": w.turns_per_session,
        "turn_tokens": w.turn_tokens,
        "output_tokens": w.output_tokens,
        "system_prompt_tokens": w.system_prompt_tokens,
        "document_tokens": w.document_tokens,
        "num_documents": w.num_documents,
        "think_time_s": w.think_time_s,
        "num_layers": opts.num_layers,
        "num_kv_heads": opts.num_kv_heads,
        "head_size": opts.head_size,
        "dtype": opts.dtype,
        "block_size": opts.block_size,
        "offload_block_size": opts.offload_block_size,
        "block_bytes": opts.gpu_block_bytes,
        "gpu_blocks": opts.gpu_blocks,
        "min_gpu_blocks": -(-max_request_tokens(w) // opts.block_size),
        "max_num_seqs": opts.max_num_seqs,
        "max_num_batched_tokens": opts.max_num_batched_tokens,
        "cpu_bytes": opts.cpu_bytes,
        "eviction_policy": opts.eviction_policy,
        "fs_root": None if opts.fs_root is None else str(opts.fs_root),
        "fs_max_bytes": opts.fs_max_bytes,
        "redis_url": None if opts.redis_url is None else redact_url(opts.redis_url),
        "engines": opts.engines,
        "device": opts.device,
        "timeout_s": opts.timeout_s,
        "async_scheduling": opts.async_scheduling,
        "model_stand_in": opts.model_stand_in,
        "sliding_window": opts.sliding_window if opts.model_stand_in == "hybrid" else None,
    }


def _write(stream: TextIO, lines: list[str]) -> None:
    # Flushed at once: the header must show before the run starts, and before stderr's progress.
    if lines:
        stream.write("\n".join(lines) + "\n")
        stream.flush()


async def _serve_both(
    opts: RunOptions, workload: Workload, out: TextIO, exporter: MetricsExporter | None = None
) -> Report:
    if opts.fleet:
        from vllm.entrypoints.cli.fleet import serve_fleet

        return await serve_fleet(
            opts, workload, settings_of(opts), lambda fs: _write(out, render_fs_start(fs))
        )
    baseline = await serve(opts, workload, offload=False, exporter=exporter)
    offload = await serve(
        opts,
        workload,
        offload=True,
        on_fs_start=lambda fs: _write(out, render_fs_start(fs)),
        exporter=exporter,
    )
    return Report(settings=settings_of(opts), baseline=baseline, offload=offload)


def clear_fs(opts: RunOptions) -> int:
    """``--fs-clear``: delete the fs tier's files under ``--fs-root`` and exit (no run)."""
    assert opts.fs_root is not None
    try:
        runs, removed = clear_fs_root(opts.fs_root)
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot clear {opts.fs_root}: {e}\n")
        return 1
    sys.stdout.write(
        f"{PROG}: removed {runs} run director{'y' if runs == 1 else 'ies'} "
        f"({format_bytes(removed)}) of the fs tier from {opts.fs_root}\n"
    )
    return 0


def run_command(opts: RunOptions) -> int:
    """Run the baseline and the offloaded run, print the report, write ``--json``/``--plot``.

    The report's header is printed before the baseline starts, the fs tier's state when the
    offloaded run's tier has scanned its root, the rest at the end. With ``--json -`` the JSON
    document goes to stdout and the human report to stderr.

    Returns:
        0 when the verdict passed, 1 when it failed or the run hit an error.

    Raises:
        Interrupted: a signal stopped the run (everything was shut down first).
    """
    if opts.fs_clear:
        return clear_fs(opts)
    json_to_stdout = opts.json_path is not None and str(opts.json_path) == STDOUT
    out = sys.stderr if json_to_stdout else sys.stdout
    workload = generate_workload(opts.workload)
    _write(out, render_header(settings_of(opts), workload.num_requests))
    exporter: MetricsExporter | None = None
    try:
        if opts.metrics_port is not None:
            exporter = MetricsExporter(opts.metrics_port)
        # SIGINT and SIGTERM (INTERRUPT_SIGNALS): a fleet's processes, shared regions and fs files
        # are cleaned up alike.
        report = run_interruptible(_serve_both(opts, workload, out, exporter))
    except (OSError, ValueError, RuntimeError) as e:
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 1
    finally:
        if exporter is not None:
            exporter.close()
    _write(out, list(render_body(report)))
    try:
        if opts.json_path is not None:
            doc = report.to_json()
            if exporter is not None:
                # The metrics' final values, per run (docs/metrics.md).
                doc["metrics"] = {r: exporter.final_values(r) for r in ("baseline", "offload")}
            text = json.dumps(doc, indent=2) + "\n"
            if json_to_stdout:
                sys.stdout.write(text)
                sys.stdout.flush()
            else:
                opts.json_path.write_text(text)
        if opts.plot_path is not None:
            from vllm.entrypoints.cli.plot import write_plot

            write_plot(opts.plot_path, report.offload, report.baseline)
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot write the report: {e}\n")
        return 1
    return 0 if report.verdict.passed else 1
