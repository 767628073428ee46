"""Real ``redis-server`` processes for the redis tier's tests and benchmark (no fakes).

``RedisServer`` runs one server in the foreground of a child process on a free loopback port, so a
test can SIGKILL it and start it again on the same port. ``RedisCluster3`` runs three masters and
joins them with ``redis-cli --cluster create``. Both are stopped (and their files removed with the
temporary directory) by their ``stop()``.

Without the binary, ``require_redis_server()`` skips the test with a reason saying how to install
it, except under ``CI=true``, where it fails: CI must run these tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

INSTALL_HINT = (
    "redis-server is not installed: install it with `sudo apt-get install redis-server` "
    "(Debian/Ubuntu; .ci/run does this) to run the redis tier tests"
)
START_TIMEOUT_S = 15.0


def require_redis_server() -> str:
    """The path of ``redis-server``; skips (fails under ``CI=true``) without it."""
    path = shutil.which("redis-server")
    if path is None or shutil.which("redis-cli") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(INSTALL_HINT + " (CI=true: failing instead of skipping)")
        pytest.skip(INSTALL_HINT)
    return path


def free_port(*, with_bus: bool = False) -> int:
    """A loopback port nobody listens on now (and, ``with_bus``, its cluster bus port + 10000)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``; data in memory only."""

    def __init__(self, workdir: Path, *extra: str, port: int | None = None) -> None:
        self.binary = require_redis_server()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port(with_bus="--cluster-enabled" in extra)
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--logfile",
            str(self.workdir / "redis.log"),
            *self.extra,
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:  # bounded poll: the server has no readiness signal we can wait on
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        log = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(
                            f"redis-server on {self.port} did not start:\n{log}"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kwargs)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL the server (no shutdown, no save) and reap it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class RedisCluster3:
    """Three masters (no replicas) joined into one cluster that keeps serving the slots of the
    masters that are up (``cluster-require-full-coverage no``)."""

    def __init__(self, workdir: Path) -> None:
        self.nodes: list[RedisServer] = []
        try:
            for i in range(3):
                self.nodes.append(
                    RedisServer(
                        workdir / f"node{i}",
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(workdir / f"node{i}" / "nodes.conf"),
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-require-full-coverage",
                        "no",
                    )
                )
            subprocess.run(
                [
                    "redis-cli",
                    "--cluster",
                    "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas",
                    "0",
                    "--cluster-yes",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                timeout=60,
            )
            self.wait_state("ok", self.nodes)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def wait_state(self, state: str, nodes: list[RedisServer]) -> None:
        """Bounded poll of CLUSTER INFO on ``nodes`` until each reports ``cluster_state``."""
        deadline = time.monotonic() + 30
        for node in nodes:
            client = node.client()
            try:
                while client.cluster("info")["cluster_state"] != state:
                    assert time.monotonic() < deadline, f"cluster not {state} in time"
                    time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
