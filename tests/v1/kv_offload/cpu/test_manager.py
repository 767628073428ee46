# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of CPUOffloadingManager: block lifecycle, eviction, events, stats and reset."""

from __future__ import annotations

import numpy as np
import pytest

from tests.v1.kv_offload.cpu.manager_state import (
    check_invariants,
    free_rows,
    load_pins,
    pending_stores,
)
from tests.v1.kv_offload.cpu.policies.utils import arc_lists, lru_order
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    OffloadKeyStateError,
    OffloadPolicy,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

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
    """Store and complete blocks ``indices``; return the slots of those not stored before."""
    out = manager.prepare_store(ks(*indices), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
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


def test_failed_store_drops_only_its_blocks(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0)
    out = manager.prepare_store(ks(0, 1, 2), CTX)
    assert out is not None and out.keys_to_store == ks(1, 2)
    manager.complete_store(out.keys_to_store, CTX, success=False)
    assert manager.lookup(k(0), CTX) is True
    assert manager.lookup(k(1), CTX) is False and manager.lookup(k(2), CTX) is False
    assert manager.num_free_blocks == 3
    stats = manager.get_stats()
    assert stats["failed_stores"] == 2 and stats["stores"] == 1
    # Only block 0's store produced an event; the failure produced none.
    assert list(manager.take_events()) == [OffloadingEvent(ks(0), "CPU", removed=False)]


def test_complete_store_ignores_ready_blocks(policy: str) -> None:
    """Upstream's contract: completing a stored block again changes nothing, either way."""
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0, 1)
    manager.prepare_load(ks(0), CTX)
    list(manager.take_events())
    before = _state(manager)
    for success in (True, False):
        manager.complete_store(ks(0, 1), CTX, success=success)
        manager.complete_store(ks(1), CTX, success=success)
    assert _state(manager) == before
    assert ref_cnt(manager, 0) == 1, "a pinned block stays pinned"
    assert ref_cnt(manager, 1) == 0
    assert list(manager.take_events()) == []
    assert manager.get_stats()["stores"] == 2
    assert manager.get_stats()["failed_stores"] == 0
    check_invariants(manager)


def test_complete_store_ignores_unknown_keys(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    for success in (True, False):
        manager.complete_store(ks(7), CTX, success=success)
    assert manager.lookup(k(7), CTX) is False
    assert manager.num_free_blocks == 4
    assert list(manager.take_events()) == []
    check_invariants(manager)


@pytest.mark.parametrize("success", [True, False])
def test_already_stored_key_completed_with_the_new_keys(policy: str, success: bool) -> None:
    """Upstream vLLM's scenario: 2 is stored, filtered out of the next ``prepare_store`` and
    then completed with the new keys; everything the call completed is as it says."""
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 1, 2)
    out = manager.prepare_store(ks(2, 3, 4, 5), CTX)
    assert out is not None and out.keys_to_store == ks(3, 4, 5)
    assert out.evicted_keys == ks(1), "2 was passed in: it is protected from the eviction"
    list(manager.take_events())
    manager.complete_store(ks(2, 3, 4, 5), CTX, success=success)
    if success:
        assert [manager.lookup(key, CTX) for key in ks(2, 3, 4, 5)] == [True] * 4
        assert list(manager.take_events()) == [OffloadingEvent(ks(3, 4, 5), "CPU", removed=False)]
    else:
        assert [manager.lookup(key, CTX) for key in ks(2, 3, 4, 5)] == [True, False, False, False]
        assert manager.num_free_blocks == 3, "the new blocks' rows are free again"
        assert list(manager.take_events()) == []
        assert manager.get_stats()["failed_stores"] == 3
    assert pending_stores(manager, "req-0") == []
    check_invariants(manager)


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


