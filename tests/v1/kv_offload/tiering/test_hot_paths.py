# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The tiering manager's hot paths keep their semantics.

* A promotion reserves its primary rows with ``reserve_rows`` (no ``prepare_store`` and no
  transfer spec): same rows, same eviction, same events as ``prepare_store`` of those keys.
* ``CPULoadStoreSpec.from_rows`` (the manager's own rows, unchecked) builds the spec the checking
  constructor builds.
* ``lookup`` answers from the primary policy directly and counts the primary's hits and misses.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_offload.cpu.manager_state import check_invariants
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

CTX = ReqContext("r")


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.fixture
def primaries(tmp_path: Path) -> Iterator[tuple[CPUPrimaryTierOffloadingManager, ...]]:
    managers = []
    for name, policy in (("a", "lru"), ("b", "lru"), ("c", "arc"), ("d", "arc")):
        region = SharedOffloadRegion(f"hot-{name}", 6, 64, directory=tmp_path)
        managers.append(
            CPUPrimaryTierOffloadingManager(6, region, cache_policy=policy, enable_events=True)
        )
    yield tuple(managers)
    for manager in managers:
        manager.shutdown()


@pytest.mark.parametrize("seed", range(20))
def test_reserve_rows_is_a_prepare_store_without_a_spec(
    seed: int, primaries: tuple[CPUPrimaryTierOffloadingManager, ...]
) -> None:
    rng = random.Random(seed)
    for by_store, by_reserve in (primaries[:2], primaries[2:]):
        pinned: list[OffloadKey] = []
        for _ in range(60):
            key = k(rng.randrange(12))
            op = rng.random()
            found = by_store.lookup(key, CTX)
            assert by_reserve.lookup(key, CTX) is found
            if op < 0.5 and found is False:
                # One to three distinct absent keys, reserved in one call.
                keys = [key] + [
                    other
                    for other in map(k, rng.sample(range(12), rng.randrange(3)))
                    if other != key and by_store.policy.get(other) is None
                ]
                out = by_store.prepare_store(keys, CTX)
                rows = by_reserve.reserve_rows(keys, CTX)
                assert (out is None) == (rows is None)
                if out is not None:
                    assert out.keys_to_store == keys
                    assert out.store_spec.block_ids.tolist() == rows  # type: ignore[attr-defined]
                    ok = rng.random() < 0.8
                    by_store.complete_store(keys, CTX, success=ok)
                    by_reserve.complete_write(keys, CTX, success=ok)
            elif op < 0.7 and found is True:
                for m in (by_store, by_reserve):
                    m.prepare_load([key], CTX)
                pinned.append(key)
            elif op < 0.8 and pinned:
                done = pinned.pop(rng.randrange(len(pinned)))
                for m in (by_store, by_reserve):
                    m.complete_load([done], CTX)
            else:
                for m in (by_store, by_reserve):
                    m.touch([key], CTX)
            check_invariants(by_store)
            check_invariants(by_reserve)
            assert list(by_store.take_events()) == list(by_reserve.take_events())
            assert by_store.get_stats() == by_reserve.get_stats()
            assert sorted((key, b.block_id, b.ref_cnt) for key, b in by_store.policy.items()) == (
                sorted((key, b.block_id, b.ref_cnt) for key, b in by_reserve.policy.items())
            )


def test_from_rows_matches_the_checked_constructor() -> None:
    for rows in ([], [0], [5, 2, 9]):
        fast, checked = CPULoadStoreSpec.from_rows(rows), CPULoadStoreSpec(rows)
        assert fast.block_ids.dtype == checked.block_ids.dtype == np.int64
        assert fast.block_ids.flags.c_contiguous and fast.block_ids.ndim == 1
        assert fast.block_ids.tolist() == checked.block_ids.tolist()
        assert repr(fast) == repr(checked)


def test_lookup_counts_the_primarys_hits_and_misses(tmp_path: Path) -> None:
    region = SharedOffloadRegion("hot-lookup", 4, 64, directory=tmp_path)
    primary = CPUPrimaryTierOffloadingManager(4, region)
    tier = ExampleSecondaryTierManager(None, primary.get_kv_memoryview(), "example")  # type: ignore[arg-type]
    manager = TieringOffloadingManager(primary, [tier])
    try:
        out = manager.prepare_store([k(1)], CTX)
        assert out is not None
        assert manager.lookup(k(1), CTX) is None  # being written
        manager.complete_store([k(1)], CTX)
        assert manager.lookup(k(1), CTX) is True
        assert manager.lookup(k(2), CTX) is False
        stats = manager.get_stats()
        assert (stats["hits"], stats["misses"]) == (1, 1)
        manager.reset_cache()
        stats = manager.get_stats()
        assert (stats["hits"], stats["misses"]) == (0, 0)
        # 1 is in the example tier only now: a miss in the primary, then a promotion.
        assert manager.lookup(k(1), CTX) is None
        assert manager.get_stats()["misses"] == 1
    finally:
        manager.shutdown()
