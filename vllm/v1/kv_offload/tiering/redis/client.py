# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's connection to the server: client construction, zero-copy values, errors.

Client settings (measured on redis-py 8, see docs/redis_tier.md):

* **Fail fast.** One retry without back-off (a pooled connection the server closed, e.g. after a
  restart, is reopened once), connect and socket timeouts of ``timeout_s``. redis-py's defaults
  (10 retries with exponential back-off, 5 s timeouts) would hold a job for seconds against a
  dead server; the tier's circuit breaker does the waiting instead.
* **Values are sent without joining them.** ``BlockValue`` carries a block's header and its
  primary row; ``BlockPacker`` writes them as one RESP bulk string, header bytes then the row's
  memoryview, so the 2 MiB row goes from the primary region to the socket with no Python copy.
  hiredis's packer (redis-py's default) would convert the memoryview to bytes and concatenate
  (two copies: SET ran at about a third of the speed).
  The cluster client does not accept a packer, so there a value is joined once into bytes.
* **Values are received without copying them either.** ``GET`` replies are read from the
  connection's socket straight into the block's header buffer and primary row
  (``direct_io``), not through hiredis, which would gather each value in its buffer, then copy
  it into a ``bytes`` object that the tier copied again into the row. Other replies are parsed by
  hiredis, with a larger read buffer (256 KiB instead of 64 KiB).
* **Cluster: one pipeline per master** (``Router``). redis-py's cluster pipeline raises as a whole
  when one master is down; the tier groups keys by the master of their slot itself, so the keys of
  the masters that are up keep being served while the others miss. Because the tier bypasses the
  cluster client's command path, it follows redirections itself, once each: ``ASK`` (the slot is
  being migrated and the key is already on the target) resends the command to the target after
  ``ASKING``, and ``MOVED`` (the slot belongs to another master now: a resharding or a failover)
  reloads the slot map and resends the command to the new owner. A second redirection of the same
  command is its reply (an error: the job fails or the key misses).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.cluster import RedisCluster
from redis.connection import ConnectionPool, Encoder, PythonRespSerializer
from redis.retry import Retry
from typing_extensions import override

from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.direct_io import (
    Destination,
    DirectReply,
    direct_get_supported,
    get_into,
    set_streamed,
)

RedisClient = redis.Redis | RedisCluster
"""A standalone or a cluster client (both thread-safe; their pipelines are not)."""

SOCKET_READ_SIZE = 256 << 10
_NODE_RETRY_S = 1.0
"""How long a cluster master found unreachable is skipped before the next attempt."""
_BUFFER_CUTOFF = 6000  # redis-py's: arguments above it are sent as separate chunks


class BlockValue:
    """One block's value, in two pieces: its header and its payload (a primary row).

    Ownership: ``payload`` is borrowed from the primary region; the caller keeps the row pinned
    until the command that carries the value has been sent (the pipeline's ``execute``).
    """

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + len(self.payload)

    def join(self) -> bytes:
        """The value as one bytes object (one copy; for clients that take no ``BlockPacker``)."""
        return b"".join((self.header, self.payload))


class BlockPacker(PythonRespSerializer):
    """redis-py's pure-Python command packer, taught to send a ``BlockValue`` in pieces.

    Each ``BlockValue`` argument becomes ``$<len>\\r\\n`` + header (small, joined with the
    command's other small parts) followed by the payload memoryview, which redis-py's
    ``pack_commands`` hands to ``sendall`` as is. Other arguments are packed as usual.
    """

    def __init__(self) -> None:
        self._encoder = Encoder(encoding="utf-8", encoding_errors="strict", decode_responses=False)
        super().__init__(_BUFFER_CUTOFF, self._encoder.encode)

    @override
    def pack(self, *args: Any) -> list[Any]:
        if not any(isinstance(arg, BlockValue) for arg in args):
            return list(super().pack(*args))
        name = args[0].encode().split() if isinstance(args[0], str) else [args[0]]
        parts = [*name, *args[1:]]
        output: list[Any] = []
        buff = b"*%d\r\n" % len(parts)
        for arg in parts:
            if isinstance(arg, BlockValue):
                output.append(buff + b"$%d\r\n" % len(arg) + arg.header)
                output.append(arg.payload)
                buff = b"\r\n"
            else:
                data = self._encoder.encode(arg)
                buff = b"".join((buff, b"$%d\r\n" % len(data), data, b"\r\n"))
        output.append(buff)
        return output


