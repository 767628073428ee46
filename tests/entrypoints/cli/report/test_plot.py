# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the plot writer (``--plot``): a file in the format its suffix names."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.entrypoints.cli.report.figures import Direction, RunResult, StepSample, Tier
from vllm.entrypoints.cli.report.plot import write_plot


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
