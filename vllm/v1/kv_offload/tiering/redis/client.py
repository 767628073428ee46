# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's connection to the server: clients, the router, error kinds.

Two kinds of connections (measured on redis-py 8, see docs/redis_tier.md):

* **The data path** (``GET`` and ``SET`` of block values) goes through the tier's own
  connections (``direct_io``): values are received straight into primary rows and sent straight
  from them, one copy each, by the kernel. ``BlockValue`` carries a block's header and its row as
  two pieces, never joined there. Where the URL asks for something those connections do not do,
  the tier says so once at start-up and sends ``GET``/``SET`` through redis-py's pipelines (the
  value joined into bytes once; the reply copied into the row once).
* **Everything else** goes through redis-py's public API: ``EXISTS``, ``DEL``, ``PING``,
  ``INFO``, ``DBSIZE``, the cluster's slot map, the commands redirected by ``ASK``/``MOVED``.

Client settings:

* **Fail fast.** Connect and socket timeouts of ``timeout_s``, no retries: a stopped server fails
  a round trip after one ``timeout_s``, a wrong password costs one ``AUTH``. A pooled connection
  the server closed (e.g. after a restart) needs no retry: redis-py's pool, and the tier's own,
  check every connection for EOF or pending data as they hand it out, and reconnect it.
  redis-py's defaults (10 retries with exponential back-off, also of a failed ``AUTH``, and 5 s
  timeouts) would hold a job for seconds against a dead server; the tier's circuit breaker does
  the waiting instead.
* **Errors by kind** (``error_kind``): unreachable (refused, reset, timed out) and authentication
  failures cut the tier off (the breaker opens, ``health``); a permission refusal (ACL
  ``NOPERM``) shuts the command's gate; ``OOM``, ``WRONGTYPE`` and the rest fail only the commands
  they answer.
* **Cluster: one pipeline per master** (``Router``). redis-py's cluster pipeline raises as a whole
  when one master is down; the tier groups keys by the master of their slot itself, so the keys of
  the masters that are up keep being served while the others miss. A master found unreachable is
  not contacted again by lookups and jobs (its keys fail at once) until the health thread's
  probe finds it answering (``probe_down_masters``; back-off from 0.25 s doubling to 8 s), and
  each change of a master's state is one log line. The breaker opens only when every master is
  unreachable; server figures and health probes ask each master on its own.
  Because the tier bypasses the cluster client's command path, it follows redirections itself,
  once each: ``ASK`` (the slot is being migrated and the key is already on the target) resends
  the command to the target after ``ASKING``, and ``MOVED`` (the slot belongs to another master
  now: a resharding or a failover) reloads the slot map and resends the command to the new
  owner. A second redirection of the same command is its reply (an error: the job fails or the
  key misses).
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import RedisCluster
from redis.connection import ConnectionPool
from redis.retry import Retry

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.direct_io import (
    Destination,
    DirectPool,
    DirectReply,
    endpoint_from_url,
)

logger = init_logger(__name__)

RedisClient = redis.Redis | RedisCluster
"""A standalone or a cluster client (both thread-safe; their pipelines are not)."""

SOCKET_READ_SIZE = 256 << 10
MASTER_MIN_BACKOFF_S = 0.25
MASTER_MAX_BACKOFF_S = 8.0
"""Probe intervals of a cluster master found unreachable (doubling from the first)."""


class BlockValue:
    """One block's value, in two pieces: its header and its payload (a primary row).

    Ownership: ``payload`` is borrowed from the primary region; the caller keeps the row pinned
    until the command that carries the value has been sent.
    """

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + len(self.payload)

    def join(self) -> bytes:
        """The value as one bytes object (one copy; for redis-py's pipelines)."""
        return b"".join((self.header, self.payload))


