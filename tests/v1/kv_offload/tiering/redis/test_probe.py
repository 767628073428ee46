# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``probe_server``: one line naming the cause of a server the tier cannot use, fast, with the
credentials masked; None for a server that answers."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.v1.kv_offload.tiering.redis.servers import RedisServer, free_port
from vllm.v1.kv_offload.tiering.redis.probe import probe_server

PASSWORD = "probe-pw-0xC0FFEE"
BOUND_S = 3.0
"""A probe's answer comes within the connect timeout and this much (a loaded 2-core box)."""


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path / "locked", password=PASSWORD)
    yield srv
    srv.stop()


def _probe(url: str, timeout_s: float = 1.0, **kwargs: object) -> str | None:
    t0 = time.monotonic()
    problem = probe_server({"url": url, "timeout_s": timeout_s, **kwargs})
    assert time.monotonic() - t0 < timeout_s + BOUND_S
    assert problem is None or PASSWORD not in problem
    return problem


def test_a_server_that_answers_passes(locked: RedisServer) -> None:
    assert _probe(f"redis://:{PASSWORD}@127.0.0.1:{locked.port}/2") is None


def test_refused_unauthenticated_and_silent_servers_are_named(
    tmp_path: Path, locked: RedisServer
) -> None:
    port = free_port()
    assert _probe(f"redis://:{PASSWORD}@127.0.0.1:{port}") == (
        f"redis://:***@127.0.0.1:{port}: connection refused"
    )
    wrong = _probe(f"redis://:not-it@127.0.0.1:{locked.port}")
    assert wrong is not None and wrong.startswith(f"redis://:***@127.0.0.1:{locked.port}: ")
    assert "authentication failed" in wrong
    missing = _probe(locked.url)
    assert missing is not None and "authentication failed" in missing
    assert _probe(f"unix://{tmp_path}/none.sock") == f"unix://{tmp_path}/none.sock: no such socket"
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}"
        assert _probe(url, timeout_s=0.5) == f"{url}: no answer within 0.5 s"


def test_a_url_without_a_host_is_refused_as_a_config_error() -> None:
    with pytest.raises(ValueError, match="'url'"):
        probe_server({"url": "redis://"})
