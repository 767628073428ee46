# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``direct_io``: GET replies received straight into their destinations, never misread.

The reader is checked twice: against a socket pair fed one byte per send (every reply split at
every possible point), and against a real server (errors mid-pipeline, a restarted server, a
timed-out round whose late replies must never be taken for the next round's).
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest
import redis
import redis.exceptions as rexc

from tests.v1.kv_offload.tiering.redis.conftest import Engine, key_of
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.redis.client import make_client
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.direct_io import (
    _BUFFER_BYTES,
    Destination,
    _ReplyReader,
    direct_get_supported,
    get_into,
    set_streamed,
)


def _dest(header_bytes: int, payload_bytes: int) -> Destination:
    return memoryview(bytearray(header_bytes)), memoryview(bytearray(payload_bytes))


def _value(dest: Destination) -> bytes:
    return bytes(dest[0]) + bytes(dest[1])


def test_reader_parses_replies_split_at_every_byte() -> None:
    big = bytes(range(256)) * ((3 * _BUFFER_BYTES) // 256 + 1)  # spans several buffers
    stream = b"".join(
        [
            b"$5\r\nhello\r\n",
            b"$-1\r\n",
            b"-MOVED 3999 127.0.0.1:7001\r\n",
            b"$3\r\nabc\r\n",  # of the wrong size: read and dropped
            b"$%d\r\n%s\r\n" % (len(big), big),
            b"$2\r\nok\r\n",
        ]
    )
    dests = [_dest(2, 3), _dest(2, 3), _dest(2, 3), _dest(2, 3), _dest(100, len(big) - 100)]
    dests.append(_dest(1, 1))
    ours, theirs = socket.socketpair()

    def feed() -> None:
        for i in range(len(stream)):
            theirs.sendall(stream[i : i + 1])

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        ours.settimeout(30)
        reader = _ReplyReader(ours, "pair")
        replies = [reader.bulk_into(h, p) for h, p in dests]
    finally:
        writer.join()
        ours.close()
        theirs.close()
    assert replies[0] is True and _value(dests[0]) == b"hello"
    assert replies[1] is None
    assert isinstance(replies[2], rexc.MovedError)
    assert replies[3] == 3 and _value(dests[3]) == bytes(5), "a wrong-size value writes nothing"
    assert replies[4] is True and _value(dests[4]) == big
    assert replies[5] is True and _value(dests[5]) == b"ok"


@pytest.mark.parametrize(
    "stream",
    [b"+OK\r\n", b":12\r\n", b"$x\r\n", b"$3\r\nabcXY"],
    ids=["status", "integer", "bad-length", "no-crlf-after-value"],
)
def test_reader_rejects_what_get_cannot_reply(stream: bytes) -> None:
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(stream)
        ours.settimeout(10)  # a reader waiting for more bytes fails the test instead of hanging
        with pytest.raises(rexc.InvalidResponse):
            _ReplyReader(ours, "pair").bulk_into(*_dest(1, 2))
    finally:
        ours.close()
        theirs.close()


def test_reader_reports_a_closed_connection() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(b"$10\r\nabc")
    theirs.close()
    try:
        with pytest.raises(rexc.ConnectionError, match="closed the connection"):
            _ReplyReader(ours, "pair").bulk_into(*_dest(5, 5))
    finally:
        ours.close()


def _client(server: RedisServer, timeout_s: float = 1.0) -> redis.Redis:
    """A client made as the tier makes its own."""
    client = make_client(RedisTierConfig(url=server.url, timeout_s=timeout_s))
    assert isinstance(client, redis.Redis)
    return client


def test_error_reply_fails_only_its_key_and_the_connection_is_reused(server: RedisServer) -> None:
    admin = server.client()
    admin.set(b"a", b"HHpayload")
    admin.rpush(b"l", b"x")  # GET of a list: WRONGTYPE
    admin.set(b"c", b"hhPAYLOAD")
    client = _client(server)
    assert direct_get_supported(client)
    dests = [_dest(2, 7) for _ in range(4)]
    replies = get_into(client, [b"a", b"l", b"missing", b"c"], dests)
    assert replies[0] is True and _value(dests[0]) == b"HHpayload"
    assert isinstance(replies[1], rexc.ResponseError) and "WRONGTYPE" in str(replies[1])
    assert replies[2] is None
    assert replies[3] is True and _value(dests[3]) == b"hhPAYLOAD"
    pool = client.connection_pool
    (conn,) = pool._available_connections  # back in the pool, fully read
    again = [_dest(2, 7)]
    assert get_into(client, [b"c"], again) == [True] and _value(again[0]) == b"hhPAYLOAD"
    assert pool._available_connections == [conn], "the same connection served the next round"
    client.close()
    admin.close()


def test_restarted_server_is_reconnected_without_an_error(server: RedisServer) -> None:
    client = _client(server)
    dest = [_dest(1, 1)]
    assert get_into(client, [b"k"], dest) == [None]  # a pooled connection now exists
    server.kill()
    server.start()
    server.client().set(b"k", b"xy")
    assert get_into(client, [b"k"], dest) == [True] and _value(dest[0]) == b"xy"
    client.close()


def test_replies_of_a_timed_out_round_are_never_read_as_the_next_rounds(
    server: RedisServer,
) -> None:
    admin = server.client()
    admin.set(b"old", b"OLD")
    admin.set(b"new", b"NEW")
    client = _client(server, timeout_s=0.3)
    admin.client_pause(1000)  # the round's replies come late, after the timeout
    with pytest.raises(rexc.TimeoutError):
        get_into(client, [b"old"], [_dest(1, 2)])
    # Dropped, not pooled with a reply still to come (the pool's own check for pending data
    # would miss a reply that arrives after it looked).
    assert all(c._sock is None for c in client.connection_pool._available_connections)
    admin.client_unpause()
    dest = [_dest(1, 2)]
    assert get_into(client, [b"new"], dest) == [True]
    assert _value(dest[0]) == b"NEW", "a late reply of the timed-out round was taken"
    client.close()
    admin.close()


def test_resp3_clients_fall_back_to_redis_py_and_stay_bit_exact(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    writer = Engine(tmp_path / "w", server.url)
    reader = Engine(tmp_path / "r", server.url + "?protocol=3")
    engines += [writer, reader]
    assert not direct_get_supported(reader.tier.client)  # type: ignore[arg-type]
    keys = [key_of(i) for i in range(3)]
    ctx, req = ReqContext("w"), ReqContext("r")
    writer.manager.on_new_request(ctx)
    writer.store(keys, ctx)
    reader.manager.on_new_request(req)
    assert reader.promote(keys, req) == [True] * 3
    reader.assert_cpu_holds(keys, req)


def test_streamed_sets_report_refusals_per_key_and_keep_the_connection(
    server: RedisServer,
) -> None:
    admin = server.client()
    admin.set(b"filler", b"x" * (3 << 20))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1 << 20)  # already over it: every write is refused (OOM)
    client = _client(server)
    made: list[int] = []

    def value(i: int) -> bytes:
        made.append(i)
        return b"v%d" % i

    replies = set_streamed(client, [b"a", b"b", b"c"], value, px=60_000)
    assert made == [0, 1, 2]
    assert all(isinstance(r, rexc.OutOfMemoryError) for r in replies), replies
    (conn,) = client.connection_pool._available_connections  # fully read, pooled
    admin.config_set("maxmemory", 0)
    assert set_streamed(client, [b"a", b"b"], value, px=60_000) == [True, True]
    assert client.connection_pool._available_connections == [conn], "the same connection"
    assert admin.get(b"b") == b"v1" and 0 < admin.pttl(b"b") <= 60_000
    client.close()
    admin.close()