def make_client(config: RedisTierConfig) -> RedisClient:
    """Create the client for ``config`` (standalone: lazy, connects on first use; cluster:
    contacts the cluster now to load the slot map).

    Raises:
        redis.exceptions.RedisError: the cluster cannot be reached or is not a cluster (the
            message redacted).
    """
    common: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "socket_read_size": SOCKET_READ_SIZE,
        "health_check_interval": 0,
        # RESP2, which every Redis and Valkey server speaks (redis-py 8 defaults to RESP3): the
        # tier needs nothing of RESP3, and its own connections speak RESP2 too. A URL's
        # ``?protocol=3`` still wins (and turns the tier's own connections off).
        "protocol": 2,
        "retry": Retry(NoBackoff(), 0),  # one attempt: see the module docstring
    }
    if config.password is not None:
        common["password"] = config.password  # the URL has none (config checks)
    if config.cluster:
        try:
            return RedisCluster.from_url(config.url, require_full_coverage=False, **common)
        except rexc.RedisError as e:
            raise type(e)(config.redactor.text(str(e))) from None
    pool = ConnectionPool.from_url(config.url, **common)
    return redis.Redis(connection_pool=pool)


class ErrorKind(enum.Enum):
    """What a failed command or connection says about the server (``error_kind``)."""

    UNREACHABLE = "unreachable"
    """Refused, reset, timed out, closed: the server (or master) cannot be reached."""
    AUTH = "authentication"
    """A wrong or missing password, a disabled user: a misconfiguration."""
    PERMISSION = "permission"
    """The ACL refuses the command for this user (``NOPERM``)."""
    OOM = "oom"
    """A write refused at ``maxmemory`` (``noeviction``; ``volatile-*`` with nothing to evict)."""
    WRONGTYPE = "wrongtype"
    """The key holds a value of another Redis type (not a string)."""
    OTHER = "other"
    """Anything else (``READONLY``, a redirection not followed, ``TRYAGAIN``, ...)."""


def error_kind(exc: BaseException) -> ErrorKind:
    """Classify ``exc`` (see ``ErrorKind``)."""
    if isinstance(exc, (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError)):
        return ErrorKind.AUTH
    if isinstance(exc, rexc.NoPermissionError):
        return ErrorKind.PERMISSION
    if isinstance(exc, rexc.OutOfMemoryError) or (
        isinstance(exc, rexc.ResponseError) and str(exc).startswith("OOM")
    ):
        return ErrorKind.OOM
    if isinstance(exc, rexc.ResponseError):
        return ErrorKind.WRONGTYPE if str(exc).startswith("WRONGTYPE") else ErrorKind.OTHER
    if isinstance(exc, (rexc.ConnectionError, rexc.TimeoutError, OSError)):
        return ErrorKind.UNREACHABLE
    return ErrorKind.OTHER


def cuts_off(exc: BaseException) -> bool:
    """Whether ``exc`` says the server (or master) cannot be used at all: unreachable, or
    refusing this client's credentials. These open the circuit breaker (a cluster master: mark
    it down); other errors only fail the commands they answer."""
    return error_kind(exc) in (ErrorKind.UNREACHABLE, ErrorKind.AUTH)


def close_client(client: RedisClient | None) -> None:
    """Close every pooled connection of ``client`` without sending anything (never blocks on a
    dead server)."""
    if client is None:
        return
    try:
        client.close()
        if isinstance(client, redis.Redis):
            # A pool passed in is not closed by Redis.close(); disconnect() only closes sockets.
            client.connection_pool.disconnect()
    except Exception:
        pass  # best effort at shutdown: the sockets are closed with the process anyway


