# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's local view: lookups of blocks this instance knows the server holds answer in
the step that asks; without following the namespace's stores (``follow_stores`` false; the feed
is tested in ``test_key_feed.py``), blocks only another instance stored are asked of the server;
a key older than ``ttl_s`` is asked again."""

from __future__ import annotations

import time
from pathlib import Path

from tests.v1.kv_offload.tiering.redis.conftest import Engine, key_of
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.redis.local_view import KnownBlocks


def test_known_blocks_forget_the_oldest_beyond_capacity_and_what_is_dropped() -> None:
    known = KnownBlocks(ttl_s=None, capacity=3)
    keys = [key_of(i) for i in range(5)]
    known.add(keys[:3])
    known.add(keys[:1])  # confirmed again: now the youngest
    known.add(keys[3:4])
    assert [known.holds(k) for k in keys] == [True, False, True, True, False]
    known.drop(keys[2:3])
    assert not known.holds(keys[2]) and len(known) == 2


def test_own_blocks_answer_in_the_step_that_asks_others_are_asked_of_the_server(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    writer, other, reader = (
        Engine(tmp_path / name, server.url, follow_stores=False) for name in ("w", "o", "r")
    )
    engines += [writer, other, reader]
    mine, theirs = [key_of(i) for i in range(3)], [key_of(10 + i) for i in range(2)]
    ctx = ReqContext("w")
    writer.manager.on_new_request(ctx)
    writer.store(mine, ctx)
    octx = ReqContext("o")
    other.manager.on_new_request(octx)
    other.store(theirs, octx)
    tier = writer.tier
    before = tier.get_stats().counters["lookups_answered_locally"]
    ask = ReqContext("ask")
    assert [tier.lookup(k, ask) for k in mine] == [True] * 3  # no step waited
    assert [tier.lookup(k, ask) for k in theirs] == [None, None]  # the server decides
    counters = tier.get_stats().counters
    assert counters["lookups_answered_locally"] - before == 3
    # The request that waited for the server is counted, as the report's per-tier count needs.
    assert (counters["lookup_deferred_requests"], counters["lookup_deferred_keys"]) == (1, 2)
    tier.on_schedule_end()
    assert tier.wait_lookups_idle(10)
    assert [tier.lookup(k, ask) for k in theirs] == [True, True]
    # What was found is known too, and what the server holds loads bit-exact for a newcomer.
    assert tier.lookup(theirs[0], ReqContext("later")) is True
    req = ReqContext("r")
    reader.manager.on_new_request(req)
    assert reader.promote(mine + theirs, req) == [True] * 5
    reader.assert_cpu_holds(mine + theirs, req)


def test_a_key_older_than_its_ttl_is_asked_of_the_server_again(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine = Engine(tmp_path / "e", server.url, ttl_s=1.0, follow_stores=False)
    engines.append(engine)
    key = key_of(1)
    ctx = ReqContext("w")
    engine.manager.on_new_request(ctx)
    engine.store([key], ctx)
    assert engine.tier.lookup(key, ReqContext("a")) is True
    time.sleep(1.0)  # the TTL running out is what is tested: not a synchronisation
    late = ReqContext("b")
    assert engine.tier.lookup(key, late) is None
    engine.tier.on_schedule_end()
    assert engine.tier.wait_lookups_idle(10)
    assert engine.tier.lookup(key, late) is False  # the server expired it too
