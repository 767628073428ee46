# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The tier's own connections for the data path: GETs received into rows, SETs sent from rows.

Why the tier opens connections of its own for ``GET`` and ``SET``: a block's bytes should cross
the client once, by the kernel. redis-py offers no public way to receive a reply into a buffer of
the caller's (its parser, hiredis, gathers a bulk reply in its own buffer and copies it into a new
``bytes`` object, which the tier then copied into the primary row: three copies of every loaded
byte and most of a 256 KiB load's client time, see docs/benchmarks.md), and its default packer
(hiredis's) copies a memoryview argument twice to build the command. So:

* ``DirectConnection.get_into``: one pipelined round trip of ``GET``; each reply is received from
  the socket straight into the block's header buffer and its primary row (``RespReader``).
* ``DirectConnection.set_streamed``: one pipelined round trip of ``SET``; each command is sent as
  soon as its value is made (the block's header, whose checksum is one pass over the row), the
  row from the primary region with no copy, and the replies are read once all are sent, so the
  server stores one value while the next is checksummed.

What a connection does (``DirectConnection``): TCP (``TCP_NODELAY``), a Unix socket, or TLS for
``rediss://`` (the ``ssl`` module; the system's CAs and host-name check unless the URL's
``ssl_*`` arguments say otherwise), then ``AUTH`` (user name and password from the URL or the
tier's ``password_file``) and ``SELECT`` (the URL's database), with the tier's ``timeout_s`` on the
connect and on every send and receive. It speaks only the RESP2 these commands need: bulk strings,
nil, simple strings and errors, the latter mapped to redis-py's public exception classes
(``MOVED`` -> ``MovedError``, ``NOAUTH`` -> ``AuthenticationError``, ...). Anything else is a
protocol error that drops the connection.

Where the URL asks for something this does not do (``protocol=3``, a query argument it does not
know), ``endpoint_from_url`` says why, the tier logs it once and sends GETs and SETs through
redis-py's pipelines instead (one more copy of each value, same results). Everything else
(``EXISTS``, ``DEL``, ``PING``, ``INFO``, a cluster's slot map, redirected commands) always goes
through redis-py's public API.

Ownership and threading: a ``DirectPool`` belongs to one tier and is used by its I/O thread (it is
thread-safe nevertheless). Destination buffers and the rows inside values are borrowed from the
caller for the duration of a call. A ``GET`` value is written into its buffers as it arrives,
before anything checks it, so the caller owns verifying it (the redis tier checks header and
checksum afterwards and fails the job, whose rows the tiering manager then frees, never serving
them). Whatever happens, a connection goes back to its pool fully read, or is closed, never with
unread replies in it.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.exceptions as rexc

BUFFER_BYTES = 16 << 10
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

_SMALL_ARG_BYTES = 64 << 10
"""Arguments up to this size are joined with the command's other small parts into one send;
larger ones (a row) are sent from where they are."""

# Error codes of the replies the data path can meet, as redis-py's public exception classes.
# The message given to the class is what follows the code, as redis-py's own parser does, except
# for the classes that keep the full text (a plain ResponseError: "WRONGTYPE ...").
_ERRORS: dict[str, type[rexc.ResponseError] | type[rexc.ConnectionError]] = {
    "MOVED": rexc.MovedError,
    "ASK": rexc.AskError,
    "TRYAGAIN": rexc.TryAgainError,
    "CLUSTERDOWN": rexc.ClusterDownError,
    "MASTERDOWN": rexc.MasterDownError,
    "CROSSSLOT": rexc.ClusterCrossSlotError,
    "OOM": rexc.OutOfMemoryError,
    "READONLY": rexc.ReadOnlyError,
    "NOPERM": rexc.NoPermissionError,
    "NOAUTH": rexc.AuthenticationError,
    "WRONGPASS": rexc.AuthenticationError,
    "LOADING": rexc.BusyLoadingError,
}

# URL query arguments a direct connection understands; any other turns the fast path off (with the
# argument named), since it may change how redis-py connects in a way these connections would not.
_SSL_CERT_REQS = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}
_KNOWN_QUERY = {
    "db",
    "password",
    "protocol",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_check_hostname",
}


def parse_error(message: str) -> Exception:
    """The exception for the error reply ``message`` (without its leading ``-``)."""
    code, _, rest = message.partition(" ")
    cls = _ERRORS.get(code)
    if cls is None:
        return rexc.ResponseError(message)
    return cls(rest)


@dataclass(frozen=True)
class Endpoint:
    """Where and how a direct connection connects (see the module docstring).

    Attributes:
        host, port: a TCP server (None for a Unix socket).
        path: a Unix socket (None for TCP).
        username, password: for ``AUTH`` (None: no ``AUTH``); never printed.
        db: the database to ``SELECT`` (0: none sent).
        tls: the TLS context for ``rediss://``; None for plain TCP or a Unix socket.
        check_hostname: whether TLS checks the server's name against its certificate.
        timeout_s: connect, send and receive timeout.
    """

    host: str | None
    port: int | None
    path: str | None
    username: str | None = field(repr=False)
    password: str | None = field(repr=False)
    db: int
    tls: ssl.SSLContext | None
    check_hostname: bool
    timeout_s: float

    @property
    def address(self) -> str:
        """``host:port`` or the socket path (what errors name)."""
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    def at(self, host: str, port: int) -> Endpoint:
        """The same settings for another server (a cluster's other master)."""
        return replace(self, host=host, port=port)


def endpoint_from_url(url: str, password: str | None, timeout_s: float) -> Endpoint | str:
    """The endpoint of the tier's URL (and ``password_file``'s password), or, where a direct
    connection cannot serve it, the reason (for the log; it never contains a credential).

    Raises:
        ValueError: an ``ssl_*`` argument of an invalid value (redis-py would refuse it too).
    """
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    unknown = sorted(set(query) - _KNOWN_QUERY)
    if unknown:
        return f"the URL's query argument(s) {', '.join(unknown)}"
    if query.get("protocol", "2") not in ("2", ""):
        return f"protocol={query['protocol']} (direct connections speak RESP2)"
    if parts.password:
        password = unquote(parts.password)
    elif "password" in query:
        password = query["password"]
    db_text = query.get("db") or (parts.path.strip("/") if parts.scheme != "unix" else "")
    try:
        db = int(db_text) if db_text else 0
    except ValueError:
        return f"database {db_text!r} is not a number"
    tls = None
    check_hostname = False
    if parts.scheme == "rediss":
        tls, check_hostname = _tls_context(query)
    elif any(k.startswith("ssl_") for k in query):
        return "ssl_* arguments without rediss://"
    return Endpoint(
        host=None if parts.scheme == "unix" else parts.hostname,
        port=None if parts.scheme == "unix" else (parts.port or 6379),
        path=unquote(parts.path) if parts.scheme == "unix" else None,
        username=unquote(parts.username) if parts.username else None,
        password=password,
        db=db,
        tls=tls,
        check_hostname=check_hostname,
        timeout_s=timeout_s,
    )


def _tls_context(query: dict[str, str]) -> tuple[ssl.SSLContext, bool]:
    """The TLS context of a ``rediss://`` URL's ``ssl_*`` arguments, with redis-py's defaults:
    certificates required and the host name checked."""
    reqs_text = query.get("ssl_cert_reqs", "required").lower()
    if reqs_text not in _SSL_CERT_REQS:
        raise ValueError(f"ssl_cert_reqs={reqs_text!r}: expected none, optional or required")
    reqs = _SSL_CERT_REQS[reqs_text]
    check = query.get("ssl_check_hostname", "true").lower() in ("1", "true", "yes", "on")
    context = ssl.create_default_context(
        cafile=query.get("ssl_ca_certs"), capath=query.get("ssl_ca_path")
    )
    context.check_hostname = check and reqs != ssl.CERT_NONE
    context.verify_mode = reqs
    if "ssl_certfile" in query:
        context.load_cert_chain(query["ssl_certfile"], query.get("ssl_keyfile"))
    return context, context.check_hostname


class DirectConnection:
    """One connection of the tier's own to one server, ready for ``GET``/``SET`` rounds.

    Not thread-safe: one round at a time (the pool hands it to one caller).
    """

    def __init__(self, endpoint: Endpoint) -> None:
        """Connect, authenticate and select the database.

        Raises:
            redis.exceptions.TimeoutError: the connect (or the handshake) took longer than the
                endpoint's timeout.
            redis.exceptions.ConnectionError: the server cannot be reached, or closed the
                connection; ``AuthenticationError`` (a subclass) for refused credentials.
            redis.exceptions.ResponseError: ``SELECT`` refused (e.g. a database out of range).
        """
        self.address = endpoint.address
        self._sock = _connect(endpoint)
        self.reader = RespReader(self._sock, self.address)
        try:
            handshake: list[list[bytes | memoryview]] = []
            if endpoint.password is not None:
                user = [] if endpoint.username is None else [endpoint.username.encode()]
                handshake.append([b"AUTH", *user, endpoint.password.encode()])
            if endpoint.db:
                handshake.append([b"SELECT", str(endpoint.db).encode()])
            with io_errors(self.address):
                self.send([piece for cmd in handshake for piece in command(*cmd)])
                replies = [self.reader.status() for _ in handshake]
            for reply in replies:
                if isinstance(reply, rexc.ResponseError) and "AUTH" in str(reply):
                    raise rexc.AuthenticationError(str(reply))
                if isinstance(reply, Exception):
                    raise reply
        except BaseException:
            self.close()
            raise

    def get_into(
        self, rkeys: Sequence[bytes], destinations: Sequence[Destination]
    ) -> list[DirectReply]:
        """One pipelined round trip of ``GET rkeys[i]``, value ``i`` received into
        ``destinations[i]``. Not retried on failure: the job fails and the connector recomputes.

        Raises:
            redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: the server cannot
                be reached, or stopped answering (drop the connection).
            redis.exceptions.InvalidResponse: a reply ``GET`` cannot give (drop it too).
        """
        if len(rkeys) != len(destinations):
            raise ValueError(f"{len(rkeys)} keys for {len(destinations)} destinations")
        pieces = [piece for rkey in rkeys for piece in command(b"GET", rkey)]
        with io_errors(self.address):
            self.send(pieces)
            return [self.reader.bulk_into(h, p) for h, p in destinations]

    def set_streamed(
        self,
        rkeys: Sequence[bytes],
        value: Callable[[int], Sequence[bytes | memoryview]],
        *,
        px: int | None = None,
    ) -> list[object]:
        """One pipelined round trip of ``SET rkeys[i] <value(i)> [PX px]``, each command sent
        as soon as ``value(i)`` returns (the value's pieces, concatenated).

        Returns:
            Per key: True for ``OK``, or the error reply as an exception (e.g. ``OOM``,
            ``READONLY``, ``MOVED``).

        Raises:
            redis.exceptions.ConnectionError, redis.exceptions.TimeoutError: as ``get_into``.
        """
        extra = b"" if px is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
        with io_errors(self.address):
            for i, rkey in enumerate(rkeys):
                parts = value(i)
                size = sum(len(p) for p in parts)
                head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
                    5 if extra else 3,
                    len(rkey),
                    rkey,
                    size,
                )
                self.send([head, *parts, b"\r\n" + extra])
            replies = [self.reader.status() for _ in rkeys]
        return [r if isinstance(r, Exception) else r == b"OK" for r in replies]

    def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Send ``pieces`` in order (large ones from where they are)."""
        sendall = self._sock.sendall
        for piece in pieces:
            sendall(piece)

    def is_stale(self) -> bool:
        """Whether the connection has something to read while idle: EOF (the server closed it,
        e.g. after a restart) or unsolicited data. Either way it must not be reused."""
        if self.reader.buffered() or (
            isinstance(self._sock, ssl.SSLSocket) and self._sock.pending()
        ):
            return True
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # closing: nothing left to do with it
            self._sock.close()


def _connect(endpoint: Endpoint) -> socket.socket:
    """An open socket to ``endpoint`` (TLS handshake done), with its timeout set."""

    def connect() -> socket.socket:
        if endpoint.path is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(endpoint.timeout_s)
            try:
                sock.connect(endpoint.path)
            except BaseException:
                sock.close()
                raise
            return sock
        assert endpoint.host is not None and endpoint.port is not None
        sock = socket.create_connection((endpoint.host, endpoint.port), endpoint.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if endpoint.tls is not None:
                host = endpoint.host if endpoint.check_hostname else None
                return endpoint.tls.wrap_socket(sock, server_hostname=host)
        except BaseException:
            sock.close()
            raise
        return sock

    with io_errors(endpoint.address):
        return connect()


@contextmanager
def io_errors(address: str) -> Iterator[None]:
    """Raise the socket errors of the block as redis-py's: ``TimeoutError`` and
    ``ConnectionError`` (as redis-py's own connections raise them)."""
    try:
        yield
    except TimeoutError as e:  # socket.timeout
        raise rexc.TimeoutError(f"timeout talking to {address}") from e
    except ssl.SSLError as e:
        raise rexc.ConnectionError(f"TLS error with {address}: {e.reason or e}") from e
    except OSError as e:
        raise rexc.ConnectionError(f"error talking to {address}: {e.strerror or e}") from e


def command(*args: bytes | memoryview) -> list[bytes | memoryview]:
    """The RESP2 encoding of one command, as pieces: small parts joined, large arguments (a
    row) left where they are."""
    pieces: list[bytes | memoryview] = []
    head = b"*%d\r\n" % len(args)
    for arg in args:
        head += b"$%d\r\n" % len(arg)
        if len(arg) > _SMALL_ARG_BYTES:
            pieces.append(head)
            pieces.append(arg)
            head = b"\r\n"
        else:
            head += bytes(arg) + b"\r\n"
    pieces.append(head)
    return pieces


class DirectPool:
    """The tier's direct connections, at most one idle per server. Thread-safe.

    Ownership: owns its connections; ``close()`` closes the idle ones (one in use is closed when
    its round ends after that).
    """

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._idle: dict[tuple[str | None, int | None], DirectConnection] = {}
        self._closed = False

    @contextmanager
    def connection(
        self, host: str | None = None, port: int | None = None
    ) -> Iterator[DirectConnection]:
        """A connection to the pool's server (or to ``host:port``, another master of the same
        cluster): the idle one unless it went stale, else a new one. Closed if the block raises
        (replies may be left unread: never reuse that stream), returned to the pool otherwise.

        Raises:
            redis.exceptions.RedisError: as ``DirectConnection``.
        """
        endpoint = self.endpoint if host is None or port is None else self.endpoint.at(host, port)
        where = (endpoint.host, endpoint.port) if endpoint.path is None else (endpoint.path, None)
        with self._lock:
            conn = self._idle.pop(where, None)
        if conn is not None and conn.is_stale():
            conn.close()
            conn = None
        if conn is None:
            conn = DirectConnection(endpoint)
        try:
            yield conn
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if self._closed or where in self._idle:
                conn.close()
            else:
                self._idle[where] = conn

    def get_into(
        self,
        rkeys: Sequence[bytes],
        destinations: Sequence[Destination],
        *,
        host: str | None = None,
        port: int | None = None,
    ) -> list[DirectReply]:
        """``DirectConnection.get_into`` on a connection to the pool's server (or ``host:port``)."""
        with self.connection(host, port) as conn:
            return conn.get_into(rkeys, destinations)

    def set_streamed(
        self,
        rkeys: Sequence[bytes],
        value: Callable[[int], Sequence[bytes | memoryview]],
        *,
        px: int | None = None,
        host: str | None = None,
        port: int | None = None,
    ) -> list[object]:
        """``DirectConnection.set_streamed`` on a connection to the pool's server (or
        ``host:port``)."""
        with self.connection(host, port) as conn:
            return conn.set_streamed(rkeys, value, px=px)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
        for conn in idle:
            conn.close()


class RespReader:
    """Reads the RESP2 replies of ``GET`` and ``SET`` from a socket, bulk values straight into
    their destinations. Raises ``OSError``/``TimeoutError`` from the socket as they come
    (``io_errors`` turns them into redis-py's), ``InvalidResponse`` on a reply these commands
    cannot give."""

    __slots__ = ("_buf", "_end", "_pos", "_sock", "_view", "peer")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self._buf = bytearray(BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._pos = 0
        self._end = 0
        self.peer = peer

    def buffered(self) -> bool:
        """Whether bytes were received that no reply consumed yet."""
        return self._end > self._pos

    def status(self) -> bytes | Exception | None:
        """A simple-string reply (``+OK`` -> ``b"OK"``), nil (``$-1``: a ``SET`` with a
        condition that did not hold), or an error reply as an exception."""
        line = self._line()
        kind = line[:1]
        if kind == b"+":
            return line[1:]
        if kind == b"-":
            return parse_error(line[1:].decode("utf-8", "replace"))
        if line == b"$-1":
            return None
        raise rexc.InvalidResponse(f"unexpected reply from {self.peer}: {line[:64]!r}")

    def bulk_into(self, header: memoryview, payload: memoryview) -> DirectReply:
        """A ``GET`` reply: a bulk string of ``len(header) + len(payload)`` bytes is received
        into them (True), one of another size is read and dropped (its size), nil is None, an
        error reply its exception."""
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
            return parse_error(line[1:].decode("utf-8", "replace"))
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
