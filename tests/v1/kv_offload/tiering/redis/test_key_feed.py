# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's key feed (``key_feed``): while the tier follows the namespace's stores, a
lookup answers in the step that asks, "absent" for a block nobody stored and "present" for one
another instance stored; a newcomer lists what is there; a lost subscription is followed again
(what was stored meanwhile found by the listing); a server that refuses channels, or a namespace
larger than the view, leaves lookups waiting for the server as before, logged once."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import redis

from tests.v1.kv_offload.tiering.redis.conftest import Engine, key_of
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.redis.health import CircuitBreaker, PermissionGates
from vllm.v1.kv_offload.tiering.redis.key_feed import KeyFeed
from vllm.v1.kv_offload.tiering.redis.local_view import KnownBlocks
from vllm.v1.kv_offload.tiering.redis.redaction import Redactor

SYNC_S = 10.0


def test_a_block_nobody_stored_answers_absent_in_the_step_that_asks(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine = Engine(tmp_path / "e", server.url)
    engines.append(engine)
    tier = engine.tier
    assert tier.sync_view(SYNC_S) and tier.follows_stores
    ctx = ReqContext("r")
    engine.manager.on_new_request(ctx)
    assert engine.lookups([key_of(i) for i in range(3)], ctx) == [False] * 3
    counters = tier.get_stats().counters
    assert counters["lookups_answered_absent"] == 3
    assert counters["lookup_deferred_requests"] == counters["lookup_deferred_keys"] == 0
    assert counters["key_listings"] >= 1 and counters["announce_failures"] == 0


def test_what_another_instance_stores_is_found_at_once_and_loads_bit_exact(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    a, b = Engine(tmp_path / "a", server.url), Engine(tmp_path / "b", server.url)
    engines += [a, b]
    assert b.tier.sync_view(SYNC_S)  # b follows before a stores: a's announcement is what it sees
    keys = [key_of(i) for i in range(4)]
    ctx = ReqContext("w")
    a.manager.on_new_request(ctx)
    a.store(keys, ctx)
    assert b.tier.sync_view(SYNC_S)
    ask = ReqContext("ask")
    assert [b.tier.lookup(k, ask) for k in keys] == [True] * 4  # no step waited
    assert b.tier.lookup(key_of(99), ask) is False
    assert b.tier.get_stats().counters["lookup_deferred_requests"] == 0
    req = ReqContext("r")
    b.manager.on_new_request(req)
    assert b.promote(keys, req) == [True] * 4
    b.assert_cpu_holds(keys, req)


def test_a_newcomer_lists_what_the_namespace_holds(
    tmp_path: Path, server: RedisServer, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.tiering.redis")
    a = Engine(tmp_path / "a", server.url)
    engines.append(a)
    keys = [key_of(i) for i in range(3)]
    ctx = ReqContext("w")
    a.manager.on_new_request(ctx)
    a.store(keys, ctx)
    late = Engine(tmp_path / "late", server.url)  # starts after the stores: nothing announced
    engines.append(late)
    assert late.tier.sync_view(SYNC_S)
    ask = ReqContext("ask")
    assert [late.tier.lookup(k, ask) for k in [*keys, key_of(7)]] == [True, True, True, False]
    # The start-up line says so (the constructor waited for the first listing).
    assert any(
        "following the namespace's stores (3 blocks listed)" in r.getMessage()
        for r in caplog.records
    ), [r.getMessage() for r in caplog.records]


def test_a_lost_subscription_is_followed_again_and_what_was_stored_meanwhile_found(
    tmp_path: Path,
    server: RedisServer,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.tiering.redis")
    a, b = Engine(tmp_path / "a", server.url), Engine(tmp_path / "b", server.url)
    engines += [a, b]
    assert b.tier.sync_view(SYNC_S)
    admin = server.client()
    assert admin.client_kill_filter(_type="pubsub") >= 2  # both instances' subscriptions
    keys = [key_of(i) for i in range(2)]
    ctx = ReqContext("w")
    a.manager.on_new_request(ctx)
    a.store(keys, ctx)  # announced while nobody may be listening
    assert b.tier.sync_view(SYNC_S)
    assert [b.tier.lookup(k, ReqContext("ask")) for k in keys] == [True, True]
    assert not b.tier.breaker_open, "a lost subscription does not cut the tier off"
    lines = [r.getMessage() for r in caplog.records]
    assert any("lost the namespace's stored keys" in line for line in lines), lines
    assert any("following the namespace's stored keys again" in line for line in lines), lines
    admin.close()


def test_a_server_that_refuses_channels_leaves_lookups_asking_it_logged_once(
    tmp_path: Path, server: RedisServer, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    admin = server.client()
    # Every key and command, no channel.
    admin.execute_command(
        "ACL", "SETUSER", "nochan", "on", ">nochan-pw-1", "~*", "+@all", "resetchannels"
    )
    engine = Engine(tmp_path / "e", f"redis://nochan:nochan-pw-1@127.0.0.1:{server.port}")
    engines.append(engine)
    tier = engine.tier
    _wait_logged(caplog, "refuses SUBSCRIBE")  # by the feed thread's first attempt
    assert not tier.sync_view(0.5) and not tier.follows_stores
    ctx = ReqContext("r")
    engine.manager.on_new_request(ctx)
    key = key_of(1)
    assert engine.lookups([key], ctx) == [None]  # the server decides, a step later
    engine.step()
    assert tier.wait_lookups_idle(SYNC_S)
    assert engine.lookups([key], ctx) == [False]
    assert sum("refuses SUBSCRIBE" in r.getMessage() for r in caplog.records) == 1
    admin.close()


def _wait_logged(caplog: pytest.LogCaptureFixture, text: str) -> None:
    """Bounded poll of the log for a line the feed thread writes (no event says it did)."""
    deadline = time.monotonic() + SYNC_S
    while not any(text in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, f"not logged: {text!r}"
        time.sleep(0.05)


def test_a_namespace_larger_than_the_view_is_followed_but_never_complete(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.tiering.redis")
    client = redis.Redis.from_url(server.url)
    prefix = b"kvo:big:"
    for i in range(3):
        client.set(prefix + key_of(i).hex().encode(), b"x")
    redactor = Redactor(server.url)
    feed = KeyFeed(
        client,
        prefix,
        KnownBlocks(ttl_s=None, capacity=2),
        CircuitBreaker("t", redactor),
        PermissionGates("t", redactor),
        redactor,
        "t",
        "redis",
    )
    feed.start()
    try:
        _wait_logged(caplog, "the namespace holds more than 2 blocks")
        assert not feed.complete and feed.listings == 0
        assert not feed.sync(0.2)
    finally:
        assert feed.stop(SYNC_S)
        client.close()


def test_known_blocks_forget_what_no_listing_confirmed_and_count_capacity_drops() -> None:
    known = KnownBlocks(ttl_s=None, capacity=3)
    old = [key_of(i) for i in range(2)]
    known.add(old)
    since = time.monotonic()
    known.add(old[1:])  # confirmed again by a listing that began at ``since``
    assert known.drop_unconfirmed_since(since) == 1
    assert [known.holds(k) for k in old] == [False, True]
    assert known.capacity_drops == 0
    known.add([key_of(i) for i in range(10, 13)])
    assert known.capacity_drops == 1 and len(known) == 3
