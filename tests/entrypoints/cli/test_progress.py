"""Tests of the plain-text progress bar and the plot writer."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from typing_extensions import override

from vllm.entrypoints.cli.plot import write_plot
from vllm.entrypoints.cli.progress import ProgressBar
from vllm.entrypoints.cli.report import Direction, RunResult, StepSample, Tier


class _Tty(io.StringIO):
    @override
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_on_a_tty_only() -> None:
    tty = _Tty()
    with ProgressBar(4, "offload", stream=tty, width=8, min_interval_s=0.0) as bar:
        bar.update(1)
        bar.update(2, extra="hit 50%")
    text = tty.getvalue()
    assert "\r[offload] [####....] 2/4 requests" in text
    assert text.endswith("hit 50%\n")
    pipe = io.StringIO()
    with ProgressBar(4, "offload", stream=pipe) as bar:
        bar.update(4)
    assert pipe.getvalue() == ""
    forced_off = _Tty()
    with ProgressBar(4, "x", stream=forced_off, enabled=False) as bar:
        bar.update(3)
    assert forced_off.getvalue() == ""


def test_progress_bar_throttles_redraws() -> None:
    tty = _Tty()
    bar = ProgressBar(100, "b", stream=tty, min_interval_s=3600)
    for i in range(50):
        bar.update(i)
    assert tty.getvalue().count("\r") == 1
    bar.close()
    assert "49/100" in tty.getvalue()


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