def test_errors_name_method_key_request_and_state(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    with pytest.raises(
        OffloadKeyStateError, match=f"prepare_load: key {k(0).hex()} of request 'req-0' is not "
    ):
        manager.prepare_load(ks(0), CTX)
    manager.prepare_store(ks(1), CTX)
    with pytest.raises(
        OffloadKeyStateError,
        match=f"prepare_load: key {k(1).hex()} .* being written .* pending for request 'req-0'",
    ):
        manager.prepare_load(ks(1), CTX)
    manager.complete_store(ks(1), CTX)
    with pytest.raises(
        OffloadKeyStateError,
        match=f"complete_load: key {k(1).hex()} .* ready and not pinned; this request holds 0",
    ):
        manager.complete_load(ks(1), CTX)
    with pytest.raises(OffloadKeyStateError, match=f"complete_load: key {k(2).hex()} .*not off"):
        manager.complete_load(ks(2), CTX)
    manager.prepare_store(ks(2), READER_A)
    with pytest.raises(OffloadKeyStateError) as info:
        manager.complete_store(ks(2), CTX)
    assert isinstance(info.value, ValueError)
    assert (info.value.method, info.value.key, info.value.req_id) == (
        "complete_store",
        k(2),
        "req-0",
    )
    assert info.value.state == "being written (its store is pending for request 'reader-a')"


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


# ---------------------------------------------------------------------------------------------
# Callers that misbehave: refused at the call, before anything changes
# ---------------------------------------------------------------------------------------------

READER_A = ReqContext("reader-a")
READER_B = ReqContext("reader-b")
_REQS = ("req-0", "reader-a", "reader-b")


def _state(manager: CPUOffloadingManager) -> object:
    """Everything a refused call must leave as it was (eviction order included)."""
    policy = manager.policy
    order = lru_order(policy) if isinstance(policy, LRUCachePolicy) else None
    if isinstance(policy, ARCCachePolicy):
        order = arc_lists(policy)
    return (
        [(key, block.block_id, block.ref_cnt) for key, block in policy.items()],
        free_rows(manager),
        manager.num_free_blocks,
        manager.get_stats(),
        {req: load_pins(manager, req) for req in _REQS},
        {req: pending_stores(manager, req) for req in _REQS},
        order,
    )


def test_second_complete_load_of_one_reader_keeps_the_other_readers_pin(policy: str) -> None:
    manager = CPUOffloadingManager(2, cache_policy=policy)
    store(manager, 0)
    manager.prepare_load(ks(0), READER_A)
    manager.prepare_load(ks(0), READER_B)
    manager.complete_load(ks(0), READER_A)
    assert ref_cnt(manager, 0) == 1
    before = _state(manager)
    with pytest.raises(OffloadKeyStateError, match=r"complete_load: .* 'reader-a' .* holds 0 pin"):
        manager.complete_load(ks(0), READER_A)
    assert _state(manager) == before
    # B still reads the row: it must not be evicted for a new store.
    assert manager.prepare_store(ks(1, 2), CTX) is None
    assert manager.lookup(k(0), CTX) is True
    manager.complete_load(ks(0), READER_B)
    assert ref_cnt(manager, 0) == 0
    check_invariants(manager)


def test_pins_are_per_request_and_counted(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    store(manager, 0, 1)
    manager.prepare_load(ks(0, 0, 1), READER_A)
    assert load_pins(manager, "reader-a") == {k(0): 2, k(1): 1}
    with pytest.raises(OffloadKeyStateError, match="holds 0 pin"):
        manager.complete_load(ks(0), READER_B)
    with pytest.raises(OffloadKeyStateError, match=r"holds 2 pin.* releases 3"):
        manager.complete_load(ks(0, 1, 0, 0), READER_A)
    assert ref_cnt(manager, 0) == 2 and ref_cnt(manager, 1) == 1
    # Partial and out-of-order releases are fine.
    manager.complete_load(ks(1, 0), READER_A)
    assert load_pins(manager, "reader-a") == {k(0): 1}
    manager.complete_load((k(0),), READER_A)
    assert load_pins(manager, "reader-a") == {}
    assert [ref_cnt(manager, i) for i in (0, 1)] == [0, 0]
    check_invariants(manager)


@pytest.mark.parametrize("success", [True, False])
def test_complete_store_of_a_never_prepared_key_is_ignored(policy: str, success: bool) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    before = _state(manager)
    manager.complete_store(ks(3), CTX, success=success)
    assert _state(manager) == before
    assert manager.num_free_blocks == 4


@pytest.mark.parametrize("other", ["ready", "loading", "absent", "other-writer"])
@pytest.mark.parametrize("success", [True, False])
def test_complete_store_with_one_other_key(policy: str, other: str, success: bool) -> None:
    """A key ready, pinned or absent is ignored beside the request's pending one; a key
    another request is writing is refused, and then no key of the call changes."""
    manager = CPUOffloadingManager(8, cache_policy=policy, enable_events=True)
    store(manager, 0)
    if other == "loading":
        manager.prepare_load(ks(0), READER_A)
    elif other == "other-writer":
        manager.prepare_store(ks(7), READER_B)
    out = manager.prepare_store(ks(6), CTX)
    assert out is not None and out.keys_to_store == ks(6)
    list(manager.take_events())
    extra = {"ready": 0, "loading": 0, "absent": 5, "other-writer": 7}[other]
    if other == "other-writer":
        before = _state(manager)
        with pytest.raises(
            OffloadKeyStateError,
            match=f"key {k(extra).hex()} .*is being written .* pending for request 'reader-b'",
        ):
            manager.complete_store([k(6), k(extra)], CTX, success=success)
        assert _state(manager) == before
        assert list(manager.take_events()) == []
        assert manager.lookup(k(6), CTX) is None, "the legitimate pending store is still pending"
        manager.complete_store(ks(6), CTX, success=success)
    else:
        extra_before = ref_cnt(manager, extra)
        manager.complete_store([k(6), k(extra)], CTX, success=success)
        assert ref_cnt(manager, extra) == extra_before, "the other key is as it was"
    assert manager.lookup(k(6), CTX) is success
    stored = [OffloadingEvent(ks(6), "CPU", removed=False)] if success else []
    assert list(manager.take_events()) == stored
    check_invariants(manager)


def test_complete_store_twice_is_ignored(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    out = manager.prepare_store(ks(0, 1), CTX)
    assert out is not None
    manager.complete_store(ks(1), CTX)  # a partial completion
    manager.complete_store(ks(1), CTX, success=False)  # 1 is stored: ignored, not dropped
    assert manager.lookup(k(1), CTX) is True
    assert pending_stores(manager, "req-0") == ks(0)
    manager.complete_store(ks(0, 0), CTX)  # a key listed twice counts once
    assert manager.get_stats()["stores"] == 2
    assert manager.get_stats()["failed_stores"] == 0
    check_invariants(manager)


def test_prepare_load_validates_every_key_before_pinning(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    store(manager, 0)
    manager.prepare_store(ks(1), CTX)
    before = _state(manager)
    for keys in (ks(0, 2), ks(0, 1)):
        with pytest.raises(OffloadKeyStateError, match="prepare_load"):
            manager.prepare_load(keys, READER_A)
        assert _state(manager) == before
    assert manager.prepare_store(ks(2, 3, 4), CTX) is not None, "block 0 is not pinned"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.prepare_store(["abc"], CTX), "prepare_store: .*got str 'abc'"),
        (lambda m: m.prepare_store([1, 2], CTX), "prepare_store: .*got int 1 "),
        (lambda m: m.prepare_store(b"abc", CTX), "prepare_store: .*a single bytes"),
        (lambda m: m.prepare_store("abc", CTX), "prepare_store: .*a single str"),
        (lambda m: m.lookup(12345, CTX), "lookup: .*got int 12345 .*'req-0'"),
        (lambda m: m.lookup("k", CTX), "lookup: .*got str"),
        (lambda m: m.prepare_load([1], CTX), "prepare_load: .*got int 1"),
        (lambda m: m.complete_load([1], CTX), "complete_load: .*got int 1"),
        (lambda m: m.complete_store(["x"], CTX), "complete_store: .*got str 'x'"),
        (lambda m: m.complete_store([k(9), 3], CTX, False), "complete_store: .*got int 3"),
    ],
)
def test_values_that_are_not_keys_raise_type_error_at_the_call(
    policy: str, call: object, match: str
) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    store(manager, 0)
    manager.prepare_store(ks(9), CTX)
    before = _state(manager)
    with pytest.raises(TypeError, match=match):
        call(manager)  # type: ignore[operator]
    assert _state(manager) == before


def test_calls_after_shutdown_raise(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy, enable_events=True)
    store(manager, 0)
    manager.prepare_load(ks(0), CTX)
    manager.shutdown()
    manager.shutdown()  # idempotent
    assert manager.is_shut_down
    calls = {
        "lookup": lambda: manager.lookup(k(0), CTX),
        "prepare_store": lambda: manager.prepare_store(ks(1), CTX),
        "prepare_load": lambda: manager.prepare_load(ks(0), CTX),
        "complete_load": lambda: manager.complete_load(ks(0), CTX),
        "complete_store": lambda: manager.complete_store(ks(1), CTX),
        "touch": lambda: manager.touch(ks(0), CTX),
        "reset_cache": manager.reset_cache,
        "on_new_request": lambda: manager.on_new_request(CTX),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=f"{name}: the manager is shut down"):
            call()
    # Observers still answer.
    assert manager.get_stats()["stores"] == 1
    assert [e.removed for e in manager.take_events()] == [False]
