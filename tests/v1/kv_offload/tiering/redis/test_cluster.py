# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier on a 3-master Redis Cluster: blocks spread over every master; with one master
killed its slots miss while the other masters keep serving, bit-exact; with all of them up, what
one instance stores another finds in the step that asks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.v1.kv_offload.tiering.redis.conftest import Engine, key_of
from tests.v1.kv_offload.tiering.redis.servers import RedisCluster3
from vllm.v1.kv_offload.base import ReqContext

NUM_KEYS = 24


@pytest.mark.slow
def test_in_a_cluster_what_one_instance_stores_another_finds_in_the_step_that_asks(
    tmp_path: Path, cluster: RedisCluster3, engines: list[Engine]
) -> None:
    # Before the test below, which kills a master of the module's cluster.
    a = Engine(tmp_path / "a", cluster.url, cluster=True)
    b = Engine(tmp_path / "b", cluster.url, cluster=True)
    engines += [a, b]
    assert b.tier.sync_view(10)
    keys = [key_of(1000 + i) for i in range(6)]  # spread over the masters
    ctx = ReqContext("w")
    a.manager.on_new_request(ctx)
    a.store(keys, ctx)
    assert b.tier.sync_view(10)
    ask = ReqContext("ask")
    assert [b.tier.lookup(k, ask) for k in keys] == [True] * 6
    assert b.tier.lookup(key_of(5000), ask) is False
    late = Engine(tmp_path / "late", cluster.url, cluster=True)  # lists every master
    engines.append(late)
    assert late.tier.sync_view(10)
    assert [late.tier.lookup(k, ask) for k in keys] == [True] * 6
    req = ReqContext("r")
    late.manager.on_new_request(req)
    assert late.promote(keys, req) == [True] * 6
    late.assert_cpu_holds(keys, req)


@pytest.mark.slow
def test_blocks_spread_over_masters_and_a_dead_master_only_loses_its_slots(
    tmp_path: Path, cluster: RedisCluster3, engines: list[Engine]
) -> None:
    writer = Engine(tmp_path / "w", cluster.url, cluster=True)
    engines.append(writer)
    keys = [key_of(i) for i in range(NUM_KEYS)]
    ctx = ReqContext("w")
    writer.manager.on_new_request(ctx)
    for start in range(0, NUM_KEYS, 6):  # the CPU tier holds 8 blocks
        writer.store(keys[start : start + 6], ctx)
    assert writer.tier.get_stats().counters["blocks_written"] == NUM_KEYS
    # Where each block lives: every master holds some.
    owner: dict[bytes, int] = {}
    for n, node in enumerate(cluster.nodes):
        client = node.client()
        local = set(client.keys("kvo:*"))  # a node lists only the keys of its own slots
        client.close()
        owner.update({key: n for key in keys if writer.tier.redis_key(key) in local})
    assert len(owner) == NUM_KEYS and set(owner.values()) == {0, 1, 2}

    cluster.nodes[1].kill()
    reader = Engine(tmp_path / "r", cluster.url, cluster=True)
    engines.append(reader)
    req = ReqContext("r")
    reader.manager.on_new_request(req)
    alive = [k for k in keys if owner[k] != 1][:6]
    dead = [k for k in keys if owner[k] == 1][:2]
    # The dead master's keys miss; the others are found, promoted and exact.
    assert reader.probe(dead, req) == [False] * len(dead)
    assert not reader.tier.breaker_open, "two masters answer: the tier is not cut off"
    # A listing needs every master: the reader cannot follow stores, it asks the cluster.
    assert not reader.tier.follows_stores
    assert reader.promote(alive, ReqContext("r2"), sync=False) == [True] * len(alive)
    reader.assert_cpu_holds(alive, ReqContext("r2"))
