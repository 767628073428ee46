# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run`` with the redis tier's options, against real redis servers: a server
the tier cannot use is refused before the baseline (exit 2, one line, the password masked);
credentials and the fleet secret come from a file or the environment; the report says whether
blocks are authenticated; refusals at ``maxmemory`` are failed blocks; a Redis Cluster serves;
and a fleet's every byte of output stays free of the password while its server dies and comes
back mid-run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.subprocesses import run_python
from tests.v1.kv_offload.tiering.redis.servers import RedisCluster3, RedisServer, free_port

from .workload_args import REPO, command_env, workload_args

PASSWORD = "Cli-S3cret-pw-42"
SMALL = workload_args(clients=2, sessions=4, think_time=0.001, timeout=300)
SERVED = workload_args(clients=2, sessions=10, think_time=0.001, timeout=300, turns=3)
"""Long enough for the redis tier to serve blocks (documents asked for again after others)."""
REFUSAL_BOUND_S = 2.0 + 8.0
"""The tier's connect timeout (2 s) and a few seconds: python's start-up and imports on a loaded
2-core box."""


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "locked", password=PASSWORD)
    yield srv
    srv.stop()


def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """The command in a child process; returns it (output captured) and its wall time."""
    t0 = time.monotonic()
    proc = run_python(
        "-m",
        "vllm.entrypoints.cli.main",
        "run",
        *args,
        env=command_env(tmp_path, **(env or {})),
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def _redis_run(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """A run with the redis tier alone (``args``: the workload and the redis options), its
    report written as JSON; returns the process and the report (empty if none was written)."""
    out = tmp_path / "report.json"
    proc, _ = _run(tmp_path, *args, "--no-progress", "--no-fs", "--json", str(out), env=env)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def _secret_file(tmp_path: Path, name: str, data: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_url_of_another_scheme_is_refused_without_its_password(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, *SMALL, "--redis-url", f"http://:{PASSWORD}@127.0.0.1:1")
    assert proc.returncode == 2 and "is not a redis URL" in proc.stderr
    assert PASSWORD not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", ["refused", "wrong-password", "no-password", "no-host"])
def test_a_server_the_tier_cannot_use_is_refused_before_the_baseline(
    tmp_path: Path, locked: RedisServer, case: str
) -> None:
    dead = free_port()
    url, cause = {
        "refused": (f"redis://:{PASSWORD}@127.0.0.1:{dead}", "connection refused"),
        "wrong-password": (f"redis://:not-{PASSWORD}@127.0.0.1:{locked.port}", "authentication"),
        "no-password": (locked.url, "authentication failed"),
        "no-host": ("redis://", "a host"),
    }[case]
    proc, wall = _run(tmp_path, *SMALL, "--no-fs", "--redis-url", url)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    refusal = next(line for line in lines if "--redis-url" in line)
    assert cause in refusal, lines
    assert PASSWORD not in proc.stdout + proc.stderr
    assert "baseline" not in proc.stdout, "refused before anything ran"
    assert wall < REFUSAL_BOUND_S, f"refused after {wall:.1f} s"


def test_secrets_from_files_and_the_environment_and_the_report_says_blocks_are_authenticated(
    tmp_path: Path, locked: RedisServer
) -> None:
    password = _secret_file(tmp_path, "redis.pw", PASSWORD.encode() + b"\n")
    key = _secret_file(tmp_path, "fleet.key", bytes(range(32)))  # binary: used as is
    proc, doc = _redis_run(
        tmp_path,
        *SERVED,
        "--redis-url-env",
        "KVO_TEST_URL",
        "--redis-password-file",
        str(password),
        "--integrity-key-file",
        str(key),
        env={"KVO_TEST_URL": f"redis://127.0.0.1:{locked.port}"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from vllm.v1.kv_offload.tiering.block_format import IntegrityKey

    key_id = IntegrityKey(bytes(range(32))).key_id.hex()
    header = " ".join(proc.stdout.split())  # the line wraps at 80 columns
    assert f"blocks authenticated (HMAC-SHA256, key id {key_id})" in header
    assert doc["settings"]["integrity_key_id"] == key_id
    assert doc["verdict"]["status"] == "PASS"
    off = doc["runs"]["offload"]
    assert off["transfers"]["redis_to_cpu"]["blocks"] > 0
    # One writer: once the tier follows the namespace's stores (from its first moments), a
    # lookup answers in the step that asks; the tier's own count reaches the report.
    deferred = off["lookup_deferred_requests"]
    assert off["lookup_deferred_requests_by_tier"]["redis"] <= deferred
    assert deferred <= 0.05 * off["requests"]["submitted"], deferred
    # Every value in the server carries the MAC: its keys are the keyed key space's.
    client = locked.client()
    assert client.keys(f"kvo@{key_id}:*") and not client.keys("kvo:*")
    client.close()
    assert PASSWORD not in proc.stdout + proc.stderr + (tmp_path / "report.json").read_text()


@pytest.mark.parametrize(
    ("data", "mode", "message"),
    [
        (b"fifteen bytes!!", 0o600, "holds 15 bytes"),
        (bytes(32), 0o640, "accessible to other users"),
    ],
)
def test_a_bad_integrity_key_file_is_refused(
    tmp_path: Path, locked: RedisServer, data: bytes, mode: int, message: str
) -> None:
    key = _secret_file(tmp_path, "fleet.key", data, mode)
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked.port}"
    proc, _ = _run(
        tmp_path, *SMALL, "--no-fs", "--redis-url", url, "--integrity-key-file", str(key)
    )
    assert proc.returncode == 2 and "--integrity-key-file" in proc.stderr and message in proc.stderr


def test_refusals_at_maxmemory_are_failed_blocks_in_the_report(tmp_path: Path) -> None:
    full = RedisServer(tmp_path / "full", "--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    try:
        proc, doc = _redis_run(tmp_path, *SMALL, "--redis-url", full.url)
        assert proc.returncode in (0, 1), proc.stdout + proc.stderr
        stores = doc["runs"]["offload"]["transfers"]["cpu_to_redis"]
        assert stores["failed_blocks"] > 0, stores
    finally:
        full.stop()


@pytest.mark.slow
def test_redis_cluster_serves_a_run(tmp_path: Path) -> None:
    cluster = RedisCluster3(tmp_path / "cluster")
    try:
        proc, doc = _redis_run(tmp_path, *SERVED, "--redis-url", cluster.url, "--redis-cluster")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "(cluster), shared by every engine instance" in " ".join(proc.stdout.split())
        assert doc["verdict"]["status"] == "PASS" and doc["settings"]["redis_cluster"] is True
        assert doc["runs"]["offload"]["transfers"]["redis_to_cpu"]["blocks"] > 0
    finally:
        cluster.stop()


@pytest.mark.slow
def test_a_fleet_never_prints_the_password_while_its_server_dies_and_comes_back(
    tmp_path: Path, locked: RedisServer
) -> None:
    out = tmp_path / "report.json"
    stderr_path = tmp_path / "stderr.txt"
    # Think time long enough that the offloaded run outlasts the outage (with 0.01 s it ended
    # in under a second, inside the outage, and its tiers rightly reported a dead server).
    args = workload_args(clients=2, sessions=40, think_time=0.2, timeout=300)
    args += ["--no-progress", "-v", "--engines", "2", "--json", str(out)]
    args += ["--redis-url", f"redis://:{PASSWORD}@127.0.0.1:{locked.port}"]
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.cli.main", "run", *args],
            cwd=REPO,
            env=command_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            assert proc.stdout is not None
            seen: list[str] = []
            # Printed once every instance built its offloading engine (its redis tier started).
            for line in proc.stdout:
                seen.append(line)
                if "fs tier started" in line:
                    break
            else:
                pytest.fail(f"the offloaded run never started: {''.join(seen)}")
            locked.kill()  # mid-run: the instances' tiers log the loss, fail jobs, reconnect
            time.sleep(1.0)  # the outage itself (what is tested), not a synchronisation
            locked.start()
            rest, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    printed = "".join(seen) + rest + stderr_path.read_text() + out.read_text()
    assert proc.returncode == 0, printed[-4000:]
    assert PASSWORD not in printed
    assert "redis://:***@127.0.0.1" in printed, "the output names the server, masked"
    assert "server answers again" in printed, "the outage ended while the run went on"
    # -v: the instances logged, their redis tiers too (start-up, and the outage).
    instance_lines = [line for line in printed.splitlines() if line.startswith("engine ")]
    assert any("redis tier" in line for line in instance_lines), instance_lines[:20]


def test_a_server_that_refuses_the_tier_after_the_probe_fails_the_verdict_saying_so(
    tmp_path: Path, locked: RedisServer
) -> None:
    # The probe passes; the password changes as the baseline starts (a rotated secret), so the
    # offloaded run's tier never gets an answer: the verdict says why instead of passing.
    admin = locked.client()
    out = tmp_path / "report.json"
    args = [*SMALL, "--no-progress", "--no-fs", "--json", str(out)]
    args += ["--redis-url", f"redis://:{PASSWORD}@127.0.0.1:{locked.port}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "run", *args],
        cwd=REPO,
        env=command_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()  # the header: printed once the options (and probe) passed
    admin.config_set("requirepass", "rotated-" + PASSWORD)
    rest, err = proc.communicate(timeout=600)
    admin.close()
    text = " ".join((first + rest).split())
    assert proc.returncode == 1, text + err
    assert "the redis tier never answered (authentication failed)" in text
    doc = json.loads(out.read_text())
    assert doc["runs"]["offload"]["redis_down"] == "authentication failed"
    assert doc["verdict"]["status"] == "FAIL"
    assert PASSWORD not in first + rest + err + out.read_text()