def make_client(config: RedisTierConfig) -> RedisClient:
    """Create the client for ``config`` (standalone: lazy, connects on first use; cluster:
    contacts the cluster now to load the slot map).

    Raises:
        redis.exceptions.RedisError: the cluster cannot be reached or is not a cluster.
    """
    common: dict[str, Any] = {
        "socket_timeout": config.timeout_s,
        "socket_connect_timeout": config.timeout_s,
        "socket_read_size": SOCKET_READ_SIZE,
        "health_check_interval": 0,
        # RESP2, which every Redis and Valkey server speaks (redis-py 8 defaults to RESP3): the
        # tier needs nothing of RESP3, and direct_io reads RESP2 GET replies itself. A URL's
        # ``?protocol=3`` still wins; GETs then go through redis-py's parser.
        "protocol": 2,
    }
    if config.cluster:
        return RedisCluster.from_url(
            config.url,
            retry=Retry(NoBackoff(), 1),
            require_full_coverage=False,
            **common,
        )
    pool = ConnectionPool.from_url(
        config.url, command_packer=BlockPacker(), retry=Retry(NoBackoff(), 1), **common
    )
    return redis.Redis(connection_pool=pool)


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the server (or the cluster as a whole) cannot be reached: a refused
    or reset connection, a timeout, or a cluster that is down. These open the circuit breaker;
    other errors (OOM, READONLY, MOVED, a bad reply) only fail the job."""
    return isinstance(
        exc, (rexc.ConnectionError, rexc.TimeoutError, rexc.ClusterDownError, OSError)
    ) and not isinstance(exc, rexc.ResponseError)


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is the server refusing a write at ``maxmemory`` (``noeviction`` or a
    ``volatile-*`` policy with nothing to evict)."""
    return isinstance(exc, rexc.OutOfMemoryError) or (
        isinstance(exc, rexc.ResponseError) and str(exc).startswith("OOM")
    )


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
    (see the module docstring). Thread-safe (the lookup and I/O threads share it): clients are
    thread-safe and each call builds its own pipelines.

    Attributes:
        client: the standalone or cluster client.
        zero_copy: whether values may be passed as ``BlockValue`` (``BlockPacker`` installed).
    """

    def __init__(self, config: RedisTierConfig) -> None:
        self.client: RedisClient = make_client(config)
        self.zero_copy = not config.cluster
        self._stale_slots = False
        self._refresh_lock = threading.Lock()
        # Cluster: masters found unreachable, by name, and when to try each again. Their keys
        # fail at once meanwhile (no connect attempt per batch); replaced whole, never mutated.
        self._down: dict[str, float] = {}

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

        def direct(client: redis.Redis, group: list[int]) -> list[DirectReply]:
            if not direct_get_supported(client):
                out = _pipelined(client, group, add, asking=False)
                return [convert(i, r) for i, r in zip(group, out, strict=True)]
            return get_into(client, [rkeys[i] for i in group], [destinations[i] for i in group])

        return self._run(rkeys, add, direct, convert)

    def set_streamed(
        self, rkeys: Sequence[bytes], value: Callable[[int], object], *, px: int | None
    ) -> list[Any]:
        """``SET rkeys[i] value(i) [PX px]`` for every key, each sent as soon as its value is
        made (see ``direct_io.set_streamed``), one round trip per server; redirected commands
        as ``execute`` (``value(i)`` is then called again).

        Returns:
            Per key: True, or the exception of a failed command or server, as ``execute``.
        """

        def add(pipe: Pipeline, i: int) -> None:
            pipe.set(rkeys[i], value(i), px=px)  # type: ignore[arg-type]

        def direct(client: redis.Redis, group: list[int]) -> list[Any]:
            keys = [rkeys[i] for i in group]
            return set_streamed(client, keys, lambda j: value(group[j]), px=px)

        return self._run(rkeys, add, direct)

    def _run(
        self,
        rkeys: Sequence[bytes],
        add: Callable[[Pipeline, int], object],
        direct: Callable[[redis.Redis, list[int]], list[Any]] | None = None,
        convert: Callable[[int, Any], Any] | None = None,
    ) -> list[Any]:
        """One command per key, sent to the server that owns it, redirections followed once.

        Args:
            add: queues key ``i``'s command on a pipeline (redirected commands always go this
                way).
            direct: runs the commands of ``group`` (indices of keys of one server) on that
                server's client and returns their replies; None: a pipeline of ``add``.
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
        direct: Callable[[redis.Redis, list[int]], list[Any]] | None,
        convert: Callable[[int, Any], Any] | None,
        replies: list[Any],
    ) -> None:
        """One round trip per master for the commands of ``indices`` (then one per ``ASK``
        target), each reply stored at its index in ``replies``."""
        asked: dict[tuple[str, int], list[int]] = {}
        for name, client, group in self._groups(rkeys, indices):
            retry_at = self._down.get(name)
            if retry_at is not None and time.monotonic() < retry_at:
                down = rexc.ConnectionError(f"cluster master {name} is unreachable")
                for i in group:
                    replies[i] = down
                continue
            if direct is None:
                out = _pipelined(client, group, add, asking=False)
            else:
                try:
                    out = direct(client, group)
                except Exception as e:
                    out = [e] * len(group)
            for i, reply in zip(group, out, strict=True):
                replies[i] = reply
                if isinstance(reply, rexc.MovedError):
                    self._stale_slots = True
                elif isinstance(reply, rexc.AskError):
                    asked.setdefault((reply.host, int(reply.port)), []).append(i)
            if name:
                self._mark(name, down=all_unreachable(out) is not None)
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
        exc = all_unreachable(replies)
        if exc is None or not isinstance(self.client, RedisCluster):
            return exc
        masters = {node.name for node in self.client.get_primaries()}
        return exc if masters <= set(self._down) else None

    def _mark(self, name: str, *, down: bool) -> None:
        if down == (name in self._down):
            return
        marked = dict(self._down)
        if down:
            marked[name] = time.monotonic() + _NODE_RETRY_S
        else:
            del marked[name]
        self._down = marked

    def value(self, value: BlockValue) -> BlockValue | bytes:
        """What to pass as a SET value: the two pieces where ``BlockPacker`` packs them, one
        joined bytes object otherwise (the cluster's node clients)."""
        return value if self.zero_copy else value.join()

    def ping(self) -> None:
        """Raises unless the server (a cluster: every master it knows, reloading the slot map
        first) answers."""
        if isinstance(self.client, RedisCluster):
            self.client.nodes_manager.initialize()
            self._down = {}
        self.client.ping()

    def close(self) -> None:
        close_client(self.client)

    def _groups(
        self, rkeys: Sequence[bytes], indices: Iterable[int]
    ) -> list[tuple[str, redis.Redis, list[int]]]:
        """``(master name, its client, those of indices that are its keys)``; the name is ""
        standalone."""
        client = self.client
        if not isinstance(client, RedisCluster):
            return [("", client, list(indices))]
        self._reload_slot_map()  # a no-op unless a MOVED marked it stale
        nodes = client.nodes_manager
        groups: dict[str, tuple[str, redis.Redis, list[int]]] = {}
        for i in indices:
            node = nodes.get_node_from_slot(client.keyslot(rkeys[i]))
            group = groups.get(node.name)
            if group is None:
                conn = node.redis_connection or client.get_redis_connection(node)
                group = groups[node.name] = (node.name, conn, [])
            group[2].append(i)
        return list(groups.values())


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


def all_unreachable(replies: Sequence[Any]) -> BaseException | None:
    """The first error if every reply is an error saying its server cannot be reached (the whole
    server, or every master of a cluster, is down); None otherwise."""
    if replies and all(isinstance(r, BaseException) and is_unreachable(r) for r in replies):
        first: BaseException = replies[0]
        return first
    return None
