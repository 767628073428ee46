# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report as a plot (``--plot FILE.png``): where prompt tokens came from, both runs on one
time axis, and the offload run's transfers (cumulative).

The file's suffix names the format (``.png``, ``.svg``, ``.pdf``, ...: whatever matplotlib
writes); the command refuses other suffixes before it runs (``checks.plot_format_problem``).

matplotlib is an optional dependency (the ``plot`` extra); it is imported only here, with the
non-interactive Agg backend so that plotting works on a machine without a display.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vllm.entrypoints.cli.report.figures import Direction, RunResult, Tier

INSTALL_HINT = "pip install 'vllm-kv-offload[plot]'"


class PlotUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def check_plot_available() -> None:
    """Raise ``PlotUnavailableError`` (with the install command) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailableError(
            f"--plot needs matplotlib, which is not installed: {INSTALL_HINT}"
        )


_SOURCES = {
    "computed": "computed",
    Tier.GPU.value: "GPU prefix cache",
    Tier.CPU.value: "CPU tier",
    Tier.FS.value: "fs tier",
    Tier.REDIS.value: "redis tier",
}


def token_share_lines(run: RunResult) -> dict[str, tuple[list[float], list[float]]]:
    """Per source of prompt tokens (``"computed"`` and each tier the run had), its share (%) of
    the prompt tokens placed so far, step by step: ``{label: (times, shares)}``."""
    times = [s.t_s for s in run.samples]
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for source, name in _SOURCES.items():
        if not run.offload and source not in ("computed", Tier.GPU.value):
            continue
        if source == Tier.REDIS.value and run.redis_url is None:
            continue
        if source == Tier.FS.value and run.offload and run.fs is None:
            continue
        shares = []
        for sample in run.samples:
            total = sum(sample.tokens.values())
            shares.append(100 * sample.tokens.get(source, 0) / total if total else 0.0)
        lines[f"{name} ({run.label})"] = (times, shares)
    return lines


def cumulative_bytes_lines(run: RunResult) -> dict[str, tuple[list[float], list[float]]]:
    """Per direction the run moved bytes in, the MiB moved so far: ``{label: (times, MiB)}``."""
    times = [s.t_s for s in run.samples]
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for d in Direction:
        total, series = 0, []
        for sample in run.samples:
            total += sample.bytes_moved.get(d.value, 0)
            series.append(total / 2**20)
        if total:
            lines[d.label] = (times, series)
    return lines


def _title(settings: Mapping[str, Any] | None, offload: RunResult) -> str:
    if not settings:
        return "vllm-kv-offload run"
    model = (
        f"transformer {settings.get('model_preset')}"
        if settings.get("model") == "transformer"
        else "hash stand-in"
    )
    tiers = ["CPU " + _mib(settings.get("cpu_bytes"))]
    if offload.fs is not None:
        tiers.append("fs")
    if offload.redis_url is not None:
        tiers.append("redis")
    return (
        f"vllm-kv-offload run: {settings.get('workload')} (seed {settings.get('seed')}), "
        f"{settings.get('num_clients')} client(s), {model}, --verify {settings.get('verify')}\n"
        f"GPU pool {settings.get('gpu_blocks')} blocks of {settings.get('block_size')} tokens; "
        f"tiers: {', '.join(tiers)}; device {settings.get('device')}"
    )


def _mib(n: Any) -> str:
    if not isinstance(n, int):
        return "?"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def write_plot(
    path: str | Path,
    offload: RunResult,
    baseline: RunResult | None = None,
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Draw both runs into ``path``, on one time axis (seconds since each run started), each
    run's end marked.

    Top panel: the share of the prompt tokens placed so far that each source served, the
    ``computed`` curve beside each tier's (offloaded run solid, baseline dashed). Bottom panel:
    the MiB each direction moved so far in the offloaded run (cumulative: its slope is the
    transfer rate). The title names the settings (``settings``: ``Report.settings``).

    Raises:
        PlotUnavailableError: matplotlib is missing.
        OSError: the file cannot be written.
    """
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_share, ax_bytes) = plt.subplots(2, 1, figsize=(10, 8), sharex=True)
    try:
        runs = [r for r in (offload, baseline) if r is not None and r.samples]
        colors: dict[str, str] = {}
        for run in runs:
            dashed = run is not offload
            for label, (times, shares) in token_share_lines(run).items():
                source = label.rsplit(" (", 1)[0]
                (line,) = ax_share.plot(
                    times,
                    shares,
                    label=label,
                    linestyle="--" if dashed else "-",
                    color=colors.get(source),
                    linewidth=1.2,
                )
                colors.setdefault(source, line.get_color())
        for ax in (ax_share, ax_bytes):
            for run in runs:
                end = run.wall_s or run.samples[-1].t_s
                ax.axvline(
                    end,
                    color="black",
                    linestyle="--" if run is not offload else "-",
                    linewidth=0.8,
                    alpha=0.6,
                )
        for run in runs:
            end = run.wall_s or run.samples[-1].t_s
            ax_share.annotate(
                f"{run.label} ends ({end:.1f} s)",
                xy=(end, 100),
                xytext=(-4, -4),
                textcoords="offset points",
                ha="right",
                va="top",
                fontsize="small",
                rotation=90,
            )
        ax_share.set_ylabel("share of prompt tokens so far (%)")
        ax_share.set_ylim(0, 100)
        ax_share.set_title(
            "Where prompt tokens came from (solid: offload run, dashed: baseline)",
            fontsize="medium",
        )
        ax_share.legend(loc="center left", fontsize="small", bbox_to_anchor=(1.0, 0.5))
        ax_share.grid(alpha=0.3)

        for label, (times, mib) in cumulative_bytes_lines(offload).items():
            ax_bytes.plot(times, mib, label=label, linewidth=1.2)
        ax_bytes.set_xlabel("seconds since the run started (both runs)")
        ax_bytes.set_ylabel("MiB moved so far")
        ax_bytes.set_title(
            "Transfers of the offload run, cumulative (slope: transfer rate)", fontsize="medium"
        )
        if cumulative_bytes_lines(offload):
            ax_bytes.legend(loc="center left", fontsize="small", bbox_to_anchor=(1.0, 0.5))
        ax_bytes.grid(alpha=0.3)
        fig.suptitle(_title(settings, offload), fontsize="medium")
        fig.tight_layout()
        # No format=: matplotlib takes it from the suffix, which the command checked.
        fig.savefig(str(path), dpi=100)
    finally:
        plt.close(fig)
