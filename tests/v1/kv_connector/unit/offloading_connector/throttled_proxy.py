# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ThrottledProxy``: a loopback TCP proxy whose replies cross a slow link.

It forwards every connection to a server on 127.0.0.1: bytes to the server at once, bytes back
at ``reply_bytes_per_s`` (each chunk is held for its size over that rate), as a congested or
distant network would deliver a store's values. Small replies (a lookup's) pass almost at once,
large ones (loaded values) slowly. Real sockets and threads; ``stop()`` closes everything.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class ThrottledProxy:
    """Listens on a free loopback port and relays to ``127.0.0.1:target_port``.

    Args:
        target_port: the server's port.
        reply_bytes_per_s: the rate of the server -> client direction.
    """

    def __init__(self, target_port: int, reply_bytes_per_s: float) -> None:
        self._target = ("127.0.0.1", target_port)
        self._rate = reply_bytes_per_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopped = False
        self._start(self._accept_loop)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def _start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            server = socket.create_connection(self._target)
            with self._lock:
                if self._stopped:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            self._start(self._pump, client, server, 0.0)
            self._start(self._pump, server, client, self._rate)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, rate: float) -> None:
        try:
            while chunk := src.recv(65536):
                if rate:
                    time.sleep(len(chunk) / rate)  # the slow link
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            sockets, threads = list(self._sockets), list(self._threads)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (close alone does not)
        self._listener.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for thread in threads:
            thread.join(5)
