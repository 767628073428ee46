# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Pipelined ``GET`` and ``SET`` rounds on one pooled connection, values moved in place.

* ``get_into``: replies are received straight into the buffers they belong in. redis-py's reply
  parser (hiredis) gathers a bulk reply in its own buffer and then copies it into a new ``bytes``
  object, which the tier then copied into the primary row: three copies of every loaded byte, and
  most of a 256 KiB load's client time (measured in docs/benchmarks.md). Here the socket's bytes
  land in the block's header buffer and its primary row directly: one copy, made by the kernel.
  Only the replies a ``GET`` can give are read here: a bulk string (``$<len>``), nil (``$-1``),
  or an error (``-<KIND> message``, mapped to redis-py's exception classes, e.g.
  ``MovedError``). Anything else is a protocol error that drops the connection. Connections
  speaking RESP3 are left to redis-py's pipeline (``direct_get_supported`` is False for them).
* ``set_streamed``: each ``SET`` is sent as soon as its value is made (the block's header, whose
  checksum is one pass over the row), and the replies are read once all are sent. A redis-py
  pipeline packs every command of the round before sending the first, so the server would sit
  idle while the whole round is checksummed; streamed, it stores one value while the next is
  checksummed.

Everything else about the connection (connect, ``AUTH``, ``SELECT``, TLS, timeouts, pooling,
packing commands, parsing the ``SET`` replies) stays redis-py's: commands go out through a pooled
connection's ``send_packed_command``; only ``GET`` replies are read from its socket here.

Ownership: destination buffers and the rows inside values are borrowed from the caller for the
duration of the call. A ``GET`` value is written into its buffers as it arrives, before anything
checks it, so the caller owns verifying it (the redis tier checks header and checksum afterwards
and fails the job, whose rows the tiering manager then frees, never serving them). Whatever
happens, the connection goes back to its pool either fully read or disconnected, never with
unread replies in it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import redis
import redis.exceptions as rexc
from redis._parsers.base import BaseParser

_BUFFER_BYTES = 16 << 10
"""Read buffer for reply lines: small, since the bytes of a value that land in it are copied once
more (a value's first bytes arrive with its length line), while the rest goes straight to its
destination."""

Destination = tuple[memoryview, memoryview]
"""Where one value goes: its first ``len(d[0])`` bytes (the block header), then ``len(d[1])``
bytes (the payload, a primary row). Both writable, contiguous, 1-byte items."""

DirectReply = bool | int | None | Exception
"""One ``GET``'s outcome: True (the value filled its destination exactly), None (no such key),
an int (a value of that many bytes, not the destination's size: read and dropped), or the error
reply as an exception."""


def direct_get_supported(client: redis.Redis) -> bool:
    """Whether ``client``'s connections can be read by ``get_into``: they speak RESP2 (the tier's
    clients do unless their URL asks for ``protocol=3``; redis-py 8's own default is RESP3)."""
    return client.connection_pool.connection_kwargs.get("protocol") in (2, "2")


def get_into(
    client: redis.Redis, rkeys: Sequence[bytes], destinations: Sequence[Destination]
) -> list[DirectReply]:
    """One pipelined round trip of ``GET rkeys[i]``, value ``i`` received into ``destinations[i]``.

    A pooled connection the server closed meanwhile (e.g. after a restart) is replaced by the
    pool before it is used (redis-py checks a connection for pending data or EOF as it hands it
    out). A failure during the round is not retried: the job fails and the connector recomputes.

    Raises:
        redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: the server cannot be
            reached, or stopped answering (the connection is dropped).
        redis.exceptions.InvalidResponse: a reply ``GET`` cannot give.
    """
    if len(rkeys) != len(destinations):
        raise ValueError(f"{len(rkeys)} keys for {len(destinations)} destinations")
    with _connection(client) as conn:
        packed = conn.pack_commands([("GET", rkey) for rkey in rkeys])
        conn.send_packed_command(packed, check_health=False)
        return _read_replies(conn, destinations)


