# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Cluster changes behind the tier's back, with real servers and the cluster's own commands: a
slot resharded to another master and a ``CLUSTER FAILOVER`` (``MOVED``), a slot in the middle of
a migration, also into a master added after the client started (``ASK``), a redirection loop,
and writes reaching a replica (``READONLY``).

What every test checks: no wrong byte (each loaded row is compared with what was stored), every
job reported exactly once, no exception reaching the scheduler thread or logged by the I/O thread,
the breaker left closed (the servers are reachable), and the tier serving the new topology
afterwards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot

from tests.v1.kv_offload.tiering.redis.conftest import (
    Engine,
    collect,
    job,
    key_of,
    pattern,
    seeded_engine,
)
from tests.v1.kv_offload.tiering.redis.servers import (
    RedisCluster3,
    RedisServer,
    poll_until,
    start_replica,
    sync_replicas,
)
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.redis.manager import RedisSecondaryTier


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[RedisCluster3]:
    """A cluster of the test's own: each test reshards it."""
    c = RedisCluster3(tmp_path / "cluster")
    yield c
    c.stop()


@pytest.fixture
def no_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if the tier logged an error (an exception that escaped a job or a probe);
    the expected warnings (a failed job, once per kind) are fine."""
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, f"the tier logged errors: {[r.getMessage() for r in errors]}"


def _slot_of(tier: RedisSecondaryTier, key: OffloadKey) -> int:
    return key_slot(tier.redis_key(key))


def _mapped_port(tier: RedisSecondaryTier, slot: int) -> int:
    """The port of the master the tier's client currently maps ``slot`` to."""
    # private: the slot map is the tier's redis-py client's own routing; no public API of the
    # tier (or of its metrics) says which master it would send a slot to.
    client = tier._router.client
    assert isinstance(client, RedisCluster)
    return int(client.nodes_manager.get_node_from_slot(slot).port)


def _probe(tier: RedisSecondaryTier, keys: list[OffloadKey], ctx: ReqContext) -> list[bool]:
    """What the servers answer for ``keys``: the ``EXISTS`` round the lookup thread runs for a
    step's lookups (not the tier's local view, which answers at once for the blocks it stored
    and would not touch the cluster)."""
    return tier.transfer.presence(keys)


def _assert_rows(rows: npt.NDArray[np.uint8], loaded: dict[int, OffloadKey]) -> None:
    for row, key in loaded.items():
        assert np.array_equal(rows[row], pattern(key)), f"row {row} != block {key.hex()}"


def _other_master(cluster: RedisCluster3, slot: int) -> tuple[int, int]:
    """``slot``'s master and the next of the three masters the cluster was created with."""
    src = cluster.owner(slot)
    return src, (src + 1) % 3


# ---------------------------------------------------------------------------------------------
# MOVED: a slot resharded to another master after the client loaded its slot map
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_errors")
def test_moved_slots_are_followed_and_the_slot_map_reloaded(
    tmp_path: Path, fresh_cluster: RedisCluster3, engines: list[Engine]
) -> None:
    cluster = fresh_cluster
    engine, rows, keys = seeded_engine(tmp_path, cluster.url, engines, 4, cluster=True)
    tier = engine.tier
    tier.submit_store(job(1, keys[:3], [0, 1, 2], load=False))
    assert collect(engine, {1}) == {1: True}
    slots = [_slot_of(tier, k) for k in keys]
    assert len(set(slots)) == 4, "four keys in four slots (one reshard per operation)"

    # 1. A lookup of a block whose slot moved: found on the new owner.
    src, dst = _other_master(cluster, slots[0])
    cluster.move_slot(slots[0], src, dst)
    assert cluster.keys_in_slot(slots[0], dst) == [tier.redis_key(keys[0])]
    assert _mapped_port(tier, slots[0]) == cluster.nodes[src].port, "the client was not told"
    assert _probe(tier, keys[:1], ReqContext("r1")) == [True]
    assert _mapped_port(tier, slots[0]) == cluster.nodes[dst].port, "slot map reloaded"

    # 2. A load (with a block whose slot did not move): bit-exact from both masters.
    src, dst = _other_master(cluster, slots[1])
    cluster.move_slot(slots[1], src, dst)
    rows[4:6] = 0
    tier.submit_load(job(2, keys[1:3], [4, 5], load=True))
    assert collect(engine, {2}) == {2: True}
    _assert_rows(rows, {4: keys[1], 5: keys[2]})
    assert _mapped_port(tier, slots[1]) == cluster.nodes[dst].port

    # 3. A store into a moved slot: lands on the new owner, loads back exact.
    src, dst = _other_master(cluster, slots[3])
    cluster.move_slot(slots[3], src, dst)
    tier.submit_store(job(3, keys[3:4], [3], load=False))
    assert collect(engine, {3}) == {3: True}
    assert cluster.keys_in_slot(slots[3], dst) == [tier.redis_key(keys[3])]
    rows[6] = 0
    tier.submit_load(job(4, keys[3:4], [6], load=True))
    assert collect(engine, {4}) == {4: True}
    _assert_rows(rows, {6: keys[3]})

    counters = tier.stats()
    assert counters["load_failures"] == 0 and counters["store_failures"] == 0
    assert counters["blocks_written"] == 4 and not tier.breaker_open


