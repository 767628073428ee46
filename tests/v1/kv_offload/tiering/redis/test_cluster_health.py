# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""One dead master of a real 3-master cluster does not take the tier down: the breaker stays
closed, the other masters keep serving lookups, stores and loads bit-exact, the dead master's
keys miss, and each change of that master's state is one WARNING."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_offload.tiering.redis.conftest import (
    Engine,
    collect,
    job,
    pattern,
    seeded_engine,
)
from tests.v1.kv_offload.tiering.redis.servers import RedisCluster3, poll_until
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

RUN_S = 3.0
"""How long the tier is driven with one master dead (past several probe and stats intervals)."""


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisCluster3]:
    c = RedisCluster3(tmp_path / "cluster")
    yield c
    c.stop()


def _owners(cluster: RedisCluster3, engine: Engine, keys: list[OffloadKey]) -> dict[int, int]:
    """Index in ``keys`` -> index of the master that holds it (after a store)."""
    owner: dict[int, int] = {}
    for n, node in enumerate(cluster.nodes):
        client = node.client()
        local = set(client.keys("kvo:*"))
        client.close()
        owner.update({i: n for i, key in enumerate(keys) if engine.tier.redis_key(key) in local})
    return owner


def _tier_probe(engine: Engine, keys: list[OffloadKey], ctx: ReqContext) -> list[bool | None]:
    """The tier's own answers (not the manager's: no promotion into the rows this test uses)."""
    tier = engine.tier
    assert [tier.lookup(k, ctx) for k in keys] == [None] * len(keys)
    tier.on_schedule_end()
    assert tier.wait_lookups_idle(10)
    answers = [tier.lookup(k, ctx) for k in keys]
    tier.on_request_finished(ctx)
    return answers


@pytest.mark.slow
def test_one_dead_master_only_misses_its_own_keys(
    tmp_path: Path,
    own_cluster: RedisCluster3,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    engine, rows, keys = seeded_engine(tmp_path, own_cluster.url, engines, 8, cluster=True)
    tier = engine.tier
    tier.submit_store(job(1, keys[:6], list(range(6)), load=False))
    assert collect(engine, {1}) == {1: True}
    owner = _owners(own_cluster, engine, keys[:6])
    dead_master = next(n for n in (1, 2, 0) if n in owner.values())
    dead = [i for i, n in owner.items() if n == dead_master]
    alive = [i for i, n in owner.items() if n != dead_master]
    assert alive and dead
    dead_port = own_cluster.nodes[dead_master].port
    own_cluster.nodes[dead_master].kill()

    # Drive lookups, loads and stores for a while, as the engine would.
    job_id, step, deadline = 10, 0, time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        ctx = ReqContext(f"r{step}")
        assert _tier_probe(engine, [keys[i] for i in alive], ctx) == [True] * len(alive)
        assert _tier_probe(engine, [keys[i] for i in dead], ctx) == [False] * len(dead)
        rows[6] = 0
        tier.submit_load(job(job_id, [keys[alive[0]]], [6], load=True))
        assert collect(engine, {job_id}) == {job_id: True}
        assert np.array_equal(rows[6], pattern(keys[alive[0]]))
        tier.submit_load(job(job_id + 1, [keys[dead[0]]], [7], load=True))
        assert collect(engine, {job_id + 1}) == {job_id + 1: False}
        job_id += 2
        step += 1
    assert tier.get_stats().counters["breaker_trips"] == 0, "the whole tier was cut off"
    assert not tier.breaker_open
    lines = [r.getMessage() for r in caplog.records]
    down = [line for line in lines if f":{dead_port} cannot be used" in line]
    assert len(down) == 1, lines
    assert not any("server unreachable" in line for line in lines), lines

    # Back (empty): one more line, and its slots are served again.
    own_cluster.nodes[dead_master].start()
    own_cluster.wait_state("ok", own_cluster.nodes)
    poll_until(
        lambda: any(f":{dead_port} answers again" in r.getMessage() for r in caplog.records),
        "the tier saw the master back",
    )
    tier.submit_store(job(100, [keys[dead[0]]], [dead[0]], load=False))
    assert collect(engine, {100}) == {100: True}
    rows[7] = 0
    tier.submit_load(job(101, [keys[dead[0]]], [7], load=True))
    assert collect(engine, {101}) == {101: True}
    assert np.array_equal(rows[7], pattern(keys[dead[0]]))
    again = [
        r.getMessage() for r in caplog.records if f":{dead_port} answers again" in r.getMessage()
    ]
    assert len(again) == 1