class Router:
    """Sends per-key commands to the right server, one pipelined round trip per server.

    Standalone: every key goes to the one server. Cluster: keys are grouped by the master that
    owns their slot (the cluster client's slot map); each group is one pipeline on that master's
    own connection pool, and the commands redirected by ``ASK`` or ``MOVED`` are resent once
    (see the module docstring). ``GET`` and ``SET`` rounds go over the tier's own connections
    (``direct_io.DirectPool``) unless those cannot serve the URL. Thread-safe (the lookup and I/O
    threads share it): clients and the direct pool are thread-safe, and each call builds its own
    pipelines.

    Attributes:
        client: the standalone or cluster client.
        direct: the tier's own connections for ``GET``/``SET``; None where they cannot serve
            the URL (then redis-py's pipelines carry those too).
    """

    def __init__(self, config: RedisTierConfig, name: str) -> None:
        """Args:
        name: the tier's printable name (credentials masked), for the log.

        Raises:
            redis.exceptions.RedisError: as ``make_client``.
        """
        self.client: RedisClient = make_client(config)
        endpoint = endpoint_from_url(config.url, config.password, config.timeout_s)
        if isinstance(endpoint, str):
            self.direct: DirectPool | None = None
            logger.warning(
                "redis tier %s: GETs and SETs go through redis-py, with one more copy of each "
                "value (the tier's own connections do not support %s)",
                name,
                config.redactor.text(endpoint),
            )
        else:
            self.direct = DirectPool(endpoint)
        self._name = name
        self._redactor = config.redactor
        self._stale_slots = False
        self._refresh_lock = threading.Lock()
        # Cluster: masters found unreachable, by name. Their keys fail at once (no connect
        # attempt per batch) until the health thread's probe finds them answering. Replaced
        # whole under _down_lock, never mutated, so the data paths read it without the lock.
        self._down: dict[str, _Down] = {}
        self._down_lock = threading.Lock()

    def execute(self, rkeys: Sequence[bytes], add: Callable[[Pipeline, int], object]) -> list[Any]:
        """Run one command per key, ``add(pipe, i)`` queuing the command of ``rkeys[i]``.

        ``add`` may be called more than once for a key: a command redirected by ``ASK`` or
        ``MOVED`` is queued again for the node it was redirected to (once per redirection).

        Returns:
            The reply of each key's command, in order; a command that failed (or whose server
            failed as a whole: refused, reset, timed out) gives the exception instead.
        """
        return self._run(rkeys, add)

    def get_into(
        self, rkeys: Sequence[bytes], destinations: Sequence[Destination]
    ) -> list[DirectReply]:
        """``GET`` every key, value ``i`` received straight into ``destinations[i]`` (see
        ``direct_io.get_into``), one round trip per server; redirected commands as ``execute``
        (through a pipeline, and one copy of their values).

        Returns:
            Per key: True (value received, of the destination's size), None (no such key), the
            size of a value of another size (dropped), or the exception of a failed command or
            server, as ``execute``.
        """

        def add(pipe: Pipeline, i: int) -> None:
            pipe.get(rkeys[i])

        def convert(i: int, reply: Any) -> DirectReply:
            return _copy_value(reply, destinations[i])

        def direct(client: redis.Redis, where: _Where, group: list[int]) -> list[DirectReply]:
            if self.direct is None:
                out = _pipelined(client, group, add, asking=False)
                return [convert(i, r) for i, r in zip(group, out, strict=True)]
            keys, dests = [rkeys[i] for i in group], [destinations[i] for i in group]
            return self.direct.get_into(keys, dests, host=where[0], port=where[1])

        return self._run(rkeys, add, direct, convert)

    def set_streamed(
        self, rkeys: Sequence[bytes], value: Callable[[int], BlockValue], *, px: int | None
    ) -> list[Any]:
        """``SET rkeys[i] value(i) [PX px]`` for every key, each sent as soon as its value is
        made (see ``direct_io.DirectConnection.set_streamed``), one round trip per server;
        redirected commands as ``execute`` (``value(i)`` is then called again, and joined).

        Returns:
            Per key: True, or the exception of a failed command or server, as ``execute``.
        """

        def add(pipe: Pipeline, i: int) -> None:
            pipe.set(rkeys[i], value(i).join(), px=px)

        def direct(client: redis.Redis, where: _Where, group: list[int]) -> list[Any]:
            if self.direct is None:
                return _pipelined(client, group, add, asking=False)

            def pieces(j: int) -> tuple[bytes, memoryview]:
                v = value(group[j])
                return v.header, v.payload

            keys = [rkeys[i] for i in group]
            return self.direct.set_streamed(keys, pieces, px=px, host=where[0], port=where[1])

        return self._run(rkeys, add, direct)

    def _run(
        self,
        rkeys: Sequence[bytes],
        add: Callable[[Pipeline, int], object],
        direct: Callable[[redis.Redis, _Where, list[int]], list[Any]] | None = None,
        convert: Callable[[int, Any], Any] | None = None,
    ) -> list[Any]:
        """One command per key, sent to the server that owns it, redirections followed once.

        Args:
            add: queues key ``i``'s command on a pipeline (redirected commands always go this
                way).
            direct: runs the commands of ``group`` (indices of keys of one server) on that
                server (its client and its address) and returns their replies; None: a pipeline
                of ``add``.
            convert: turns a pipeline reply of key ``i`` into what ``direct`` would have
                returned for it (applied to redirected commands); None: replies as they are.
        """
        replies: list[Any] = [None] * len(rkeys)
        self._send(rkeys, range(len(rkeys)), add, direct, convert, replies)
        moved = [i for i, reply in enumerate(replies) if isinstance(reply, rexc.MovedError)]
        if moved and self._reload_slot_map(after_moved=True):
            # The slot map was stale (the slots moved in a resharding or a failover): send
            # those commands once more, to the new owners.
            self._send(rkeys, moved, add, direct, convert, replies)
        return replies

    def _send(
        self,
        rkeys: Sequence[bytes],
        indices: Iterable[int],
        add: Callable[[Pipeline, int], object],
        direct: Callable[[redis.Redis, _Where, list[int]], list[Any]] | None,
        convert: Callable[[int, Any], Any] | None,
        replies: list[Any],
    ) -> None:
        """One round trip per master for the commands of ``indices`` (then one per ``ASK``
        target), each reply stored at its index in ``replies``."""
        asked: dict[tuple[str, int], list[int]] = {}
        for name, client, where, group in self._groups(rkeys, indices):
            if name in self._down:
                down = rexc.ConnectionError(f"cluster master {name} is unreachable")
                for i in group:
                    replies[i] = down
                continue
            if direct is None:
                out = _pipelined(client, group, add, asking=False)
            else:
                try:
                    out = direct(client, where, group)
                except Exception as e:
                    out = [e] * len(group)
            for i, reply in zip(group, out, strict=True):
                replies[i] = reply
                if isinstance(reply, rexc.MovedError):
                    self._stale_slots = True
                elif isinstance(reply, rexc.AskError):
                    asked.setdefault((reply.host, int(reply.port)), []).append(i)
            if name:
                self._mark_down(name, all_cut_off(out))
        if not asked or not isinstance(self.client, RedisCluster):
            return
        # ASK: the slot is migrating and these keys are not (or no longer) on its owner. The
        # target serves each command once, after ASKING; the slot map stays as it is (the owner
        # changes only when the migration ends, which the first MOVED then reports).
        for (host, port), group in asked.items():
            node = self.client.nodes_manager.get_node(host=host, port=port)
            if node is None:
                continue  # not a node of the map: the ASK error stays the reply
            conn = node.redis_connection or self.client.get_redis_connection(node)
            out = _pipelined(conn, group, add, asking=True)
            for i, reply in zip(group, out, strict=True):
                replies[i] = reply if convert is None else convert(i, reply)

    def _reload_slot_map(self, *, after_moved: bool = False) -> bool:
        """Reload the cluster's slot map if a ``MOVED`` marked it stale (one thread reloads, the
        others find it fresh); False if there is none to reload or the reload failed (then it is
        tried again before the next round trip).

        ``after_moved``: the caller saw a ``MOVED`` and resends next, so it also waits for a
        reload another thread started after that reply (its flag is cleared already, but the
        map is new only once that reload returns).
        """
        client = self.client
        if not isinstance(client, RedisCluster):
            return False
        if not (self._stale_slots or after_moved):
            return True  # the fast path of every round trip: no lock
        with self._refresh_lock:
            if self._stale_slots:
                self._stale_slots = False
                try:
                    client.nodes_manager.initialize()
                except Exception:
                    self._stale_slots = True
                    return False
        return True

    def all_down(self, replies: Sequence[Any]) -> BaseException | None:
        """The error to open the circuit breaker with, if ``replies`` show the tier cut off: the
        server is unreachable, or, in a cluster, every master is. None otherwise (a cluster with
        a master down only misses that master's keys)."""
        exc = all_cut_off(replies)
        if exc is None or not isinstance(self.client, RedisCluster):
            return exc
        masters = {node.name for node in self.client.get_primaries()}
        return exc if masters <= set(self._down) else None

    def _mark_down(self, name: str, exc: BaseException | None) -> None:
        """Record that master ``name`` is unreachable (``exc``) or answered (None); one log line
        per change of its state."""
        if (exc is None) == (name not in self._down):
            return  # no change (the fast path: no lock)
        now = time.monotonic()
        with self._down_lock:
            if (exc is None) == (name not in self._down):
                return
            marked = dict(self._down)
            if exc is not None:
                marked[name] = _Down(now, now + MASTER_MIN_BACKOFF_S, MASTER_MIN_BACKOFF_S)
            else:
                since = marked.pop(name).since
            self._down = marked
        if exc is not None:
            logger.warning(
                "redis tier %s: cluster master %s cannot be used (%s); its keys miss while the "
                "other masters serve theirs",
                self._name,
                name,
                self._redactor.error(exc),
            )
        else:
            logger.warning(
                "redis tier %s: cluster master %s answers again after %.1f s",
                self._name,
                name,
                now - since,
            )

    def probe_down_masters(self) -> float | None:
        """Health thread: PING each master marked unreachable whose retry time has come (after
        reloading the slot map, so that a failover's new master is found), and mark those that
        answer up again; a master that left the slot map is forgotten.

        Returns:
            Seconds until the next probe is due; None when no master is marked unreachable.
        """
        client = self.client
        if not self._down or not isinstance(client, RedisCluster):
            return None
        with contextlib.suppress(Exception):  # the old map stays; the probes still tell
            client.nodes_manager.initialize()
        primaries = {node.name: node for node in client.get_primaries()}
        for name, down in list(self._down.items()):
            node = primaries.get(name)
            if node is None:
                self._forget(name)
                continue
            if time.monotonic() < down.retry_at:
                continue
            try:
                (node.redis_connection or client.get_redis_connection(node)).ping()
            except Exception as e:
                if not cuts_off(e):
                    self._mark_down(name, None)  # it answered (with an error)
                    continue
                backoff = min(down.backoff * 2, MASTER_MAX_BACKOFF_S)
                with self._down_lock:
                    if name in self._down:
                        retry = _Down(down.since, time.monotonic() + backoff, backoff)
                        self._down = {**self._down, name: retry}
            else:
                self._mark_down(name, None)
        if not self._down:
            return None
        return max(0.0, min(d.retry_at for d in self._down.values()) - time.monotonic())

    def _forget(self, name: str) -> None:
        with self._down_lock:
            if name not in self._down:
                return
            self._down = {n: d for n, d in self._down.items() if n != name}
        logger.warning(
            "redis tier %s: cluster master %s left the slot map (a failover or a resharding); "
            "its slots are served by their new masters",
            self._name,
            name,
        )

    def server_figures(self) -> tuple[int, int, int]:
        """``(keys, used memory, maxmemory or 0 when some server has no limit)`` of the server,
        or summed over the cluster's masters that answer (each asked on its own: one dead master
        does not hide the others' figures).

        Raises:
            Exception: the server (every master) cannot be used: what it raised.
        """
        client = self.client
        if not isinstance(client, RedisCluster):
            info: Any = client.info("memory")
            return int(client.dbsize()), int(info["used_memory"]), int(info["maxmemory"])
        keys = used = limit = answered = 0
        unlimited = False
        error: Exception | None = None
        for node in client.get_primaries():
            if node.name in self._down:
                continue
            conn = node.redis_connection or client.get_redis_connection(node)
            try:
                node_keys = int(conn.dbsize())
                node_info: Any = conn.info("memory")
            except Exception as e:
                error = e
                continue
            answered += 1
            keys += node_keys
            used += int(node_info["used_memory"])
            limit += int(node_info["maxmemory"])
            unlimited = unlimited or int(node_info["maxmemory"]) == 0
        if not answered and error is not None:
            raise error
        return keys, used, 0 if unlimited else limit

    def ping(self) -> None:
        """Raises unless the server (a cluster: some master, reloading the slot map first)
        answers; in a cluster, each master's state is updated from its answer."""
        client = self.client
        if not isinstance(client, RedisCluster):
            client.ping()
            return
        client.nodes_manager.initialize()
        error: Exception | None = None
        for node in client.get_primaries():
            try:
                (node.redis_connection or client.get_redis_connection(node)).ping()
            except Exception as e:
                if cuts_off(e):
                    self._mark_down(node.name, e)
                error = error or e
            else:
                self._mark_down(node.name, None)
        if error is not None and len(self._down) >= len(client.get_primaries()):
            raise error

    def close(self) -> None:
        close_client(self.client)
        if self.direct is not None:
            self.direct.close()

    def _groups(
        self, rkeys: Sequence[bytes], indices: Iterable[int]
    ) -> list[tuple[str, redis.Redis, _Where, list[int]]]:
        """``(master name, its client, its address, those of indices that are its keys)``; the
        name is "" and the address ``(None, None)`` (the URL's server) standalone."""
        client = self.client
        if not isinstance(client, RedisCluster):
            return [("", client, (None, None), list(indices))]
        self._reload_slot_map()  # a no-op unless a MOVED marked it stale
        nodes = client.nodes_manager
        groups: dict[str, tuple[str, redis.Redis, _Where, list[int]]] = {}
        for i in indices:
            node = nodes.get_node_from_slot(client.keyslot(rkeys[i]))
            group = groups.get(node.name)
            if group is None:
                conn = node.redis_connection or client.get_redis_connection(node)
                group = groups[node.name] = (node.name, conn, (node.host, int(node.port)), [])
            group[3].append(i)
        return list(groups.values())


