# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Two engines, each with its own CPU tier, share one redis tier on a real server."""

from __future__ import annotations

from pathlib import Path

from tests.v1.kv_offload.tiering.redis.conftest import Engine, key_of
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext


def test_what_a_stored_b_finds_promotes_bit_exact(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    a = Engine(tmp_path / "a", server.url)
    b = Engine(tmp_path / "b", server.url)
    engines += [a, b]
    keys = [key_of(i) for i in range(6)]
    writer, reader = ReqContext("writer"), ReqContext("reader")
    a.manager.on_new_request(writer)
    a.store(keys, writer)
    assert a.tier.get_stats().counters["blocks_written"] == 6
    b.manager.on_new_request(reader)
    assert b.promote(keys, reader) == [True] * 6
    b.assert_cpu_holds(keys, reader)
    stats = b.tier.get_stats().counters
    assert stats["blocks_loaded"] == 6 and stats["server_misses"] == 0
    # A second store of the same blocks by B sends nothing: they are there already.
    assert a.tier.namespace == b.tier.namespace


def test_ttl_and_namespace_reach_the_server(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    a = Engine(tmp_path / "a", server.url, ttl_s=60, namespace="deploy-a")
    b = Engine(tmp_path / "b", server.url, namespace="deploy-b")
    engines += [a, b]
    keys = [key_of(i) for i in range(2)]
    ctx = ReqContext("w")
    a.manager.on_new_request(ctx)
    a.store(keys, ctx)
    client = server.client()
    assert a.tier.redis_key(keys[0]).startswith(b"kvo:deploy-a:")
    assert 0 < client.pttl(a.tier.redis_key(keys[0])) <= 60_000
    client.close()
    # Another namespace on the same server sees none of it.
    reader = ReqContext("r")
    b.manager.on_new_request(reader)
    assert b.probe(keys, reader) == [False, False]


def test_events_announce_stored_blocks_as_remote_storage(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    a = Engine(tmp_path / "a", server.url, enable_events=True)
    quiet = Engine(tmp_path / "q", server.url)
    engines += [a, quiet]
    keys = [key_of(i) for i in range(3)]
    ctx = ReqContext("w")
    for engine in (a, quiet):
        engine.manager.on_new_request(ctx)
        engine.store(keys, ctx)
    events = list(a.tier.take_events())
    assert [(sorted(e.keys), e.medium, e.removed, e.locality) for e in events] == [
        (sorted(keys), "STORAGE", False, "REMOTE")
    ]
    assert list(a.tier.take_events()) == []  # drained
    assert list(quiet.tier.take_events()) == []  # not recorded without enable_events
