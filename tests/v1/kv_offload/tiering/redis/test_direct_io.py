# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``direct_io``: the tier's own connections. GET replies received straight into their
destinations and never misread; SETs streamed; AUTH, SELECT and TLS; the fast path turned off,
with a reason, where it cannot serve the URL.

The reader is checked twice: against a socket pair fed one byte per send (every reply split at
every possible point), and against real servers (errors mid-pipeline, a restarted server, a
timed-out round whose late replies must never be taken for the next round's). Connection reuse is
checked from the server's side (its count of connections received).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import redis.exceptions as rexc

from tests.v1.kv_offload.tiering.redis.conftest import Engine, assert_shared
from tests.v1.kv_offload.tiering.redis.servers import RedisServer, free_port
from vllm.v1.kv_offload.tiering.redis.direct_io import (
    BUFFER_BYTES,
    Destination,
    DirectPool,
    Endpoint,
    RespReader,
    endpoint_from_url,
)


def _dest(header_bytes: int, payload_bytes: int) -> Destination:
    return memoryview(bytearray(header_bytes)), memoryview(bytearray(payload_bytes))


def _value(dest: Destination) -> bytes:
    return bytes(dest[0]) + bytes(dest[1])


def test_reader_parses_replies_split_at_every_byte() -> None:
    big = bytes(range(256)) * ((3 * BUFFER_BYTES) // 256 + 1)  # spans several buffers
    stream = b"".join(
        [
            b"$5\r\nhello\r\n",
            b"$-1\r\n",
            b"-MOVED 3999 127.0.0.1:7001\r\n",
            b"$3\r\nabc\r\n",  # of the wrong size: read and dropped
            b"$%d\r\n%s\r\n" % (len(big), big),
            b"$2\r\nok\r\n",
            b"+OK\r\n",
            b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
            b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
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
        reader = RespReader(ours, "pair")
        replies = [reader.bulk_into(h, p) for h, p in dests]
        statuses = [reader.status() for _ in range(3)]
    finally:
        writer.join()
        ours.close()
        theirs.close()
    assert replies[0] is True and _value(dests[0]) == b"hello"
    assert replies[1] is None
    assert isinstance(replies[2], rexc.MovedError) and replies[2].slot_id == 3999
    assert replies[3] == 3 and _value(dests[3]) == bytes(5), "a wrong-size value writes nothing"
    assert replies[4] is True and _value(dests[4]) == big
    assert replies[5] is True and _value(dests[5]) == b"ok"
    assert statuses[0] == b"OK"
    assert isinstance(statuses[1], rexc.OutOfMemoryError)
    assert type(statuses[2]) is rexc.ResponseError and str(statuses[2]).startswith("WRONGTYPE")


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
            RespReader(ours, "pair").bulk_into(*_dest(1, 2))
    finally:
        ours.close()
        theirs.close()


def test_reader_reports_a_closed_connection() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(b"$10\r\nabc")
    theirs.close()
    try:
        with pytest.raises(rexc.ConnectionError, match="closed the connection"):
            RespReader(ours, "pair").bulk_into(*_dest(5, 5))
    finally:
        ours.close()


def _pool(url: str, timeout_s: float = 1.0, password: str | None = None) -> DirectPool:
    """A pool made as the tier makes its own."""
    endpoint = endpoint_from_url(url, password, timeout_s)
    assert isinstance(endpoint, Endpoint), endpoint
    return DirectPool(endpoint)


def _connections_received(server: RedisServer) -> int:
    """Connections the server accepted so far, less the one asking."""
    client = server.client()
    try:
        return int(client.info("stats")["total_connections_received"]) - 1
    finally:
        client.close()


def test_error_reply_fails_only_its_key_and_the_connection_is_reused(server: RedisServer) -> None:
    admin = server.client()
    admin.set(b"a", b"HHpayload")
    admin.rpush(b"l", b"x")  # GET of a list: WRONGTYPE
    admin.set(b"c", b"hhPAYLOAD")
    admin.close()
    pool = _pool(server.url)
    dests = [_dest(2, 7) for _ in range(4)]
    replies = pool.get_into([b"a", b"l", b"missing", b"c"], dests)
    assert replies[0] is True and _value(dests[0]) == b"HHpayload"
    assert isinstance(replies[1], rexc.ResponseError) and "WRONGTYPE" in str(replies[1])
    assert replies[2] is None
    assert replies[3] is True and _value(dests[3]) == b"hhPAYLOAD"
    before = _connections_received(server)
    again = [_dest(2, 7)]
    assert pool.get_into([b"c"], again) == [True] and _value(again[0]) == b"hhPAYLOAD"
    assert _connections_received(server) == before + 1, "one round: no new connection"
    pool.close()


def test_restarted_server_is_reconnected_without_an_error(server: RedisServer) -> None:
    pool = _pool(server.url)
    dest = [_dest(1, 1)]
    assert pool.get_into([b"k"], dest) == [None]  # a pooled connection now exists
    server.kill()
    server.start()
    admin = server.client()
    admin.set(b"k", b"xy")
    admin.close()
    assert pool.get_into([b"k"], dest) == [True] and _value(dest[0]) == b"xy"
    pool.close()


def test_replies_of_a_timed_out_round_are_never_read_as_the_next_rounds(
    server: RedisServer,
) -> None:
    admin = server.client()
    admin.set(b"old", b"OLD")
    admin.set(b"new", b"NEW")
    pool = _pool(server.url, timeout_s=0.3)
    assert pool.get_into([b"old"], [_dest(1, 2)]) == [True]
    admin.client_pause(1000)  # the round's replies come late, after the timeout
    with pytest.raises(rexc.TimeoutError):
        pool.get_into([b"old"], [_dest(1, 2)])
    admin.client_unpause()
    before = _connections_received(server)
    dest = [_dest(1, 2)]
    assert pool.get_into([b"new"], dest) == [True]
    assert _value(dest[0]) == b"NEW", "a late reply of the timed-out round was taken"
    # The timed-out connection was dropped, not pooled (a late reply could still come in).
    assert _connections_received(server) == before + 2
    pool.close()
    admin.close()


def test_streamed_sets_report_refusals_per_key_and_keep_the_connection(
    server: RedisServer,
) -> None:
    admin = server.client()
    admin.set(b"filler", b"x" * (3 << 20))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1 << 20)  # already over it: every write is refused (OOM)
    pool = _pool(server.url)
    made: list[int] = []
    row = memoryview(bytearray(b"R" * 100_000))  # large: sent from where it is

    def value(i: int) -> tuple[bytes, memoryview]:
        made.append(i)
        return b"v%d:" % i, row

    replies = pool.set_streamed([b"a", b"b", b"c"], value, px=60_000)
    assert made == [0, 1, 2]
    assert all(isinstance(r, rexc.OutOfMemoryError) for r in replies), replies
    admin.config_set("maxmemory", 0)
    before = _connections_received(server)
    assert pool.set_streamed([b"a", b"b"], value, px=60_000) == [True, True]
    assert _connections_received(server) == before + 1, "the same connection"
    assert admin.get(b"b") == b"v1:" + bytes(row) and 0 < admin.pttl(b"b") <= 60_000
    pool.close()
    admin.close()


def test_auth_and_select_on_the_tiers_own_connections(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "pw", password="pw-for-direct-io")
    try:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "alice", "on", ">alice-pw", "~*", "+@all")
        pool = _pool(f"redis://alice:alice-pw@127.0.0.1:{server.port}/3")
        assert pool.set_streamed([b"k"], lambda i: (b"in db 3",)) == [True]
        assert admin.get(b"k") is None
        admin.select(3)
        assert admin.get(b"k") == b"in db 3"
        pool.close()
        by_file = _pool(server.url, password="pw-for-direct-io")  # from password_file
        dest = [_dest(2, 5)]
        assert by_file.get_into([b"k"], dest) == [None], "db 0 by default"
        by_file.close()
        wrong = _pool(f"redis://alice:nope@127.0.0.1:{server.port}")
        with pytest.raises(rexc.AuthenticationError):
            wrong.get_into([b"k"], [_dest(1, 1)])
        wrong.close()
        missing = _pool(server.url)
        (noauth,) = missing.get_into([b"k"], [_dest(1, 1)])  # the reply: NOAUTH
        assert isinstance(noauth, rexc.AuthenticationError)
        missing.close()
        admin.close()
    finally:
        server.stop()


def _make_certs(workdir: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 (openssl); skips without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip(
            "openssl is not installed: install it (apt-get install openssl) for the TLS test"
        )
    ca_key, ca, key, csr, cert = (
        workdir / n for n in ("ca.key", "ca.pem", "s.key", "s.csr", "s.pem")
    )
    ext = workdir / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args: object) -> None:
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca,
        "-days", "1", "-subj", "/CN=kvo-test-ca")  # fmt: skip
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
        "-subj", "/CN=127.0.0.1")  # fmt: skip
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
        "-out", cert, "-days", "1", "-extfile", ext)  # fmt: skip
    return ca, cert, key