@pytest.mark.usefixtures("no_errors")
def test_a_second_client_sees_the_reshard_through_the_shared_namespace(
    tmp_path: Path, fresh_cluster: RedisCluster3, engines: list[Engine]
) -> None:
    """Two engines connected before a slot moves: what one stores after the move, the other
    loads (both follow the redirection; neither keeps serving from the old owner)."""
    cluster = fresh_cluster
    writer, _, keys = seeded_engine(tmp_path / "w", cluster.url, engines, 1, cluster=True)
    reader, rows, _ = seeded_engine(tmp_path / "r", cluster.url, engines, 0, cluster=True)
    slot = _slot_of(writer.tier, keys[0])
    src, dst = _other_master(cluster, slot)
    cluster.move_slot(slot, src, dst)
    writer.tier.submit_store(job(1, keys, [0], load=False))
    assert collect(writer, {1}) == {1: True}
    rows[7] = 0
    reader.tier.submit_load(job(2, keys, [7], load=True))
    assert collect(reader, {2}) == {2: True}
    _assert_rows(rows, {7: keys[0]})


# ---------------------------------------------------------------------------------------------
# ASK: a slot in the middle of a migration (MIGRATING on the source, IMPORTING on the target)
# ---------------------------------------------------------------------------------------------


def _keys_sharing_a_slot(tier: RedisSecondaryTier, n: int) -> list[OffloadKey]:
    """``n`` keys whose values hash to the same slot (found by searching key indices)."""
    by_slot: dict[int, list[OffloadKey]] = {}
    for i in range(200_000):
        key = key_of(i)
        same = by_slot.setdefault(_slot_of(tier, key), [])
        same.append(key)
        if len(same) == n:
            return same
    raise AssertionError(f"no {n} keys in one slot")


@pytest.mark.usefixtures("no_errors")
def test_ask_during_a_migration_serves_moved_and_unmoved_keys(
    tmp_path: Path, fresh_cluster: RedisCluster3, engines: list[Engine]
) -> None:
    cluster = fresh_cluster
    engine, rows, _ = seeded_engine(tmp_path, cluster.url, engines, 0, cluster=True)
    tier = engine.tier
    moved, unmoved, new = _keys_sharing_a_slot(tier, 3)
    for row, key in enumerate((moved, unmoved, new)):
        rows[row] = pattern(key)
    tier.submit_store(job(1, [moved, unmoved], [0, 1], load=False))
    assert collect(engine, {1}) == {1: True}
    slot = _slot_of(tier, moved)
    src, dst = _other_master(cluster, slot)
    cluster.begin_migration(slot, src, dst)
    cluster.migrate_keys(src, dst, [tier.redis_key(moved)])
    assert cluster.keys_in_slot(slot, src) == [tier.redis_key(unmoved)]

    # Lookups and a load of both: the moved key through ASK, the other from the source.
    assert _probe(tier, [moved, unmoved], ReqContext("r")) == [True, True]
    rows[4:6] = 0
    tier.submit_load(job(2, [moved, unmoved], [4, 5], load=True))
    assert collect(engine, {2}) == {2: True}
    _assert_rows(rows, {4: moved, 5: unmoved})
    # A store into the migrating slot: the new key goes to the target (ASK), the one still on
    # the source is skipped (EXISTS answered there).
    tier.submit_store(job(3, [new, unmoved], [2, 1], load=False))
    assert collect(engine, {3}) == {3: True}
    assert tier.stats()["blocks_skipped"] == 1
    assert sorted(cluster.keys_in_slot(slot, dst)) == sorted(map(tier.redis_key, (moved, new)))
    # ASK is one-shot: the slot map still names the source until the migration ends.
    assert _mapped_port(tier, slot) == cluster.nodes[src].port

    # The migration ends: everything loads from the new owner.
    cluster.migrate_keys(src, dst, [tier.redis_key(unmoved)])
    cluster.finish_migration(slot, src, dst)
    rows[4:7] = 0
    tier.submit_load(job(4, [moved, unmoved, new], [4, 5, 6], load=True))
    assert collect(engine, {4}) == {4: True}
    _assert_rows(rows, {4: moved, 5: unmoved, 6: new})
    assert _mapped_port(tier, slot) == cluster.nodes[dst].port
    counters = tier.stats()
    assert counters["load_failures"] == 0 and counters["store_failures"] == 0
    assert not tier.breaker_open


