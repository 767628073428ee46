# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Server faults: the server SIGKILLed and restarted, paused, full. Jobs fail cleanly (each is
reported exactly once), no wrong byte is ever served, nothing on the scheduler thread waits for
the server, the tier recovers by itself, and shutdown never hangs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_offload.tiering.redis.conftest import (
    ROW_BYTES,
    Engine,
    collect,
    job,
    key_of,
    limited_server,
    pattern,
    seeded_engine,
)
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext

SCHEDULER_CALL_LIMIT_S = 0.05
"""What one lookup / on_schedule_end may take with the server hung (a few ms; slack for a loaded
2-core box)."""


@pytest.mark.slow
def test_server_killed_mid_run_and_restarted(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine, rows, keys = seeded_engine(tmp_path, server.url, engines, 8)
    tier = engine.tier
    tier.submit_store(job(1, keys[:4], [0, 1, 2, 3], load=False))
    assert collect(engine, {1}) == {1: True}
    # Jobs in flight when the server dies: a big store and a load.
    tier.submit_store(job(2, keys[4:], [4, 5, 6, 7], load=False))
    rows[4:8] = 0
    tier.submit_load(job(3, keys[:4], [4, 5, 6, 7], load=True))
    server.kill()
    results = collect(engine, {2, 3})
    # Whatever each job managed before the kill, a load that succeeded delivered exact bytes.
    if results[3]:
        for row, key in zip(range(4, 8), keys[:4], strict=True):
            assert np.array_equal(rows[row], pattern(key))
    # Unreachable: the next jobs fail and lookups answer False at once, without the network.
    tier.submit_load(job(4, keys[:1], [4], load=True))
    assert collect(engine, {4}) == {4: False}
    assert not tier.wait_reachable(0.0)
    ctx = ReqContext("r")
    t0 = time.monotonic()
    assert tier.lookup(keys[0], ctx) is False
    assert time.monotonic() - t0 < SCHEDULER_CALL_LIMIT_S
    assert tier.get_stats().counters["breaker_trips"] == 1
    # Restarted (empty: no persistence): the tier reconnects by itself.
    server.start()
    assert tier.wait_reachable(15.0)
    assert engine.probe(keys[:1], ctx) == [False]  # the restarted server lost everything
    tier.submit_store(job(5, keys[:2], [0, 1], load=False))
    assert collect(engine, {5}) == {5: True}
    rows[2:4] = 0
    tier.submit_load(job(6, keys[:2], [2, 3], load=True))
    assert collect(engine, {6}) == {6: True}
    assert np.array_equal(rows[2], pattern(keys[0])) and np.array_equal(rows[3], pattern(keys[1]))


@pytest.mark.slow
def test_client_pause_never_blocks_the_scheduler_thread(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine, _, keys = seeded_engine(tmp_path, server.url, engines, 4)
    tier = engine.tier
    admin = server.client()
    admin.client_pause(3000)  # every other client's commands wait 3 s
    t_pause = time.monotonic()
    tier.submit_store(job(1, keys, [0, 1, 2, 3], load=False))
    ctx = ReqContext("r")
    worst = 0.0
    steps = 0
    # Scheduler steps for 2.5 s, past the 1 s command timeout, while the store and the probes
    # hang in the paused server (the pacing stands in for the model's forward pass).
    while time.monotonic() - t_pause < 2.5:
        t0 = time.monotonic()
        tier.lookup(key_of(100 + steps), ctx)
        tier.on_schedule_end()
        list(tier.get_finished_jobs())
        worst = max(worst, time.monotonic() - t0)
        steps += 1
        time.sleep(0.02)
    assert worst < SCHEDULER_CALL_LIMIT_S, f"a scheduler call took {worst * 1000:.1f} ms"
    assert tier.breaker_open, "the timed-out commands opened the breaker"
    assert tier.lookup(key_of(1000), ctx) is False
    admin.client_unpause()
    admin.close()
    # The hung store timed out (timeout_s = 1) and failed, reported once; the tier serves again.
    engine.tier.drain_jobs()
    assert tier.wait_reachable(15.0)
    tier.submit_store(job(2, keys[:1], [0], load=False))
    tier.drain_jobs()
    assert any(r.job_id == 2 and r.success for r in tier.get_finished_jobs())


def test_shutdown_with_the_server_dead_does_not_hang(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine = Engine(tmp_path / "e", server.url)
    rows = engine.rows
    assert rows is not None
    keys = [key_of(i) for i in range(4)]
    server.kill()
    engine.tier.submit_store(job(1, keys, [0, 1, 2, 3], load=False))
    engine.tier.lookup(keys[0], ReqContext("r"))
    engine.tier.on_schedule_end()
    t0 = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - t0 < 5.0


def test_maxmemory_noeviction_fails_stores_cleanly(tmp_path: Path, engines: list[Engine]) -> None:
    with limited_server(tmp_path / "full", "2mb", "noeviction") as server:
        engine, rows, keys = seeded_engine(tmp_path, server.url, engines, 8)
        engine.tier.submit_store(job(1, keys, list(range(8)), load=False))
        assert collect(engine, {1}) == {1: False}
        counters = engine.tier.get_stats().counters
        assert counters["oom_refusals"] > 0 and counters["store_failures"] == 1
        assert not engine.tier.breaker_open, "a full server is reachable: no breaker trip"
        # What was stored before the server filled up loads bit-exact.
        stored = [k for k in keys if server.client().exists(engine.tier.redis_key(k))]
        assert stored and len(stored) < len(keys)
        engine.tier.submit_load(job(2, stored[:1], [7], load=True))
        assert collect(engine, {2}) == {2: True}
        assert np.array_equal(rows[7], pattern(stored[0]))
        assert ROW_BYTES * len(stored) <= 4 << 20


def test_block_evicted_between_lookup_and_load_is_a_counted_miss(
    tmp_path: Path, engines: list[Engine]
) -> None:
    with limited_server(tmp_path / "lru", "3mb", "allkeys-lru") as server:
        engine, rows, first = seeded_engine(tmp_path, server.url, engines, 4)
        tier = engine.tier
        tier.submit_store(job(1, first, [0, 1, 2, 3], load=False))
        assert collect(engine, {1}) == {1: True}
        ctx = ReqContext("r")
        # Stored by this instance: its lookups answer at once (the tier's local view).
        assert [tier.lookup(k, ctx) for k in first] == [True] * 4
        # Later blocks push the first ones out (allkeys-lru): normal operation, not an error.
        later = [key_of(100 + i) for i in range(8)]
        for n, start in enumerate(range(0, 8, 4)):
            for i, key in enumerate(later[start : start + 4]):
                rows[4 + i] = pattern(key)
            tier.submit_store(job(10 + n, later[start : start + 4], [4, 5, 6, 7], load=False))
            collect(engine, {10 + n})
        client = server.client()
        gone = [k for k in first if not client.exists(tier.redis_key(k))]
        client.close()
        assert gone, "the server evicted some of the first blocks"
        rows[4] = 0
        tier.submit_load(job(20, gone[:1], [4], load=True))
        assert collect(engine, {20}) == {20: False}
        assert not rows[4].any(), "nothing was written for a missing value"
        counters = tier.get_stats().counters
        assert counters["server_misses"] == 1 and counters["load_failures"] == 1
        assert not tier.breaker_open
        # The stale "present" is forgotten: once the tier follows the namespace's stores, the
        # next lookup answers absent in the step that asks.
        assert tier.sync_view(10)
        assert tier.lookup(gone[0], ReqContext("r2")) is False


def test_queued_stores_run_as_one_batch_with_outcomes_perjob(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine, rows, keys = seeded_engine(tmp_path, server.url, engines, 6)
    tier = engine.tier
    # Three jobs queued together; one key is in two of them (rows 1 and 6 hold the same block).
    rows[6] = pattern(keys[1])
    tier.submit_store(job(1, keys[:2], [0, 1], load=False))
    tier.submit_store(job(2, [keys[2], keys[1]], [2, 6], load=False))
    tier.submit_store(job(3, keys[3:6], [3, 4, 5], load=False))
    assert collect(engine, {1, 2, 3}) == {1: True, 2: True, 3: True}
    counters = tier.get_stats().counters
    assert counters["blocks_written"] == 6 and counters["store_failures"] == 0
    rows[7] = 0
    tier.submit_load(job(4, keys[1:2], [7], load=True))
    assert collect(engine, {4}) == {4: True}
    assert np.array_equal(rows[7], pattern(keys[1]))
