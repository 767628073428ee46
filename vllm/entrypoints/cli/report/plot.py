# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report as a plot (``--plot FILE.png``): hit rate per tier and bytes moved per step.

The file's suffix names the format (``.png``, ``.svg``, ``.pdf``, ...: whatever matplotlib
writes); the command refuses other suffixes before it runs (``checks.plot_format_problem``).

matplotlib is an optional dependency (the ``plot`` extra); it is imported only here, with the
non-interactive Agg backend so that plotting works on a machine without a display.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def _cumulative_hit_rates(run: RunResult) -> dict[Tier, list[float]]:
    # Share of the prompt tokens placed so far that each tier served, step by step.
    rates: dict[Tier, list[float]] = {t: [] for t in Tier}
    for sample in run.samples:
        total = sample.tokens.get("computed", 0) + sum(sample.tokens.get(t.value, 0) for t in Tier)
        for t in Tier:
            rates[t].append(sample.tokens.get(t.value, 0) / total if total else 0.0)
    return rates


def write_plot(path: str | Path, offload: RunResult, baseline: RunResult | None = None) -> None:
    """Draw the offloaded run (and the baseline's GPU hit rate, dashed) into ``path``.

    Top panel: cumulative share of prompt tokens served by each tier. Bottom panel: bytes each
    direction moved per engine step (MiB). The x axis is seconds since the run started.

    Raises:
        PlotUnavailableError: matplotlib is missing.
        OSError: the file cannot be written.
    """
    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_bytes) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    try:
        times = [s.t_s for s in offload.samples]
        names = {
            Tier.GPU: "GPU prefix cache",
            Tier.CPU: "CPU tier",
            Tier.FS: "fs tier",
            Tier.REDIS: "redis tier",
        }
        for tier, series in _cumulative_hit_rates(offload).items():
            if tier is Tier.REDIS and offload.redis_url is None:
                continue
            ax_hit.plot(times, [100 * v for v in series], label=f"{names[tier]} (offload)")
        if baseline is not None and baseline.samples:
            base_rates = _cumulative_hit_rates(baseline)[Tier.GPU]
            ax_hit.plot(
                [s.t_s for s in baseline.samples],
                [100 * v for v in base_rates],
                linestyle="--",
                color="gray",
                label="GPU prefix cache (baseline)",
            )
        ax_hit.set_ylabel("prompt tokens served (%)")
        ax_hit.set_title("Hit rate per tier: share of prompt tokens served so far")
        ax_hit.legend(loc="best", fontsize="small")
        ax_hit.grid(alpha=0.3)

        redis = (Direction.CPU_TO_REDIS, Direction.REDIS_TO_CPU)
        for d in Direction:
            if d in redis and offload.redis_url is None:
                continue
            ax_bytes.plot(
                times,
                [s.bytes_moved.get(d.value, 0) / 2**20 for s in offload.samples],
                label=d.label,
                linewidth=0.8,
            )
        ax_bytes.set_xlabel("time since start of the offloaded run (s)")
        ax_bytes.set_ylabel("MiB moved in the step")
        ax_bytes.set_title("Bytes moved per engine step")
        ax_bytes.legend(loc="best", fontsize="small")
        ax_bytes.grid(alpha=0.3)
        fig.tight_layout()
        # No format=: matplotlib takes it from the suffix, which the command checked.
        fig.savefig(str(path), dpi=100)
    finally:
        plt.close(fig)
