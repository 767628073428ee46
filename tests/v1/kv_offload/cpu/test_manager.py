"""Tests of CPUOffloadingManager: block lifecycle, eviction, events, stats and reset."""

from __future__ import annotations

import numpy as np
import pytest

from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

POLICIES = ["lru", "arc"]
CTX = ReqContext("req-0")


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*indices: int) -> list[OffloadKey]:
    return [k(i) for i in indices]


def slots(spec: object) -> list[int]:
    assert isinstance(spec, CPULoadStoreSpec)
    assert spec.medium() == "CPU"
    assert spec.block_ids.dtype == np.int64
    return [int(x) for x in spec.block_ids]


def store(manager: CPUOffloadingManager, *indices: int) -> list[int]:
    """Store and complete blocks ``indices``; return their slots."""
    out = manager.prepare_store(ks(*indices), CTX)
    assert out is not None
    manager.complete_store(ks(*indices), CTX)
    return slots(out.store_spec)


def ref_cnt(manager: CPUOffloadingManager, i: int) -> int | None:
    block = manager.policy.get(k(i))
    return None if block is None else block.ref_cnt


@pytest.fixture(params=POLICIES)
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_identity_and_request_policy() -> None:
    manager = CPUOffloadingManager(4)
    assert manager.medium == "CPU"
    assert manager.num_blocks == 4
    assert manager.num_free_blocks == 4
    assert manager.on_new_request(CTX).policy is OffloadPolicy.BLOCK_LEVEL
    assert list(manager.take_events()) == []  # events disabled


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_num_blocks_must_be_positive(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        CPUOffloadingManager(num_blocks)


def test_store_lookup_load(policy: str) -> None:
    manager = CPUOffloadingManager(8, cache_policy=policy)
    assert manager.lookup(k(0), CTX) is False
    out = manager.prepare_store(ks(0, 1, 2), CTX)
    assert out is not None
    assert out.keys_to_store == ks(0, 1, 2)
    assert slots(out.store_spec) == [0, 1, 2]
    assert out.evicted_keys == []
    assert manager.num_free_blocks == 5
    # Being written: present but not readable.
    assert [manager.lookup(key, CTX) for key in ks(0, 1, 2)] == [None, None, None]
    manager.complete_store(ks(0, 1, 2), CTX)
    assert [manager.lookup(key, CTX) for key in ks(0, 1, 2, 3)] == [True, True, True, False]

    spec = manager.prepare_load(ks(2, 0), CTX)
    assert slots(spec) == [2, 0], "spec follows the order of the keys"
    assert ref_cnt(manager, 2) == 1 and ref_cnt(manager, 0) == 1
    spec = manager.prepare_load(ks(2), CTX)
    assert ref_cnt(manager, 2) == 2
    manager.complete_load(ks(2, 0), CTX)
    manager.complete_load(ks(2), CTX)
    assert [ref_cnt(manager, i) for i in range(3)] == [0, 0, 0]
    assert manager.lookup(k(2), CTX) is True


def test_prepare_store_of_present_keys_returns_empty_output(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    store(manager, 0)
    manager.prepare_store(ks(1), CTX)  # 1 is being written
    out = manager.prepare_store(ks(0, 1), CTX)
    assert out is not None, "empty output, not None, when everything is present"
    assert out.keys_to_store == []
    assert slots(out.store_spec) == []
    assert out.evicted_keys == []
    assert manager.num_free_blocks == 2


def test_prepare_store_with_duplicate_keys_allocates_once(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    out = manager.prepare_store(ks(5, 6, 5, 6, 5), CTX)
    assert out is not None
    assert out.keys_to_store == ks(5, 6)
    assert slots(out.store_spec) == [0, 1]
    assert manager.num_free_blocks == 2
    manager.complete_store(ks(5, 6, 5), CTX)
    assert manager.get_stats()["stores"] == 2


def test_fresh_slots_first_then_recycled(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    out = manager.prepare_store(ks(0, 1), CTX)
    assert out is not None
    manager.complete_store(ks(0, 1), CTX, success=False)  # slots 0 and 1 freed
    assert manager.num_free_blocks == 4
    assert store(manager, 2, 3, 4) == [2, 3, 1]
    assert store(manager, 5) == [0]
    assert manager.num_free_blocks == 0


def test_eviction_when_full(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0, 1, 2, 3)
    list(manager.take_events())
    out = manager.prepare_store(ks(4, 5), CTX)
    assert out is not None
    # The run 0..3 is evicted tail first (see test_eviction_order.py).
    assert out.evicted_keys == ks(3, 2)
    assert sorted(slots(out.store_spec)) == [2, 3]
    assert manager.lookup(k(3), CTX) is False and manager.lookup(k(2), CTX) is False
    assert list(manager.take_events()) == [
        OffloadingEvent(keys=ks(3, 2), medium="CPU", removed=True)
    ]


def test_already_stored_block_not_evicted_during_prepare_store(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    store(manager, 0, 1, 2, 3)  # 3 (the run's tail) is the first eviction candidate of both
    out = manager.prepare_store(ks(3, 4, 5), CTX)
    assert out is not None
    assert out.keys_to_store == ks(4, 5)
    assert k(3) not in out.evicted_keys
    assert out.evicted_keys == ks(2, 1)
    assert manager.lookup(k(3), CTX) is True


def test_prepare_store_fails_when_only_requested_keys_are_evictable(policy: str) -> None:
    manager = CPUOffloadingManager(2, cache_policy=policy)
    store(manager, 0, 1)
    assert manager.prepare_store(ks(0, 1, 2), CTX) is None
    assert [manager.lookup(key, CTX) for key in ks(0, 1, 2)] == [True, True, False]


def test_prepare_store_none_when_everything_is_pinned(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0, 1)
    manager.prepare_store(ks(2, 3), CTX)  # being written
    manager.prepare_load(ks(0, 1), CTX)  # pinned
    events_before = list(manager.take_events())
    stats_before = manager.get_stats()
    assert manager.prepare_store(ks(4), CTX) is None
    assert manager.prepare_store(ks(4, 5, 6, 7, 8), CTX) is None  # more than num_blocks
    assert manager.get_stats() == stats_before
    assert list(manager.take_events()) == []
    assert manager.num_free_blocks == 0
    assert [ref_cnt(manager, i) for i in range(5)] == [1, 1, -1, -1, None]
    assert len(events_before) == 1 and not events_before[0].removed

    # Once a reader is done, its block can go.
    manager.complete_load(ks(1), CTX)
    out = manager.prepare_store(ks(4), CTX)
    assert out is not None and out.evicted_keys == ks(1)


def test_partial_eviction_capacity_is_all_or_nothing(policy: str) -> None:
    manager = CPUOffloadingManager(3, cache_policy=policy)
    store(manager, 0, 1, 2)
    manager.prepare_load(ks(0, 1), CTX)
    assert manager.prepare_store(ks(3, 4), CTX) is None  # only block 2 is evictable
    assert manager.lookup(k(2), CTX) is True
    assert manager.num_free_blocks == 0


def test_failed_store_drops_only_not_ready_blocks(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0)
    out = manager.prepare_store(ks(0, 1, 2), CTX)
    assert out is not None and out.keys_to_store == ks(1, 2)
    manager.complete_store(ks(0, 1, 2), CTX, success=False)
    assert manager.lookup(k(0), CTX) is True
    assert manager.lookup(k(1), CTX) is False and manager.lookup(k(2), CTX) is False
    assert manager.num_free_blocks == 3
    stats = manager.get_stats()
    assert stats["failed_stores"] == 2 and stats["stores"] == 1
    # Only block 0's store produced an event; the failure produced none.
    assert list(manager.take_events()) == [OffloadingEvent(ks(0), "CPU", removed=False)]


def test_complete_store_never_changes_ready_blocks(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0, 1)
    manager.prepare_load(ks(0), CTX)
    list(manager.take_events())
    manager.complete_store(ks(0, 1), CTX, success=True)
    manager.complete_store(ks(0, 1), CTX, success=False)
    assert ref_cnt(manager, 0) == 1, "a pinned block stays pinned"
    assert ref_cnt(manager, 1) == 0
    assert list(manager.take_events()) == []
    assert manager.get_stats()["stores"] == 2
    assert manager.get_stats()["failed_stores"] == 0


def test_complete_store_ignores_unknown_keys(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    manager.complete_store(ks(7), CTX)
    manager.complete_store(ks(7), CTX, success=False)
    assert manager.lookup(k(7), CTX) is False
    assert manager.num_free_blocks == 4


def test_events(policy: str) -> None:
    manager = CPUOffloadingManager(2, cache_policy=policy, enable_events=True)
    assert list(manager.take_events()) == []
    out = manager.prepare_store(ks(0, 1), CTX)
    assert out is not None
    assert list(manager.take_events()) == [], "no event before the store completes"
    manager.complete_store(ks(1), CTX)
    manager.complete_store(ks(0), CTX)
    manager.prepare_store(ks(2), CTX)
    manager.complete_store(ks(2), CTX)
    events = list(manager.take_events())
    assert events == [
        OffloadingEvent(ks(1), "CPU", removed=False),
        OffloadingEvent(ks(0), "CPU", removed=False),
        OffloadingEvent(ks(1), "CPU", removed=True),
        OffloadingEvent(ks(2), "CPU", removed=False),
    ]
    assert list(manager.take_events()) == [], "take_events drains"


def test_no_events_when_disabled(policy: str) -> None:
    manager = CPUOffloadingManager(1, cache_policy=policy)
    store(manager, 0)
    store(manager, 1)  # evicts 0
    manager.reset_cache()
    assert list(manager.take_events()) == []


def test_reset_cache(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0, 1, 2)
    manager.prepare_load(ks(1), CTX)
    manager.prepare_store(ks(3), CTX)  # being written
    manager.lookup(k(0), CTX)
    manager.lookup(k(9), CTX)
    list(manager.take_events())
    manager.reset_cache()
    assert manager.num_free_blocks == 4
    assert [manager.lookup(key, CTX) for key in ks(0, 1, 2, 3)] == [False] * 4
    (event,) = manager.take_events()
    assert event.removed and event.medium == "CPU"
    assert sorted(event.keys) == ks(0, 1, 2), "removal of every ready block, none in flight"
    stats = manager.get_stats()
    assert stats["hits"] == 0 and stats["stores"] == 0 and stats["used_blocks"] == 0
    assert stats["misses"] == 4  # the lookups just above
    # Slots are handed out from the start again.
    assert store(manager, 5, 6) == [0, 1]


def test_stats(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    assert manager.get_stats() == {
        "hits": 0,
        "misses": 0,
        "stores": 0,
        "failed_stores": 0,
        "evictions": 0,
        "num_blocks": 4,
        "used_blocks": 0,
        "usage": 0.0,
    }
    store(manager, 0, 1, 2)
    manager.prepare_store(ks(3), CTX)
    manager.complete_store(ks(3), CTX, success=False)
    manager.prepare_store(ks(4), CTX)  # in flight
    assert manager.lookup(k(0), CTX) is True
    assert manager.lookup(k(4), CTX) is None  # counts as neither hit nor miss
    assert manager.lookup(k(9), CTX) is False
    store(manager, 5, 6)  # evicts two
    stats = manager.get_stats()
    assert stats == {
        "hits": 1,
        "misses": 1,
        "stores": 5,
        "failed_stores": 1,
        "evictions": 2,
        "num_blocks": 4,
        "used_blocks": 4,
        "usage": 1.0,
    }
    assert manager.get_stats() == stats, "get_stats has no side effect"
    stats["hits"] = 100
    assert manager.get_stats()["hits"] == 1, "a snapshot, not a live view"


def test_assertions_name_the_key(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    with pytest.raises(AssertionError, match=f"{k(0).hex()} is not offloaded"):
        manager.prepare_load(ks(0), CTX)
    manager.prepare_store(ks(1), CTX)
    with pytest.raises(AssertionError, match=f"{k(1).hex()} is being written"):
        manager.prepare_load(ks(1), CTX)
    manager.complete_store(ks(1), CTX)
    with pytest.raises(AssertionError, match=f"{k(1).hex()} is not pinned"):
        manager.complete_load(ks(1), CTX)
    with pytest.raises(AssertionError, match=f"{k(2).hex()} is not offloaded"):
        manager.complete_load(ks(2), CTX)


def test_touch_changes_eviction_order(policy: str) -> None:
    manager = CPUOffloadingManager(3, cache_policy=policy)
    store(manager, 0, 1, 2)  # eviction order: 2, 1, 0 (tail first)
    manager.touch(ks(2), CTX)
    out = manager.prepare_store(ks(3), CTX)
    assert out is not None and out.evicted_keys == ks(1)


def test_released_block_is_most_recent(policy: str) -> None:
    manager = CPUOffloadingManager(3, cache_policy=policy)
    store(manager, 0, 1, 2)  # eviction order: 2, 1, 0 (tail first)
    manager.prepare_load(ks(2), CTX)
    manager.complete_load(ks(2), CTX)
    out = manager.prepare_store(ks(3, 4), CTX)
    assert out is not None and out.evicted_keys == ks(1, 0)
    assert manager.lookup(k(2), CTX) is True


def test_arc_scan_resistance() -> None:
    """ARC keeps blocks used twice while a one-off scan streams through T1."""
    manager = CPUOffloadingManager(4, cache_policy="arc")
    store(manager, 0, 1)
    manager.touch(ks(0, 1), CTX)  # used again: T2
    for i in range(10, 30):
        store(manager, i)
    assert manager.lookup(k(0), CTX) is True and manager.lookup(k(1), CTX) is True
