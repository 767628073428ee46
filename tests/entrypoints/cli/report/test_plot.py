# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the plot writer (``--plot``): a file in the format its suffix names."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.entrypoints.cli.report.figures import Direction, RunResult, StepSample, Tier
from vllm.entrypoints.cli.report.plot import (
    cumulative_bytes_lines,
    token_share_lines,
    write_plot,
)


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    run = RunResult(label="offload", offload=True)
    for i in range(5):
        run.samples.append(
            StepSample(
                t_s=0.1 * i,
                tokens={"computed": 10 * i, **{t.value: i for t in Tier}},
                bytes_moved={d.value: 1000 * i for d in Direction},
            )
        )
    out = tmp_path / "plot.png"
    write_plot(out, run, baseline=run)
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 1000


@pytest.mark.parametrize(
    ("suffix", "magic"), [(".svg", b"<svg"), (".pdf", b"%PDF"), (".jpg", b"\xff\xd8\xff")]
)
def test_plot_is_written_in_the_format_its_suffix_names(
    tmp_path: Path, suffix: str, magic: bytes
) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    run = RunResult(label="offload", offload=True)
    run.samples.append(
        StepSample(t_s=0.0, tokens={"computed": 1}, bytes_moved={d.value: 0 for d in Direction})
    )
    out = tmp_path / f"plot{suffix}"
    write_plot(out, run)
    assert magic in out.read_bytes()[:400]


def test_plot_lines_put_computed_beside_each_tier_and_add_up_the_bytes() -> None:
    off = RunResult(label="offload", offload=True)
    base = RunResult(label="baseline", offload=False)
    for run in (off, base):
        for i in range(1, 4):
            run.samples.append(
                StepSample(
                    t_s=0.1 * i,
                    tokens={"computed": 10 * i, Tier.GPU.value: 5 * i, Tier.CPU.value: 5 * i},
                    bytes_moved={Direction.CPU_TO_GPU.value: 2**20 * i},
                )
            )
    lines = token_share_lines(off)
    assert set(lines) == {
        "computed (offload)",
        "GPU prefix cache (offload)",
        "CPU tier (offload)",
    }  # no fs tier in this run, no redis tier
    assert lines["computed (offload)"][1] == [50.0, 50.0, 50.0]
    assert set(token_share_lines(base)) == {"computed (baseline)", "GPU prefix cache (baseline)"}
    # Cumulative: the last point is everything moved (1 + 2 + 3 MiB).
    (times, mib) = cumulative_bytes_lines(off)[Direction.CPU_TO_GPU.label]
    assert mib == [1.0, 3.0, 6.0] and times == pytest.approx([0.1, 0.2, 0.3])