def test_tls_rediss_urls_are_served_by_the_tiers_own_connections(
    tmp_path: Path, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    ca, cert, key = _make_certs(tmp_path)
    port = free_port()
    server = RedisServer(
        tmp_path / "tls",
        "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
    )  # fmt: skip
    try:
        url = f"rediss://127.0.0.1:{port}?ssl_ca_certs={ca}"
        writer, reader = Engine(tmp_path / "w", url), Engine(tmp_path / "r", url)
        engines += [writer, reader]
        assert_shared(writer, reader, 3)
        # Without the CA the server's certificate is refused: a connection error, no data.
        untrusted = _pool(f"rediss://127.0.0.1:{port}")
        with pytest.raises(rexc.ConnectionError, match="TLS"):
            untrusted.get_into([b"k"], [_dest(1, 1)])
        untrusted.close()
        assert not [r for r in caplog.records if "go through redis-py" in r.getMessage()]
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("query", "reason"),
    [("protocol=3", "protocol=3"), ("client_name=x", "client_name")],
)
def test_urls_the_own_connections_cannot_serve_fall_back_to_redis_py_bit_exact(
    tmp_path: Path,
    server: RedisServer,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
    query: str,
    reason: str,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    writer = Engine(tmp_path / "w", f"{server.url}?{query}")
    reader = Engine(tmp_path / "r", f"{server.url}?{query}")
    engines += [writer, reader]
    fallback = [r.getMessage() for r in caplog.records if "go through redis-py" in r.getMessage()]
    assert len(fallback) == 2 and reason in fallback[0]
    assert_shared(writer, reader, 3)