def set_streamed(
    client: redis.Redis,
    rkeys: Sequence[bytes],
    value: Callable[[int], object],
    *,
    px: int | None = None,
) -> list[object]:
    """One pipelined round trip of ``SET rkeys[i] value(i) [PX px]``, each command sent as soon
    as ``value(i)`` returns (see the module docstring).

    Returns:
        Per key: the reply (True for ``OK``), or the error reply as an exception (e.g. ``OOM``,
        ``READONLY``, ``MOVED``).

    Raises:
        redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: the server cannot be
            reached, or stopped answering (the connection is dropped).
    """
    extra: tuple[object, ...] = () if px is None else ("PX", px)
    with _connection(client) as conn:
        for i, rkey in enumerate(rkeys):
            conn.send_packed_command(conn.pack_command("SET", rkey, value(i), *extra), False)
        replies: list[object] = []
        for _ in rkeys:
            try:
                replies.append(conn.read_response() in (b"OK", "OK", True))
            except rexc.ResponseError as e:  # the reply was read whole: the stream is intact
                replies.append(e)
        return replies


@contextmanager
def _connection(client: redis.Redis) -> Iterator[redis.Connection]:
    """A connection of ``client``'s pool, dropped if the block raises (replies may be left
    unread: never reuse that stream), returned to the pool in any case."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _read_replies(conn: redis.Connection, destinations: Sequence[Destination]) -> list[DirectReply]:
    sock = conn._sock  # the connection's socket: redis-py's own parser reads this one too
    if sock is None:
        raise rexc.ConnectionError("connection closed before the replies were read")
    path = getattr(conn, "path", None)  # a unix socket connection's
    peer = path or f"{getattr(conn, 'host', '?')}:{getattr(conn, 'port', '?')}"
    reader = _ReplyReader(sock, peer)
    try:
        return [reader.bulk_into(header, payload) for header, payload in destinations]
    except TimeoutError as e:  # socket.timeout
        raise rexc.TimeoutError(f"timeout reading replies from {reader.peer}") from e
    except OSError as e:
        raise rexc.ConnectionError(f"error reading replies from {reader.peer}: {e}") from e


class _ReplyReader:
    """Reads RESP2 replies of ``GET`` from a socket, values straight into their destinations."""

    __slots__ = ("_buf", "_end", "_pos", "_sock", "_view", "peer")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self._buf = bytearray(_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self.peer = peer

    def bulk_into(self, header: memoryview, payload: memoryview) -> DirectReply:
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            try:
                size = int(line[1:])
            except ValueError:
                raise rexc.InvalidResponse(f"bad bulk length from {self.peer}: {line!r}") from None
            if size < 0:
                return None
            if size == len(header) + len(payload):
                self._read_into(header)
                self._read_into(payload)
                reply: DirectReply = True
            else:
                self._skip(size)
                reply = size
            while self._end - self._pos < 2:
                self._fill()
            if self._buf[self._pos : self._pos + 2] != b"\r\n":
                raise rexc.InvalidResponse(f"bulk reply from {self.peer} not followed by CRLF")
            self._pos += 2
            return reply
        if kind == b"-":
            return BaseParser.parse_error(line[1:].decode("utf-8", "replace"))
        raise rexc.InvalidResponse(f"unexpected reply to GET from {self.peer}: {line[:64]!r}")

    def _fill(self) -> None:
        """Receive more bytes into the buffer (compacting it first if its end is reached)."""
        if self._pos == self._end:
            self._pos = self._end = 0
        elif self._end == len(self._buf):
            remaining = self._end - self._pos
            self._buf[:remaining] = self._buf[self._pos : self._end]
            self._pos, self._end = 0, remaining
        n = self._sock.recv_into(self._view[self._end :])
        if n == 0:
            raise rexc.ConnectionError(f"{self.peer} closed the connection")
        self._end += n

    def _line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            i = self._buf.find(b"\r\n", self._pos, self._end)
            if i >= 0:
                line = bytes(self._view[self._pos : i])
                self._pos = i + 2
                return line
            if self._pos == 0 and self._end == len(self._buf):
                raise rexc.InvalidResponse(f"reply line from {self.peer} too long")
            self._fill()

    def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest``: first from the buffer, then straight from the socket."""
        n = len(dest)
        have = min(n, self._end - self._pos)
        if have:
            dest[:have] = self._view[self._pos : self._pos + have]
            self._pos += have
        recv_into = self._sock.recv_into
        while have < n:
            got = recv_into(dest[have:])
            if got == 0:
                raise rexc.ConnectionError(f"{self.peer} closed the connection")
            have += got

    def _skip(self, n: int) -> None:
        """Read and drop ``n`` bytes (a value of the wrong size)."""
        scratch = memoryview(bytearray(min(n, 1 << 20) or 1))
        while n > 0:
            chunk = scratch[: min(n, len(scratch))]
            self._read_into(chunk)
            n -= len(chunk)
