# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report as text: every line at most ``WIDTH`` (80) columns.

Owns the human-readable rendering of a ``Report`` (the figures of ``figures.py``, the verdict and
reasons of ``verdict.py``). It comes in three parts so that the command can print each as soon
as it is known: the header (what runs, before the baseline starts; from the settings alone), the
fs tier's state at start (once the offloaded run's tier has scanned its root) and the body (the
figures, at the end). ``render_report`` joins them. Tables have fixed columns that fit 80 columns
with the largest figures a run can produce (counts up to 999,999,999 blocks and 10 digits of
tokens, sizes up to 1023.0 TiB); prose is wrapped with ``textwrap``. Only a path longer than a
line is printed whole (on its own line), so that it can still be copied.

A new line: a ``yield`` in the part it belongs to (``render_header`` for what runs, one of the
body's sections for figures), through ``_row`` for a baseline/offload pair or ``_wrap`` for
prose; ``tests/entrypoints/cli/report/test_text.py`` checks the width with the largest figures.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from vllm.entrypoints.cli.option_values import default_fs_root
from vllm.entrypoints.cli.report.figures import (
    TTFT_PARTS,
    Direction,
    Distribution,
    FsTierState,
    Report,
    RunResult,
    Tier,
    ratio,
)
from vllm.entrypoints.cli.report.json_doc import load_guard_json
from vllm.entrypoints.cli.report.verdict import (
    compare_outputs,
    judge,
    judge_report,
    no_benefit_reason,
    no_savings_reason,
)
from vllm.entrypoints.cli.thread_cpu import COMPONENTS, FRONT_END, NATIVE

WIDTH = 80
"""Widest line of the report (a classic terminal)."""

PROG = "vllm-kv-offload"

_LABEL = 32
_CELL = 22
_TIER_LABELS = {
    Tier.GPU: "GPU prefix cache",
    Tier.CPU: "CPU tier",
    Tier.FS: "fs tier",
    Tier.REDIS: "redis tier",
}
_REDIS_DIRECTIONS = (Direction.CPU_TO_REDIS, Direction.REDIS_TO_CPU)


def format_bytes(n: float) -> str:
    """``n`` bytes with a binary unit, e.g. ``"1.5 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def show_path(path: str, home: str | None = None) -> str:
    """``path`` with the user's home directory written ``~`` (shorter, and what users type)."""
    home = (os.path.expanduser("~") if home is None else home).rstrip("/")
    if home and (path == home or path.startswith(home + "/")):
        return "~" + path[len(home) :]
    return path


def _count(value: Any) -> str:
    # Settings of a report read back from elsewhere may lack a figure: shown as "None".
    return f"{value:,}" if isinstance(value, int) else str(value)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _row(label: str, *cells: str) -> str:
    return f"  {label:<{_LABEL}}" + "".join(f"{c:>{_CELL}}" for c in cells)


def _wrap(text: str, indent: int = 2, hanging: int = 2) -> Iterator[str]:
    # Prose: wrapped at WIDTH, continuation lines indented a little more than the first.
    yield from textwrap.wrap(
        text,
        WIDTH,
        initial_indent=" " * indent,
        subsequent_indent=" " * (indent + hanging),
        break_long_words=False,
        break_on_hyphens=False,
    )


def _tokens_cell(run: RunResult, n: int, enabled: bool = True) -> str:
    if not enabled:
        return "-"
    share = n / run.prompt_tokens if run.prompt_tokens else 0.0
    return f"{n:,} ({_pct(share)})"


def _model_line(s: Mapping[str, Any]) -> str:
    """The header's model: ``model: transformer <preset> (<layers> layers, d_model <d>,
    <heads>/<kv_heads> heads, <params> parameters, <bytes> KV bytes per token)``."""
    groups = 2 if s.get("model_stand_in") == "hybrid" else 1
    layers = int(s.get("num_layers", 0)) * groups
    kv_heads, head_size = s.get("num_kv_heads"), s.get("head_size")
    dtype = s.get("dtype")
    kv_bytes = int(s.get("block_bytes", 0)) // max(int(s.get("block_size", 1)), 1)
    if s.get("model") == "transformer":
        return (
            f"model: transformer {s.get('model_preset')} ({layers} layers, d_model "
            f"{s.get('model_d_model')}, {s.get('model_heads')}/{kv_heads} heads, "
            f"{_count(s.get('model_params'))} parameters, {_count(kv_bytes)} KV bytes per token)"
        )
    return (
        f"model: hash stand-in ({layers} layers x {kv_heads} KV heads x {head_size} head size, "
        f"{dtype}, {_count(kv_bytes)} KV bytes per token)"
    )


def _engine_line(s: Mapping[str, Any]) -> str:
    """The header's KV-cache groups, scheduling mode and checks."""
    if s.get("model_stand_in") == "hybrid":
        groups = (
            f"hybrid (a full-attention group and a sliding-window group of "
            f"{s.get('sliding_window')} tokens)"
        )
    else:
        groups = "standard (one full-attention group)"
    scheduling = "async (one step in flight)" if s.get("async_scheduling") else "synchronous"
    return f"KV-cache groups: {groups}; scheduling: {scheduling}; --verify {s.get('verify')}"


def _machine_line(load_average: float | None) -> str:
    cpus = os.cpu_count()
    load = "unknown" if load_average is None else f"{load_average:.2f}"
    return f"machine: {cpus} CPUs, load average {load} at start (1 minute)"


def render_header(
    settings: Mapping[str, Any],
    num_requests: int,
    home: str | None = None,
    load_average: float | None = None,
) -> list[str]:
    """What runs: the workload, the model, its groups and scheduling, the pools, where the fs
    tier lives, and how busy the machine was before the baseline (``load_average``)."""
    s = settings
    lines = [f"{PROG} run"]
    lines += _wrap(
        f"workload {s.get('workload')} (seed {s.get('seed')}): {num_requests:,} requests from "
        f"{s.get('num_clients')} concurrent client{'' if s.get('num_clients') == 1 else 's'}; "
        f"device {s.get('device')}"
    )
    lines += _wrap(_model_line(s))
    lines += _wrap(_engine_line(s))
    lines += _wrap(_machine_line(load_average))
    lines.append(
        f"  GPU pool: {_count(s.get('gpu_blocks'))} blocks of {s.get('block_size')} tokens "
        f"({format_bytes(s.get('block_bytes', 0))} each)"
    )
    lines.append(
        f"  CPU tier: {format_bytes(s.get('cpu_bytes', 0))} in /dev/shm "
        f"({s.get('eviction_policy')})"
    )
    root = s.get("fs_root")
    if root is None:
        lines.append("  fs tier:  none")
    else:
        max_bytes = s.get("fs_max_bytes")
        bound = f"up to {format_bytes(max_bytes)}" if max_bytes is not None else "unbounded"
        engines = s.get("engines", 1)
        if isinstance(engines, int) and engines > 1:
            # Each instance has its own directory, and the bound is each one's.
            bound, root = f"{bound} each", os.path.join(root, "engine-<i>")
        line = f"  fs tier:  {bound} in {show_path(root, home)}"
        if len(line) > WIDTH:  # a long path goes whole on its own line
            lines += [f"  fs tier:  {bound} in", f"    {show_path(root, home)}"]
        else:
            lines.append(line)
    url = s.get("redis_url")
    if url is not None:
        cluster = " (cluster)" if s.get("redis_cluster") else ""
        key_id = s.get("integrity_key_id")
        trust = (
            f"blocks authenticated (HMAC-SHA256, key id {key_id})"
            if key_id
            else "blocks not authenticated (CRC only)"
        )
        lines += _wrap(
            f"redis tier: {url}{cluster}, shared by every engine instance; {trust}", hanging=4
        )
    engines = s.get("engines", 1)
    if isinstance(engines, int) and engines > 1:
        how = {
            "kv-aware": "by where the instances' KV events say the prefix is (kv-aware)",
            "session": "by session (a session stays on one instance)",
            "round-robin": "round-robin per request (a session moves between instances)",
        }.get(str(s.get("routing")), str(s.get("routing")))
        lines += _wrap(
            f"fleet: {engines} engine instances, one process each, each with its own GPU "
            f"pool, CPU tier and fs directory; requests routed {how}",
            hanging=4,
        )
        if url is None:
            # Not refused (with KV-aware routing such a fleet is useful), but said.
            lines.append("  shared tier: none (no --redis-url): instances reuse only their own KV")
    return lines


def render_fs_start(fs: FsTierState | None) -> list[str]:
    """Whether the offloaded run's fs tier started warm (empty without an fs tier)."""
    if fs is None:
        return []
    if fs.warm:
        return list(
            _wrap(
                f"fs tier started WARM: {fs.files_at_start:,} blocks "
                f"({format_bytes(fs.bytes_at_start)}) on disk from earlier runs"
            )
        )
    return ["  fs tier started cold (no blocks of this geometry on disk)"]


def render_report(report: Report, home: str | None = None) -> Iterator[str]:
    """The whole report: header, the fs tier's state at start, and the body."""
    start = report.load_average[0] if report.load_average else None
    yield from render_header(report.settings, report.baseline.num_requests, home, start)
    yield from render_fs_start(report.offload.fs)
    yield from render_body(report, home)


def render_body(report: Report, home: str | None = None) -> Iterator[str]:
    """What offloading bought (TTFT, throughput, prefill saved; why not, when it did not),
    the figures of both runs, the transfers, what is on disk, and the verdict."""
    yield ""
    yield from _headline(report)
    yield ""
    yield from _side_by_side(report)
    yield ""
    yield from _ttft_parts(report)
    yield ""
    yield from _cpu(report)
    yield ""
    engine_time = _engine_time(report)
    if engine_time:
        yield from engine_time
        yield ""
    yield from _transfers(report.offload)
    yield from _disk(report, home)
    yield from _instances(report)
    yield ""
    yield from _verdict(report)


# label, baseline, offload, ratio: 2 + 30 + 16 + 16 + 16 = 80 columns.
_HEAD_COLUMNS = (30, 16, 16, 16)


def _head_row(*cells: str) -> str:
    label, *rest = cells
    return f"  {label:<{_HEAD_COLUMNS[0]}}" + "".join(
        f"{c:>{w}}" for c, w in zip(rest, _HEAD_COLUMNS[1:], strict=True)
    )


def _times(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _headline(report: Report) -> Iterable[str]:
    """TTFT and throughput of both runs with their ratio, then the prefill tokens saved and,
    when offloading did not help, why."""
    b, o = report.baseline, report.offload
    bt, ot = Distribution.of(b.ttft_ms), Distribution.of(o.ttft_ms)
    yield _head_row("", "baseline", "offload", "offload/base")
    # label, the baseline's figure, the offload run's, and how to show one.
    figures: list[tuple[str, float, float, str]] = [
        ("TTFT median", bt.median, ot.median, "{:.1f} ms"),
        ("TTFT p99", bt.p99, ot.p99, "{:.1f} ms"),
        ("throughput, requests/s", b.requests_per_s, o.requests_per_s, "{:.2f}"),
        ("  prompt tokens/s", b.prompt_tokens_per_s, o.prompt_tokens_per_s, "{:,.0f}"),
        ("wall time (timed window)", b.wall_s, o.wall_s, "{:.1f} s"),
    ]
    for label, base, off, shown in figures:
        yield _head_row(label, shown.format(base), shown.format(off), _times(ratio(off, base)))
    saved = report.prefill_tokens_saved
    frac = saved / b.computed_tokens if b.computed_tokens else 0.0
    yield f"  prefill tokens saved vs baseline: {saved:,} ({_pct(frac)} of the baseline's)"
    reason = no_savings_reason(report)
    if reason is not None:
        yield from _wrap(f"why: {reason}", indent=4)
    no_benefit = no_benefit_reason(report)
    if no_benefit is not None:
        yield from _wrap(f"offloading did not help: {no_benefit}", indent=2, hanging=4)


def _side_by_side(report: Report) -> Iterable[str]:
    b, o = report.baseline, report.offload
    yield _row("", "baseline (no offload)", "offload")
    yield _row(
        "requests finished",
        f"{b.num_finished}/{b.num_requests}",
        f"{o.num_finished}/{o.num_requests}",
    )
    yield _row("prompt tokens", f"{b.prompt_tokens:,}", f"{o.prompt_tokens:,}")
    yield _row("  computed", _tokens_cell(b, b.computed_tokens), _tokens_cell(o, o.computed_tokens))
    tiers = [t for t in Tier if t is not Tier.REDIS or o.redis_url is not None]
    for tier in tiers:
        yield _row(
            f"  served from {_TIER_LABELS[tier]}",
            _tokens_cell(b, b.served[tier], b.offload or tier is Tier.GPU),
            _tokens_cell(
                o, o.served[tier], o.offload and (tier is not Tier.FS or o.fs is not None)
            ),
        )
        if tier is Tier.REDIS and o.cross_instance_tokens is not None:
            # A part of the redis tier's tokens: the fleet's point (see the note below).
            yield _row(
                "    computed by another instance", "-", _tokens_cell(o, o.cross_instance_tokens)
            )
    for tier in tiers:
        yield _row(
            f"hit rate, {_TIER_LABELS[tier]}",
            _pct(b.hit_rate(tier)) if (b.offload or tier is Tier.GPU) else "-",
            _pct(o.hit_rate(tier)) if (tier is not Tier.FS or o.fs is not None) else "-",
        )
    yield "    (hit rate: served / reached the tier, i.e. missed the faster tiers)"
    if o.cross_instance_tokens is not None and o.redis_url is not None:
        yield from _wrap(
            "(computed by another instance: served from KV another instance of the fleet "
            "computed and stored in the redis tier during this run: cross-instance reuse)",
            indent=4,
            hanging=1,
        )
    yield _row("output tokens", f"{b.output_tokens:,}", f"{o.output_tokens:,}")
    yield _row("engine steps", f"{b.steps:,}", f"{o.steps:,}")
    yield _row("preemptions", f"{b.preemptions:,}", f"{o.preemptions:,}")
    yield ""
    yield _row("per-step cost, offload run", "wall", "thread CPU")
    for label, wall, cpu in (
        ("connector + manager", o.overhead_us, o.connector_thread_cpu_us),
        ("worker-side connector", o.worker_overhead_us, o.worker_connector_thread_cpu_us),
    ):
        wd, cd = Distribution.of(wall), Distribution.of(cpu)
        yield _row(
            f"  {label}", f"{wd.median:.0f} / {wd.p99:.0f} us", f"{cd.median:.0f} / {cd.p99:.0f} us"
        )
    yield from _wrap(
        "(median / p99 over the steps that scheduled tokens; wall minus thread CPU is time off "
        "the CPU: waiting for the GIL or descheduled)",
        indent=4,
        hanging=1,
    )


_PART_LABELS = {
    "slot": "waiting for a slot",
    "lookup": "waiting on the tiers",
    "loading": "loading into the GPU",
    "prefill": "prefill, to the first token",
}


def _ttft_parts(report: Report) -> Iterable[str]:
    """TTFT split into its parts (means, so that they add up), both runs."""
    b, o = report.baseline, report.offload
    yield _row("TTFT in parts (mean)", "baseline", "offload")
    for name in TTFT_PARTS:
        yield _row(
            f"  {_PART_LABELS[name]}",
            f"{_mean(b.ttft_parts_ms.get(name, [])):.1f} ms",
            f"{_mean(o.ttft_parts_ms.get(name, [])):.1f} ms",
        )
    yield _row("  sum of the parts", f"{_parts_sum(b):.1f} ms", f"{_parts_sum(o):.1f} ms")
    yield _row("requests a lookup deferred", "-", f"{o.lookup_deferred_requests:,}")
    yield _row("requests waiting on a transfer", "-", f"{o.transfer_wait_requests:,}")
    yield _row(
        "TTFT mean at the clients", f"{_mean(b.ttft_ms):.1f} ms", f"{_mean(o.ttft_ms):.1f} ms"
    )
    yield from _wrap(
        "(parts measured by the engine from a request's arrival there; waiting on the tiers: "
        "a lookup, or a promotion into the CPU tier, still running; a deferred request waited "
        "one step or more for a lookup, a waiting one for its blocks to move; loading: the "
        "CPU -> GPU copy; the clients' TTFT adds the front end's hand-offs)",
        indent=4,
        hanging=1,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _parts_sum(run: RunResult) -> float:
    return sum(_mean(run.ttft_parts_ms.get(name, [])) for name in TTFT_PARTS)


_COMPONENT_ORDER = {
    name: i for i, name in enumerate([c for c, _ in COMPONENTS] + [FRONT_END, NATIVE])
}


def _cpu(report: Report) -> Iterable[str]:
    """CPU seconds per component over the timed windows, and the checks after them."""
    b, o = report.baseline, report.offload
    yield _row("CPU seconds (timed window)", "baseline", "offload")
    # The engine thread first (always), then the others as often as either run has them.
    seen = {*b.cpu_s_by_component, *o.cpu_s_by_component} - {"engine thread"}
    components = ["engine thread", *sorted(seen, key=lambda c: _COMPONENT_ORDER.get(c, 99))]
    for component in components:
        cells = [
            f"{r.engine_thread_cpu_s:.2f} s"
            if component == "engine thread"
            else f"{r.cpu_s_by_component[component]:.2f} s"
            if component in r.cpu_s_by_component
            else "-"
            for r in (b, o)
        ]
        yield _row(f"  {component}", *cells)
    yield _row(
        "  checks (after the window)",
        f"{b.verify_cpu_s:.2f} s" if b.verify_mode != "none" else "-",
        f"{o.verify_cpu_s:.2f} s" if o.verify_mode != "none" else "-",
    )
    if report.load_average is not None:
        start, end = report.load_average
        yield from _wrap(
            f"(load average {start:.2f} at start, {end:.2f} at end, on {os.cpu_count()} CPUs: "
            "above the CPU count, other processes competed for the cores and the wall times "
            "above include their share)"
            if max(start, end) > (os.cpu_count() or 1)
            else f"(load average {start:.2f} at start, {end:.2f} at end, on {os.cpu_count()} CPUs)",
            indent=4,
            hanging=1,
        )


def _engine_time(report: Report) -> list[str]:
    """Where the engine thread's timed window went: on a core, idle between steps, waiting for
    a core, asleep inside its steps (empty unless the kernel gave both runs' waits for a
    core)."""
    runs = (report.baseline, report.offload)
    waits = [r.engine_thread_runqueue_wait_s for r in runs]
    blocked = [r.engine_thread_blocked_s for r in runs]
    if None in waits or None in blocked:
        return []
    return [
        _row("engine thread (timed window)", "baseline", "offload"),
        _row("  on a core (its CPU time)", *(f"{r.engine_thread_cpu_s:.2f} s" for r in runs)),
        _row("  idle between steps", *(f"{r.engine_thread_idle_s:.2f} s" for r in runs)),
        _row("  waiting for a core", *(f"{w:.2f} s" for w in waits)),
        _row("  blocked in its steps", *(f"{b:.2f} s" for b in blocked)),
        *_wrap(
            "(idle: no request to run, or a request waiting on a tier; waiting for a core: "
            "ready to run while other threads or processes had the CPUs; blocked: asleep "
            "inside a step, on the GIL while another thread held it, a lock or I/O)",
            indent=4,
            hanging=1,
        ),
    ]


# label, blocks, bytes, busy, throughput, average: 2 + 20 + 12 + 11 + 9 + 13 + 13 = 80 columns,
# for up to 999,999,999 blocks, "1023.0 TiB", "99999 s" and "1023.0 TiB/s".
_TRANSFER_COLUMNS = (20, 12, 11, 9, 13, 13)


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s < 100 else f"{s:.0f} s"


def _transfer_row(*cells: str) -> str:
    label, *rest = cells
    return f"  {label:<{_TRANSFER_COLUMNS[0]}}" + "".join(
        f"{c:>{w}}" for c, w in zip(rest, _TRANSFER_COLUMNS[1:], strict=True)
    )


def _transfers(o: RunResult) -> Iterable[str]:
    yield "  transfers in the offload run"
    yield _transfer_row("", "blocks", "bytes", "busy", "throughput", "average")
    notes: list[str] = []
    for d in Direction:
        if d in _REDIS_DIRECTIONS and o.redis_url is None:
            continue
        t = o.transfers[d]
        tp = t.throughput()
        avg = t.bytes / o.wall_s if o.wall_s > 0 else 0.0
        yield _transfer_row(
            d.label,
            f"{t.blocks:,}",
            format_bytes(t.bytes),
            "-" if t.busy_s is None else _seconds(t.busy_s),
            "-" if tp is None else format_bytes(tp) + "/s",
            format_bytes(avg) + "/s",
        )
        extra = [f"{t.failed_blocks:,} failed"] if t.failed_blocks else []
        if t.skipped_blocks:
            extra.append(f"{t.skipped_blocks:,} already there")
        if t.served_bytes is not None and t.bytes:
            # What was read from the tier against what loads used of it (issue 26's target).
            extra.append(
                f"{format_bytes(t.served_bytes)} of it read by loads, "
                f"{t.bytes / t.served_bytes:.2f}x promoted per byte used"
                if t.served_bytes
                else "none of it read by loads"
            )
        if extra:
            notes.append(f"{d.label}: {', '.join(extra)}")
    yield "    (throughput: while transferring; average: over the run's wall time)"
    for note in notes:
        yield from _wrap(f"({note})", indent=4, hanging=1)
    yield from _load_guard(o)


def _load_guard(o: RunResult) -> Iterable[str]:
    """The load guard's decisions per tier and the estimates behind them (docs/load_guard.md)."""
    g = load_guard_json(o)
    if g is None:
        return
    per_token = g["compute_s_per_token"]
    compute = "not measured" if per_token is None else f"{per_token * 1e6:,.1f} us/token"
    step = g["step_overhead_s"] or 0.0
    yield from _wrap(
        f"load guard: prefill {compute}, a step's fixed cost {step * 1e3:,.2f} ms", indent=2
    )
    for tier, t in g["tiers"].items():
        estimate = (
            f"load {t['load_latency_s'] * 1e3:,.2f} ms + {t['load_s_per_block'] * 1e3:,.3f} "
            "ms/block beyond its step"
            if "load_s_per_block" in t
            else "load not measured"
        )
        yield from _wrap(
            f"{tier.replace('_', ' ')}: {t['guard_skipped_hits']:,} of "
            f"{t['guard_decisions']:,} hits computed instead of loaded "
            f"({t['guard_skipped_tokens']:,} tokens), {t['guard_probes']:,} probes; {estimate}",
            indent=4,
        )


def _disk(report: Report, home: str | None) -> Iterable[str]:
    fs = report.offload.fs
    if fs is None:
        return
    root = show_path(fs.root_dir, home)
    bound = f"up to {format_bytes(fs.max_bytes)}" if fs.max_bytes is not None else "unbounded"
    flag = "" if fs.root_dir == str(default_fs_root()) else f" --fs-root {root}"
    yield ""
    yield from _wrap(
        f"on disk: {format_bytes(fs.bytes_at_end)} in {fs.files_at_end:,} block files "
        f"({bound}) in {root}; the next run starts warm from them. To delete them: "
        f"{PROG} run{flag} --fs-clear",
    )


# engine, requests, prompt tokens, computed, redis tier, another's, verdict (UNVERIFIED is the
# longest, 10 characters): 2 + 6 + 12 + 14 + 12 + 12 + 11 + 11 = 80 columns.
_INSTANCE_COLUMNS = (6, 12, 14, 12, 12, 11, 11)


def _instance_row(*cells: str) -> str:
    return "  " + "".join(f"{c:>{w}}" for c, w in zip(cells, _INSTANCE_COLUMNS, strict=True))


def _instances(report: Report) -> Iterable[str]:
    if not report.instances:
        return
    yield ""
    yield "  per engine instance (offload run; verdict: its own checks and outputs)"
    yield _instance_row(
        "engine", "requests", "prompt tokens", "computed", "redis tier", "another's", "verdict"
    )
    for inst in report.instances:
        o = inst.offload
        yield _instance_row(
            str(inst.index),
            f"{o.num_finished:,}/{o.num_requests:,}",
            f"{o.prompt_tokens:,}",
            f"{o.computed_tokens:,}",
            f"{o.served[Tier.REDIS]:,}" if o.redis_url is not None else "-",
            f"{o.cross_instance_tokens or 0:,}" if o.redis_url is not None else "-",
            judge(inst.baseline, inst.offload).status,
        )
    yield "    (another's: tokens served from KV another instance computed)"
    yield from _routing(report)
    yield from _routing_comparison(report)


def _routing(report: Report) -> Iterable[str]:
    r = report.routing
    if r is None:
        return
    counts = ", ".join(f"{n:,}" for n in r.requests)
    mean = sum(r.requests) / len(r.requests) if r.requests else 0.0
    spread = f"; busiest {max(r.requests) / mean:.2f}x the mean" if mean else ""
    yield f"  routing: {r.policy}; requests per instance: {counts}{spread}"
    if r.events is not None:
        lost = int(sum(r.events["lost"]))
        replayed = int(sum(r.events["replayed"]))
        lag = max(r.events["max_lag_ms"], default=0.0)
        yield (
            f"    KV events: {int(sum(r.events['batches'])):,} batches applied, {replayed:,} by "
            f"replay, {lost:,} lost; max lag {lag:.1f} ms"
        )


def _routing_comparison(report: Report) -> Iterable[str]:
    runs = report.policy_runs
    if not runs:
        return
    yield ""
    yield "  routing policies compared (offloaded run, each on fresh tiers)"
    yield _row3("", *(p.routing.policy for p in runs))
    results = [p.result for p in runs]
    yield _row3("prefill tokens computed", *(f"{r.computed_tokens:,}" for r in results))
    yield "  prompt tokens served"
    tiers = [t for t in Tier if t is not Tier.REDIS or results[0].redis_url is not None]
    for tier in tiers:
        yield _row3(f"  from {_TIER_LABELS[tier]}", *(f"{r.served[tier]:,}" for r in results))
    if results[0].redis_url is not None:
        yield _row3(
            "    computed by another",
            *(f"{r.cross_instance_tokens or 0:,}" for r in results),
        )
        yield _row3(
            "bytes from redis",
            *(format_bytes(r.transfers[Direction.REDIS_TO_CPU].bytes) for r in results),
        )
    ttfts = [Distribution.of(r.ttft_ms) for r in results]
    yield _row3("TTFT median", *(f"{d.median:.1f} ms" for d in ttfts))
    yield _row3("TTFT p99", *(f"{d.p99:.1f} ms" for d in ttfts))
    yield _row3(
        "throughput",
        *(f"{r.num_finished / r.wall_s:.2f} req/s" if r.wall_s else "-" for r in results),
    )
    yield _row3(
        "requests per instance",
        *("/".join(str(n) for n in p.routing.requests) for p in runs),
    )


def _row3(label: str, *cells: str) -> str:
    # Three policies side by side within WIDTH: a narrower label and cells than _row's.
    return f"  {label:<26}" + "".join(f" {c:>16}" for c in cells)


def _verdict(report: Report) -> Iterable[str]:
    b, o = report.baseline, report.offload
    verdict = judge_report(report)
    differing = compare_outputs(b.outputs, o.outputs)
    correct = "PASS" if verdict.served_correctly else "FAIL"
    yield f"  correctness: {correct if verdict.verified else 'NOT VERIFIED'}"
    from_redis = (
        f" ({o.blocks_verified_from_redis:,} of them promoted from the redis tier)"
        if o.redis_url is not None
        else ""
    )
    if verdict.verified:
        extra = o.blocks_checked - o.blocks_verified
        others = f" and {extra:,} other blocks (--verify all)" if extra > 0 else ""
        yield from _wrap(
            f"{o.blocks_verified:,} loaded blocks{from_redis}{others} checked bit-exact against "
            f"the baseline's computation or a recomputation, after the timed window "
            f"({o.verify_s:.1f} s), {o.blocks_mismatched:,} differed",
            indent=4,
        )
    else:
        yield from _wrap("no KV block checked (--verify none)", indent=4)
    yield from _wrap(
        f"outputs of {len(o.outputs):,} requests identical to the baseline's"
        if not differing
        else f"outputs of {len(differing):,} requests differ from the baseline's",
        indent=4,
    )
    yield from _wrap(
        f"storage integrity: {'PASS' if verdict.storage_intact else 'FAIL'} - "
        f"{o.corrupt_blocks_detected:,} corrupt block(s) detected "
        + ("on disk or in redis" if o.redis_url is not None else "on disk")
        + (" (discarded and recomputed, never served)" if o.corrupt_blocks_detected else "")
    )
    if not verdict.tiers_working:
        yield "  secondary tiers: FAIL - a tier failed everything it was given (below)"
    for reason in verdict.reasons:
        yield from _wrap(f"- {reason}", indent=4)
    yield f"  verdict: {verdict.status}"