_Where = tuple[str | None, int | None]
"""A server's address for the tier's own connections: ``(host, port)``, or ``(None, None)`` for
the URL's server."""


@dataclass(frozen=True, slots=True)
class _Down:
    """A cluster master found unreachable: since when, when to probe it next, the back-off."""

    since: float
    retry_at: float
    backoff: float


def _pipelined(
    client: redis.Redis,
    indices: list[int],
    add: Callable[[Pipeline, int], object],
    *,
    asking: bool,
) -> list[Any]:
    """The replies of the commands ``add`` queues for ``indices``, in one pipelined round trip
    on ``client`` (each preceded by ``ASKING`` if ``asking``); a round trip that failed as a
    whole gives its exception for every command."""
    pipe = client.pipeline(transaction=False)
    for i in indices:
        if asking:
            pipe.execute_command("ASKING")
        add(pipe, i)
    try:
        out = pipe.execute(raise_on_error=False)
    except Exception as e:
        return [e] * len(indices)
    finally:
        pipe.reset()  # drop the queued arguments (they may reference primary rows)
    # After ASKING, a command's reply is the second of its pair.
    return out[1::2] if asking else out


def _copy_value(value: bytes | Exception | None, dest: Destination) -> DirectReply:
    """Copy a value redis-py received into its destination (the path without ``get_into``)."""
    if value is None or isinstance(value, Exception):
        return value
    header, payload = dest
    if len(value) != len(header) + len(payload):
        return len(value)
    view = memoryview(value)
    header[:] = view[: len(header)]
    payload[:] = view[len(header) :]
    return True


def all_cut_off(replies: Sequence[Any]) -> BaseException | None:
    """The first error if every reply is an error saying its server cannot be used (``cuts_off``:
    unreachable, or refusing the credentials); None otherwise."""
    if replies and all(isinstance(r, BaseException) and cuts_off(r) for r in replies):
        first: BaseException = replies[0]
        return first
    return None
