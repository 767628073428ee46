# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run`` as a user sees it: on an 80-column terminal, piped, and interrupted.

The command runs in a child process. On a terminal it runs under a pseudo-terminal of 80
columns (``pexpect``), and what it wrote is replayed into a terminal emulator of the same width
(``pyte``), so that the test sees what stays on the screen: a redraw wider than the terminal
would wrap and leave its first part behind, which is exactly what a user saw before tqdm.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect", reason="pexpect (test extra) is not installed")
pyte = pytest.importorskip("pyte", reason="pyte (test extra) is not installed")
from wcwidth import wcswidth  # noqa: E402  (pyte's dependency)

from tests.subprocesses import run_python  # noqa: E402

from .workload_args import command_env, workload_args  # noqa: E402

COLUMNS = 80
# A small workload (a few seconds per run on a 2-core CPU) that still uses both tiers.
SMALL = workload_args(clients=2, sessions=12, think_time=0.01, timeout=300)
# Long enough to be interrupted in the middle of the offloaded run.
LONG = [*SMALL, "--num-sessions", "150", "--think-time", "0.05"]


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    # A short directory: pytest's own tmp_path is longer than a terminal line by itself, and the
    # report prints the fs root's path whole (so that it can be copied).
    path = Path(tempfile.mkdtemp(prefix="kvo-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _env(tmp_path: Path) -> dict[str, str]:
    env = command_env(tmp_path)
    for name in ("COLUMNS", "LINES"):
        env.pop(name, None)
    return env


def _spawn(tmp_path: Path, *argv: str) -> pexpect.spawn:
    """The command under an 80-column pty; all it writes is kept in ``child.logfile_read``."""
    child = pexpect.spawn(
        sys.executable,
        ["-m", "vllm.entrypoints.cli.main", *argv],
        dimensions=(50, COLUMNS),
        env=_env(tmp_path),
        cwd=str(tmp_path),
        encoding="utf-8",
        codec_errors="replace",
        timeout=300,
    )
    child.logfile_read = io.StringIO()
    return child


def _output(child: pexpect.spawn) -> str:
    child.expect(pexpect.EOF)
    child.close()
    return str(child.logfile_read.getvalue())


def _screen(raw: str) -> list[str]:
    """What a terminal of COLUMNS columns shows after ``raw``, without trailing blank lines.

    Tall enough that nothing scrolls off: wrapping does not depend on the height.
    """
    screen = pyte.Screen(COLUMNS, 1000)
    stream = pyte.Stream(screen)
    # The pty turns "\n" into "\r\n" already; pyte needs it so too (no LNM mode).
    stream.feed(raw)
    lines = [line.rstrip() for line in screen.display]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _written_lines(raw: str) -> list[str]:
    # Every piece of text between two line starts: each must fit the terminal.
    return [s for s in re.split(r"\r\n|\r|\n", raw) if s]


def test_on_an_80_column_terminal_nothing_wraps_and_no_progress_line_stays(
    tmp_path: Path,
) -> None:
    child = _spawn(tmp_path, *SMALL)
    raw = _output(child)
    assert child.exitstatus == 0, raw
    # The bar was drawn (on stderr, the terminal) while the runs went on ...
    assert "baseline" in raw and "offload" in raw and "req/s" in raw
    # ... and no line ever written was wider than the terminal.
    widest = max(_written_lines(raw), key=wcswidth)
    assert wcswidth(widest) <= COLUMNS, widest
    # What stays on the screen is the report alone: no bar, no piece of one.
    screen = _screen(raw)
    assert screen[0] == "vllm-kv-offload run"
    assert screen[-1] == "  verdict: PASS"
    for line in screen:
        assert "req/s" not in line and "%|" not in line and "requests," not in line, line
    # Each part of the report once, in order: header, the fs tier's state, the figures.
    assert screen.count("vllm-kv-offload run") == 1
    for once in ("fs tier started cold", "baseline (no offload)", "  verdict:"):
        assert sum(once in line for line in screen) == 1, once
    fs_header = next(i for i, line in enumerate(screen) if line.startswith("  fs tier:  up to"))
    assert screen[fs_header + 1] == "  fs tier started cold (no blocks of this geometry on disk)"
    assert any(line.startswith("  prefill tokens saved vs baseline:") for line in screen)


def test_ctrl_c_prints_one_line_exits_130_and_cleans_up(tmp_path: Path) -> None:
    child = _spawn(tmp_path, *LONG)
    # The fs tier's state is printed when the offloaded run starts, then its bar.
    child.expect("fs tier started cold")
    child.expect(r"offload:\s+[1-9][0-9]?%")  # some requests done, many to go
    child.sendintr()  # Ctrl-C: the terminal sends SIGINT to the foreground process group
    raw = _output(child)
    assert child.exitstatus == 130, raw
    assert child.signalstatus is None  # it exited; the signal did not kill it
    for noise in ("Traceback", "Error", "ERROR", "exception was never retrieved", "Cancelled"):
        assert noise not in raw, raw
    assert raw.count("vllm-kv-offload: interrupted") == 1
    # On the screen: the header, then the one line (the bar was erased before it).
    screen = _screen(raw)
    assert screen[-1] == "vllm-kv-offload: interrupted"
    assert "fs tier started cold" in screen[-2]
    # Cleaned up: the CPU tier's shared region is unlinked, no half-written block file is left.
    assert not list(Path("/dev/shm").glob(f"vllm_offload_engine-{child.pid}-*"))
    root = tmp_path / "cache" / "vllm-kv-offload"
    assert list(root.rglob("*.bin")), "the run was interrupted before it wrote anything"
    assert not [p for p in root.rglob("*") if p.name.startswith(".") and p.is_file()]


def test_piped_output_shows_the_header_at_once_and_progress_lines(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(tmp_path),
        cwd=str(tmp_path),
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    # The header came before the baseline run was done, let alone the whole command.
    running_at_first_line = proc.poll() is None
    rest = proc.stdout.read()
    assert proc.wait(timeout=300) == 0, first + rest
    assert first == "vllm-kv-offload run\n"
    assert running_at_first_line
    lines = [first.rstrip("\n"), *rest.splitlines()]
    # Plain lines only: no carriage-return redraws or escape sequences in a log.
    assert "\r" not in rest and "\x1b" not in rest
    baseline = [i for i, line in enumerate(lines) if line.startswith("baseline: ")]
    offload = [i for i, line in enumerate(lines) if line.startswith("offload: ")]
    fs_start = next(i for i, line in enumerate(lines) if "fs tier started cold" in line)
    report = lines.index("  verdict: PASS")
    # Order: header, baseline progress, the fs tier's state, offload progress, the figures.
    assert baseline and offload
    assert max(baseline) < fs_start < min(offload) <= max(offload) < report
    assert re.fullmatch(r"baseline: 24/24 requests, \d+ s; computed \d+% .*", lines[baseline[-1]])
    assert all(len(line) <= COLUMNS for line in lines[: report + 1])


def test_json_dash_writes_the_document_to_stdout_and_the_text_to_stderr(tmp_path: Path) -> None:
    import json

    proc = run_python(
        "-m", "vllm.entrypoints.cli.main", *SMALL, "--json", "-", env=_env(tmp_path), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # stdout is the JSON document and nothing else
    assert doc["schema_version"] == 1 and doc["verdict"]["status"] == "PASS"
    assert "vllm-kv-offload run" in proc.stderr and "verdict: PASS" in proc.stderr
    assert not (tmp_path / "-").exists()
