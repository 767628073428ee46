# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run`` killed or terminated at several points leaves no shared memory behind.

Each test runs the real command (``python -m vllm.entrypoints.cli.main`` semantics, through a
small wrapper) in a child process whose shared host region lives in a private directory. The
wrapper reports on stderr every region a process of the run creates or joins, and every region
cleanup; at a chosen point it stops (sleeps forever) so that the test can kill it exactly there:

* ``publish``: the creator has built its file under a temporary name and is about to publish it;
* ``first-region``: the first region of the offload run exists, no other participant joined;
* ``all-joined``: every participant (scheduler side and worker) joined; the run goes on.

After ``SIGKILL`` the directory must hold nothing of the run once the next start swept it (and
nothing at all, without any sweep, once every participant had joined). ``SIGTERM`` must clean up
exactly as ``SIGINT`` does.
"""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion

from .workload_args import command_env, workload_args

MARKER_TIMEOUT_S = 120.0

# A small run; --think-time keeps the offload run going for a few seconds, so a signal sent
# right after its regions exist arrives mid-run.
ARGS = [
    "run",
    *workload_args(clients=1, sessions=8, think_time=0.2, timeout=120, documents=2),
    "--no-progress",
]

# Runs the command with the region directory redirected and the reporting/stopping hooks.
WRAPPER = r"""
import os, sys, time

from vllm.entrypoints.cli.config import TiersConfig
from vllm.entrypoints.cli.main import main
from vllm.v1.kv_offload.cpu.shared_region import region as sor

REGION_DIR = os.environ["KVO_TEST_REGION_DIR"]
STOP_AT = os.environ.get("KVO_TEST_STOP_AT", "")


def say(*words):
    try:
        sys.stderr.write("KVO " + " ".join(map(str, words)) + "\n")
        sys.stderr.flush()
    except Exception:
        pass


def stop():
    say("stopped")
    while True:
        time.sleep(60)


_connector_config = TiersConfig.connector_config


def connector_config(self):
    cfg = _connector_config(self)
    cfg["shared_region_dir"] = REGION_DIR
    return cfg


TiersConfig.connector_config = connector_config

Region = sor.SharedOffloadRegion
_init = Region.__init__


def __init__(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    say("region", self.rank, self.is_creator, os.path.basename(self.path))
    if STOP_AT == "first-region":
        stop()


Region.__init__ = __init__
_cleanup = Region.cleanup


def cleanup(self):
    if not self.closed:
        say("cleanup", self.rank)
    _cleanup(self)


Region.cleanup = cleanup

if STOP_AT == "publish":
    _link = os.link

    def link(src, dst, *args, **kwargs):
        if os.path.basename(str(src)).startswith("vllm_offload_"):
            stop()
        return _link(src, dst, *args, **kwargs)

    os.link = link

sys.exit(main(sys.argv[1:]))
"""


class Child:
    """The wrapped command in a child process; its stderr lines are read by a thread."""

    def __init__(self, tmp_path: Path, stop_at: str, *extra: str) -> None:
        self.region_dir = tmp_path / "shm"
        self.region_dir.mkdir()
        env = command_env(
            tmp_path, KVO_TEST_REGION_DIR=str(self.region_dir), KVO_TEST_STOP_AT=stop_at
        )
        tiers = list(extra) if "--no-fs" in extra else ["--fs-root", str(tmp_path / "fs"), *extra]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRAPPER, *ARGS, *tiers],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for(self, what: str, count: int = 1) -> None:
        """Block until ``count`` marker lines starting with ``KVO <what>`` were printed."""
        deadline = time.monotonic() + MARKER_TIMEOUT_S
        while self.markers(what) < count:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no 'KVO {what}' x{count} within {MARKER_TIMEOUT_S} s: {self.seen}")
            if line is None:
                pytest.fail(
                    f"the run ended (rc={self.proc.wait()}) before 'KVO {what}' x{count}: "
                    f"{self.seen}"
                )
            self.seen.append(line)

    def markers(self, what: str) -> int:
        return sum(1 for line in self.seen if line.startswith(f"KVO {what}"))

    def finish(self, sig: int | None = None) -> int:
        """Send ``sig`` (if any), wait for the exit and the rest of stderr; the exit code."""
        if sig is not None:
            self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=MARKER_TIMEOUT_S)
        self._reader.join(timeout=MARKER_TIMEOUT_S)
        while (line := self.lines.get_nowait()) is not None:
            self.seen.append(line)
        return rc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def region_files(self) -> list[str]:
        return sorted(p.name for p in self.region_dir.iterdir())


@pytest.fixture
def child_factory(tmp_path: Path):  # type: ignore[no-untyped-def]
    children: list[Child] = []

    def make(stop_at: str, *extra: str) -> Child:
        child = Child(tmp_path, stop_at, *extra)
        children.append(child)
        return child

    yield make
    for child in children:
        child.close()


def next_start(directory: Path) -> None:
    """What any later engine start does to the directory: create (and release) a region."""
    with SharedOffloadRegion("next-start", 1, 64, directory=directory, prefault=False):
        pass


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "fs"),
    [("publish", "fs"), ("first-region", "fs"), ("all-joined", "fs"), ("all-joined", "no-fs")],
)
def test_sigkill_leaves_no_shared_memory_behind(child_factory, point: str, fs: str) -> None:  # type: ignore[no-untyped-def]
    # With the fs tier the scheduler side maps the region too (two participants); without it
    # only the worker does.
    extra = ["--no-fs"] if fs == "no-fs" else []
    participants = 1 if fs == "no-fs" else 2
    child = child_factory("" if point == "all-joined" else point, *extra)
    if point == "all-joined":
        child.wait_for("region", participants)
    else:
        child.wait_for("stopped")
    assert child.finish(signal.SIGKILL) == -signal.SIGKILL
    if point == "all-joined":
        # Every participant had joined, so the name was gone before the kill.
        assert child.region_files() == []
    next_start(child.region_dir)
    assert child.region_files() == [], child.seen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "rc", "message"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")],
)
def test_sigterm_cleans_up_like_sigint(child_factory, sig: int, rc: int, message: str) -> None:  # type: ignore[no-untyped-def]
    child = child_factory("")
    child.wait_for("region", 2)  # mid-run: the offload run's scheduler side and worker joined
    assert child.finish(sig) == rc, child.seen
    assert f"vllm-kv-offload: {message}" in child.seen
    # Every region the run mapped was cleaned up before the process exited.
    assert child.markers("cleanup") == child.markers("region") == 2, child.seen
    assert child.region_files() == []
