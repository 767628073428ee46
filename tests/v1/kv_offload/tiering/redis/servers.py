# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Real ``redis-server`` processes for the redis tier's tests and benchmark (no fakes).

``RedisServer`` runs one server in the foreground of a child process on a free loopback port, so a
test can SIGKILL it and start it again on the same port; ``start_replica`` runs one replicating
another. ``RedisCluster3`` runs three masters and joins them with ``redis-cli --cluster create``;
its ``move_slot`` and ``begin_migration``/``finish_migration`` reshard one slot with the real
cluster commands (``CLUSTER SETSLOT``, ``MIGRATE``), behind the back of clients connected before.
Both are stopped (and their files removed with the temporary directory) by their ``stop()``.

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
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import pytest
import redis

INSTALL_HINT = (
    "redis-server is not installed: install it with `sudo apt-get install redis-server` "
    "(Debian/Ubuntu; .ci/run does this) to run the redis tier tests"
)
START_TIMEOUT_S = 15.0
STATE_TIMEOUT_S = 10.0
"""How long a topology change (replication link, slot owner) may take to show."""


def poll_until(
    condition: Callable[[], bool], what: str, timeout_s: float = STATE_TIMEOUT_S
) -> None:
    """Bounded poll of ``condition`` (server state has no event to wait on); fails naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout_s} s")
        time.sleep(0.02)


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
    """One ``redis-server`` child process on ``127.0.0.1:port``; data in memory only.

    With ``password``, the default user requires it (``--requirepass``); ``client()`` uses it.
    """

    def __init__(
        self, workdir: Path, *extra: str, port: int | None = None, password: str | None = None
    ) -> None:
        self.binary = require_redis_server()
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port(with_bus="--cluster-enabled" in extra)
        self.password = password
        self.extra = (*extra, "--requirepass", password) if password is not None else extra
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
        kwargs.setdefault("password", self.password)
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


def start_replica(master: RedisServer, workdir: Path) -> RedisServer:
    """A server replicating ``master`` (``--replicaof``; read-only, so writes get ``READONLY``),
    returned once its replication link is up and it holds everything ``master`` held."""
    admin = master.client()
    try:
        # The full sync otherwise waits 5 s for more replicas to share one diskless transfer.
        admin.config_set("repl-diskless-sync-delay", 0)
    finally:
        admin.close()
    replica = RedisServer(workdir, "--replicaof", "127.0.0.1", str(master.port))
    client = replica.client()
    try:
        poll_until(
            lambda: client.info("replication").get("master_link_status") == "up",
            f"replica {replica.port} linked to {master.port}",
        )
    finally:
        client.close()
    sync_replicas(master)
    return replica


def sync_replicas(master: RedisServer, num_replicas: int = 1) -> None:
    """Wait (``WAIT``, bounded) until ``num_replicas`` replicas acknowledged every write made to
    ``master`` so far."""
    client = master.client()
    try:
        acked = client.wait(num_replicas, int(STATE_TIMEOUT_S * 1000))
    finally:
        client.close()
    assert acked >= num_replicas, f"{acked} of {num_replicas} replicas of {master.port} synced"


class RedisCluster3:
    """Three masters (no replicas until ``add_replica``) joined into one cluster that keeps
    serving the slots of the masters that are up (``cluster-require-full-coverage no``).

    Attributes:
        nodes: the servers; the first three are the masters the cluster was created with.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.nodes: list[RedisServer] = []
        try:
            for _ in range(3):
                self.nodes.append(self._start_node())
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

    def _start_node(self) -> RedisServer:
        workdir = self.workdir / f"node{len(self.nodes)}"
        return RedisServer(
            workdir,
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(workdir / "nodes.conf"),
            "--cluster-node-timeout",
            "1000",
            "--cluster-require-full-coverage",
            "no",
            # A replica's full sync would otherwise wait 5 s for others to share it.
            "--repl-diskless-sync-delay",
            "0",
        )

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

    # -----------------------------------------------------------------------------------------
    # Resharding one slot with the cluster's own commands (clients connected before are not told)
    # -----------------------------------------------------------------------------------------

    def _run(self, n: int, *args: object) -> object:
        client = self.nodes[n].client()
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def node_id(self, n: int) -> str:
        node_id = self._run(n, "CLUSTER", "MYID")
        assert isinstance(node_id, bytes)
        return node_id.decode()

    def keyslot(self, key: bytes) -> int:
        slot = self._run(0, "CLUSTER", "KEYSLOT", key)
        assert isinstance(slot, int)
        return slot

    def slot_ranges(self, via: int = 0) -> list[tuple[int, int, int]]:
        """``(first slot, last slot, index of its master)`` of every range, as ``nodes[via]``
        sees them (its CLUSTER SLOTS)."""
        ranges = self._run(via, "CLUSTER", "SLOTS")
        assert isinstance(ranges, list)
        ports = [node.port for node in self.nodes]
        return [(start, end, ports.index(int(master[1]))) for start, end, master, *_ in ranges]

    def owner(self, slot: int, via: int = 0) -> int:
        """Index of the master that ``nodes[via]`` says serves ``slot``."""
        for start, end, master in self.slot_ranges(via):
            if start <= slot <= end:
                return master
        raise AssertionError(f"slot {slot} is served by no node according to node {via}")

    def keys_in_slot(self, slot: int, n: int) -> list[bytes]:
        """The keys of ``slot`` that ``nodes[n]`` holds."""
        keys = self._run(n, "CLUSTER", "GETKEYSINSLOT", slot, 10_000)
        assert isinstance(keys, list)
        return keys

    def begin_migration(self, slot: int, src: int, dst: int) -> None:
        """``set_importing`` then ``set_migrating`` (the documented order)."""
        self.set_importing(slot, src, dst)
        self.set_migrating(slot, src, dst)

    def set_importing(self, slot: int, src: int, dst: int) -> None:
        """Mark ``slot`` IMPORTING from ``src`` on ``dst``: ``dst`` serves commands of the slot
        that follow ``ASKING``."""
        self._run(dst, "CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(src))

    def set_migrating(self, slot: int, src: int, dst: int) -> None:
        """Mark ``slot`` MIGRATING to ``dst`` on ``src``: ``src`` answers ``ASK`` for keys of
        the slot it does not hold."""
        self._run(src, "CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(dst))

    def migrate_keys(self, src: int, dst: int, keys: Sequence[bytes]) -> None:
        """Move ``keys`` from ``src`` to ``dst`` (MIGRATE: atomic per call, deletes them on
        ``src``)."""
        if keys:
            reply = self._run(
                src, "MIGRATE", "127.0.0.1", self.nodes[dst].port, "", 0, 5000, "KEYS", *keys
            )
            assert reply in (b"OK", "OK", True), f"MIGRATE of {len(keys)} keys: {reply!r}"

    def finish_migration(self, slot: int, src: int, dst: int) -> None:
        """Assign ``slot`` to ``dst`` on every master (``dst`` and ``src`` first); returns once
        every master's CLUSTER SLOTS says so. ``src`` then answers ``MOVED``."""
        dst_id = self.node_id(dst)
        others = [n for n in range(len(self.nodes)) if n not in (src, dst)]
        for n in (dst, src, *others):
            self._run(n, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        for n in range(len(self.nodes)):
            poll_until(partial(self._sees_owner, n, slot, dst), f"node {n} sees slot {slot}")

    def _sees_owner(self, via: int, slot: int, owner: int) -> bool:
        return self.owner(slot, via=via) == owner

    def move_slot(self, slot: int, src: int, dst: int) -> None:
        """Reshard ``slot`` from ``src`` to ``dst`` with every key it holds."""
        self.begin_migration(slot, src, dst)
        self.migrate_keys(src, dst, self.keys_in_slot(slot, src))
        self.finish_migration(slot, src, dst)

    # -----------------------------------------------------------------------------------------
    # Replicas and failover
    # -----------------------------------------------------------------------------------------

    def add_master(self) -> int:
        """Start a node and join it to the cluster (CLUSTER MEET) as a master without slots (a
        scale-out before its resharding); returns its index once every node knows it."""
        n = self._join()
        for m in range(n):  # the others know it, and it knows the others (gossip, both ways)
            self._wait_known(n, lambda flags, _: "master" in flags, "master", among=[m])
            self._wait_known(m, lambda flags, _: "master" in flags, "master", among=[n])
        self.wait_state("ok", [self.nodes[n]])  # it learnt who serves every slot
        return n

    def add_replica(self, master: int) -> int:
        """Start a node, join it to the cluster (CLUSTER MEET) as a replica of ``nodes[master]``
        (CLUSTER REPLICATE); returns its index once it has synced everything ``master`` held
        and every node knows it as that master's replica."""
        n = self._join()
        master_id = self.node_id(master)
        # CLUSTER REPLICATE needs the master known to the new node (the handshake is gossip).
        self._wait_known(master, lambda flags, _: "master" in flags, "master", among=[n])
        client = self.nodes[n].client()
        try:
            client.execute_command("CLUSTER", "REPLICATE", master_id)
            poll_until(
                lambda: client.info("replication").get("master_link_status") == "up",
                f"node {n} replicating master {master}",
            )
        finally:
            client.close()
        sync_replicas(self.nodes[master])
        # A node that does not know the replica as master's refuses its vote in a failover.
        self._wait_known(n, lambda _, of: of == master_id, f"replica of {master}")
        return n

    def _join(self) -> int:
        node = self._start_node()
        self.nodes.append(node)
        n = len(self.nodes) - 1
        self._run(n, "CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
        return n

    def _wait_known(
        self, n: int, check: Callable[[str, str], bool], what: str, among: list[int] | None = None
    ) -> None:
        """Bounded poll until each node of ``among`` (default: all others) lists ``nodes[n]``
        in its CLUSTER NODES with ``check(flags, master id)`` true."""
        node_id = self.node_id(n)

        def knows(via: int) -> bool:
            nodes = self._run(via, "CLUSTER NODES")  # one word: parsed into a dict
            assert isinstance(nodes, dict)
            return any(
                v["node_id"] == node_id and check(v["flags"], v["master_id"])
                for v in nodes.values()
            )

        for other in among if among is not None else [m for m in range(len(self.nodes)) if m != n]:
            poll_until(partial(knows, other), f"node {other} knows node {n} as {what}")

    def failover(self, replica: int, master: int) -> None:
        """``CLUSTER FAILOVER`` on ``nodes[replica]`` (coordinated with its master, no data
        lost): returns once it is a master and ``nodes[master]`` its replica, and every node's
        CLUSTER SLOTS names the new master for the old one's slots."""
        slot = next(start for start, _, owner in self.slot_ranges() if owner == master)
        self._run(replica, "CLUSTER", "FAILOVER")
        for n, role in ((replica, "master"), (master, "slave")):
            poll_until(partial(self._has_role, n, role), f"node {n} is a {role}")
        for n in range(len(self.nodes)):
            poll_until(partial(self._sees_owner, n, slot, replica), f"node {n} sees failover")

    def _has_role(self, n: int, role: str) -> bool:
        client = self.nodes[n].client()
        try:
            return bool(client.info("replication")["role"] == role)
        finally:
            client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
