# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the progress display (tqdm bar or periodic lines) and its token shares."""

from __future__ import annotations

import io

from typing_extensions import override

from vllm.entrypoints.cli.progress import Progress, token_shares


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bar_on_a_terminal_fits_its_width_and_is_erased_at_the_end() -> None:
    stream = io.StringIO()
    with Progress(570, "offload", stream=stream, tty=True, ncols=80) as bar:
        for done in range(1, 571, 7):
            bar.update(done, {"computed": 0.14, "GPU": 0.47, "CPU": 0.22, "fs": 0.18})
    text = stream.getvalue()
    assert "offload" in text and "570" in text
    # Each redraw starts with a carriage return and is at most 80 columns: nothing wraps.
    redraws = [r for r in text.split("\r") if r]
    assert len(redraws) > 1
    assert all(len(r) <= 80 for r in redraws), max(redraws, key=len)
    assert "\n" not in text  # never a new line: one row, redrawn
    # leave=False: the last thing written blanks the row, returns to its start and erases the
    # rest of the line (where a ^C echo would be).
    assert text.endswith("\r\x1b[K") and redraws[-2].strip() == ""


def test_lines_off_a_terminal_come_every_interval_and_at_the_end() -> None:
    stream = io.StringIO()
    clock = _Clock()
    progress = Progress(10, "baseline", stream=stream, tty=False, line_interval_s=5.0, clock=clock)
    progress.update(1, {"computed": 1.0})
    clock.now += 4.9
    progress.update(2)
    progress.tick()
    assert stream.getvalue() == ""  # not yet 5 s
    clock.now += 0.1
    progress.tick()  # the timer, while no request finishes
    assert stream.getvalue() == "baseline: 2/10 requests, 5 s; computed 100%\n"
    clock.now += 1.0
    progress.update(9, {"computed": 0.5, "GPU": 0.5})
    assert stream.getvalue().count("\n") == 1
    progress.close()
    progress.close()  # idempotent
    progress.tick()  # and quiet once closed
    assert stream.getvalue().splitlines() == [
        "baseline: 2/10 requests, 5 s; computed 100%",
        "baseline: 9/10 requests, 6 s; computed 50% GPU 50%",
    ]
    # Plain lines only: nothing a log would show as garbage.
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()


def test_disabled_progress_writes_nothing() -> None:
    for tty in (True, False):
        stream = io.StringIO()
        with Progress(4, "x", stream=stream, enabled=False, tty=tty) as progress:
            progress.update(3, {"computed": 1.0})
            progress.tick()
        assert stream.getvalue() == ""


def test_the_mode_follows_the_stream() -> None:
    class Tty(io.StringIO):
        @override
        def isatty(self) -> bool:
            return True

    assert Progress(1, "x", stream=Tty(), ncols=40).tty is True
    assert Progress(1, "x", stream=io.StringIO()).tty is False


def test_token_shares_name_every_tier_and_redis_only_when_it_served() -> None:
    tokens = {"computed": 2, "gpu_prefix_cache": 1, "cpu_tier": 1, "fs_tier": 0}
    assert token_shares(tokens) == {"computed": 0.5, "GPU": 0.25, "CPU": 0.25, "fs": 0.0}
    assert token_shares({**tokens, "redis_tier": 4})["redis"] == 0.5
    assert token_shares({}) == {}