@pytest.mark.usefixtures("no_errors")
def test_ask_to_a_master_the_client_never_saw_misses_until_the_slot_has_moved(
    tmp_path: Path, fresh_cluster: RedisCluster3, engines: list[Engine]
) -> None:
    """Scale-out: a master added after the client loaded its slot map, owning no slot yet, is
    not in the map, so an ``ASK`` to it is not followed: the key misses and its load fails
    cleanly until the slot's migration ends; then ``MOVED`` reloads the map, which lists it."""
    cluster = fresh_cluster
    engine, rows, keys = seeded_engine(tmp_path, cluster.url, engines, 1, cluster=True)
    tier = engine.tier
    tier.submit_store(job(1, keys, [0], load=False))
    assert collect(engine, {1}) == {1: True}
    new = cluster.add_master()
    slot = _slot_of(tier, keys[0])
    src = cluster.owner(slot)
    cluster.begin_migration(slot, src, new)
    cluster.migrate_keys(src, new, [tier.redis_key(keys[0])])

    assert _probe(tier, keys, ReqContext("r")) == [False]
    rows[1] = 0
    tier.submit_load(job(2, keys, [1], load=True))
    assert collect(engine, {2}) == {2: False}
    assert not rows[1].any(), "nothing written by a failed load"
    counters = tier.stats()
    assert counters["load_failures"] == 1 and not tier.breaker_open

    cluster.finish_migration(slot, src, new)
    tier.submit_load(job(3, keys, [1], load=True))
    assert collect(engine, {3}) == {3: True}
    _assert_rows(rows, {1: keys[0]})
    assert _mapped_port(tier, slot) == cluster.nodes[new].port


@pytest.mark.usefixtures("no_errors")
def test_a_redirection_loop_fails_the_job_after_one_follow_of_each_kind(
    tmp_path: Path,
    fresh_cluster: RedisCluster3,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Slots MIGRATING on their owner while the target is not IMPORTING (the wrong order of
    the two SETSLOTs): the owner answers ``ASK`` for a new key, the target ``MOVED`` back,
    forever. The tier follows each redirection once, then fails the store cleanly, with one
    warning however many slots fail; once the target imports the slot, the store succeeds."""
    cluster = fresh_cluster
    engine, rows, keys = seeded_engine(tmp_path, cluster.url, engines, 2, cluster=True)
    tier = engine.tier
    slots = [_slot_of(tier, k) for k in keys]
    assert slots[0] != slots[1]
    for slot in slots:
        cluster.set_migrating(slot, *_other_master(cluster, slot))
    for n, key in enumerate(keys):  # one job per slot: each fails on its own MOVED
        tier.submit_store(job(n + 1, [key], [n], load=False))
        assert collect(engine, {n + 1}) == {n + 1: False}
    counters = tier.stats()
    assert counters["store_failures"] == 2 and counters["blocks_written"] == 0
    assert not tier.breaker_open
    warned = [r for r in caplog.records if "store of" in r.getMessage()]
    assert len(warned) == 1 and "MovedError" in warned[0].getMessage(), warned
    assert _probe(tier, keys[:1], ReqContext("r")) == [False]

    src, dst = _other_master(cluster, slots[0])
    cluster.set_importing(slots[0], src, dst)
    tier.submit_store(job(3, keys[:1], [0], load=False))
    assert collect(engine, {3}) == {3: True}
    assert cluster.keys_in_slot(slots[0], dst) == [tier.redis_key(keys[0])]
    cluster.finish_migration(slots[0], src, dst)
    rows[2] = 0
    tier.submit_load(job(4, keys[:1], [2], load=True))
    assert collect(engine, {4}) == {4: True}
    _assert_rows(rows, {2: keys[0]})


# ---------------------------------------------------------------------------------------------
# READONLY: writes reaching a replica
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_errors")
def test_tier_on_a_replica_fails_stores_cleanly_serves_loads_and_recovers_on_promotion(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    writer, _, keys = seeded_engine(tmp_path / "w", server.url, engines, 4)
    writer.tier.submit_store(job(1, keys[:2], [0, 1], load=False))
    assert collect(writer, {1}) == {1: True}
    replica = start_replica(server, tmp_path / "replica")
    try:
        sync_replicas(server)
        engine, rows, _ = seeded_engine(tmp_path / "r", replica.url, engines, 4)
        tier = engine.tier
        # Stores: READONLY, the job fails and is counted; the replica is reachable (no breaker).
        tier.submit_store(job(2, keys[2:4], [2, 3], load=False))
        assert collect(engine, {2}) == {2: False}
        counters = tier.stats()
        assert counters["store_failures"] == 1 and counters["blocks_written"] == 0
        assert not tier.breaker_open
        # Loads and lookups are served by the replica, bit-exact.
        assert _probe(tier, keys, ReqContext("r")) == [True, True, False, False]
        rows[4:6] = 0
        tier.submit_load(job(3, keys[:2], [4, 5], load=True))
        assert collect(engine, {3}) == {3: True}
        _assert_rows(rows, {4: keys[0], 5: keys[1]})
        # Promoted (REPLICAOF NO ONE, what a failover does): stores succeed again.
        admin = replica.client()
        admin.replicaof("NO", "ONE")
        poll_until(lambda: admin.info("replication")["role"] == "master", "replica promoted")
        admin.close()
        tier.submit_store(job(4, keys[2:4], [2, 3], load=False))
        assert collect(engine, {4}) == {4: True}
        rows[6:8] = 0
        tier.submit_load(job(5, keys[2:4], [6, 7], load=True))
        assert collect(engine, {5}) == {5: True}
        _assert_rows(rows, {6: keys[2], 7: keys[3]})
        assert tier.stats()["store_failures"] == 1
    finally:
        replica.stop()


@pytest.mark.usefixtures("no_errors")
def test_cluster_failover_demoting_the_master_is_followed(
    tmp_path: Path, fresh_cluster: RedisCluster3, engines: list[Engine]
) -> None:
    """``CLUSTER FAILOVER``: the master the tier's slot map names becomes a replica, which
    redirects every command (``MOVED``) to its promoted replica; the tier follows."""
    cluster = fresh_cluster
    engine, rows, keys = seeded_engine(tmp_path, cluster.url, engines, 8, cluster=True)
    tier = engine.tier
    tier.submit_store(job(1, keys[:6], list(range(6)), load=False))
    assert collect(engine, {1}) == {1: True}
    owners = [cluster.owner(_slot_of(tier, k)) for k in keys]
    master = owners[0]
    mine = [k for k, o in zip(keys, owners, strict=True) if o == master]
    stored, unstored = [k for k in mine if k in keys[:6]], [k for k in mine if k in keys[6:]]
    assert stored and unstored, f"keys of master {master}: {owners}"
    replica = cluster.add_replica(master)
    cluster.failover(replica, master)
    assert _mapped_port(tier, _slot_of(tier, mine[0])) == cluster.nodes[master].port

    assert _probe(tier, stored[:1], ReqContext("r")) == [True]
    row = keys.index(stored[0])
    rows[row] = 0
    tier.submit_load(job(2, stored[:1], [row], load=True))
    assert collect(engine, {2}) == {2: True}
    _assert_rows(rows, {row: stored[0]})
    row = keys.index(unstored[0])
    tier.submit_store(job(3, unstored[:1], [row], load=False))
    assert collect(engine, {3}) == {3: True}
    assert tier.redis_key(unstored[0]) in cluster.keys_in_slot(_slot_of(tier, unstored[0]), replica)
    assert _mapped_port(tier, _slot_of(tier, mine[0])) == cluster.nodes[replica].port
    counters = tier.stats()
    assert counters["load_failures"] == 0 and counters["store_failures"] == 0
    assert not tier.breaker_open
