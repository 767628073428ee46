# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``capacity.CapacityIndex``: LRU eviction, pins, exact accounting under any interleaving.

The stateful test plays the tier's protocol against a model filesystem (a dict), with every step
that is concurrent in the tier split into separate rules (reserve / unlink victims / rename /
commit; ticket+stat / apply the observation later), so Hypothesis explores the interleavings of
I/O threads, the lookup thread, the scan and other instances sharing the directory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.kv_offload.tiering.fs.capacity import (
    CapacityIndex,
    RemoveOutcome,
    ReserveStatus,
)

from .tier_state import check_index, indexed_size, lru_keys

SIZE = 100


@dataclass(frozen=True)
class Reservation:
    """One key's ``reserve_many``: its status and the victims chosen for it."""

    status: ReserveStatus
    victims: tuple[tuple[OffloadKey, int], ...]


def reserve(index: CapacityIndex, key: OffloadKey, size: int) -> Reservation:
    statuses, victims = index.reserve_many([key], size)
    return Reservation(statuses[0], tuple(victims))


def commit(index: CapacityIndex, key: OffloadKey, size: int) -> None:
    index.commit_many([key], size)


def k(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(bytes([i])).digest(), 0)


def _store(index: CapacityIndex, key: OffloadKey, size: int = SIZE) -> list[OffloadKey]:
    """Reserve, 'unlink' the victims and commit; returns the victims."""
    res = reserve(index, key, size)
    assert res.status is ReserveStatus.OK, res
    for victim, _ in res.victims:
        index.finish_remove(victim, RemoveOutcome.REMOVED, None)
    commit(index, key, size)
    return [v for v, _ in res.victims]


def test_lru_eviction_order_with_touch() -> None:
    index = CapacityIndex(max_bytes=3 * SIZE)
    for i in range(3):
        assert _store(index, k(i)) == []
    index.touch([k(0)])
    assert _store(index, k(3)) == [k(1)]
    index.touch([k(3), k(2)])  # the first key ends up the most recent
    assert lru_keys(index) == [k(0), k(2), k(3)]
    assert _store(index, k(4)) == [k(0)]
    assert index.used_bytes == 3 * SIZE
    check_index(index)


def test_pinned_blocks_are_never_victims() -> None:
    index = CapacityIndex(max_bytes=2 * SIZE)
    _store(index, k(0))
    _store(index, k(1))
    index.pin([k(0), k(1)])
    assert reserve(index, k(2), SIZE).status is ReserveStatus.NO_ROOM
    assert index.used_bytes == 2 * SIZE  # a failed reserve changes nothing
    index.unpin([k(1)])
    assert _store(index, k(2)) == [k(1)]  # k(0) is older but pinned
    index.pin([k(0)])  # pins nest: k(0) is pinned twice now
    index.unpin([k(0)])
    assert _store(index, k(3)) == [k(2)]
    index.unpin([k(0)])
    assert _store(index, k(4)) == [k(0)]
    with pytest.raises(AssertionError, match="not pinned"):
        index.unpin([k(0)])
    check_index(index)


def test_busy_and_oversized_reservations() -> None:
    index = CapacityIndex(max_bytes=2 * SIZE)
    assert reserve(index, k(0), 3 * SIZE).status is ReserveStatus.NO_ROOM
    assert reserve(index, k(0), SIZE).status is ReserveStatus.OK
    assert reserve(index, k(0), SIZE).status is ReserveStatus.BUSY_WRITING
    index.abort(k(0))
    _store(index, k(1))
    assert index.begin_remove(k(1))
    assert reserve(index, k(1), SIZE).status is ReserveStatus.BUSY_REMOVING
    assert not index.begin_remove(k(1))
    index.finish_remove(k(1), RemoveOutcome.REMOVED, None)
    assert index.used_bytes == 0 and len(index) == 0
    check_index(index)


def test_replacing_a_wrong_size_file_accounts_both_until_commit() -> None:
    index = CapacityIndex(max_bytes=None)
    index.observe(k(0), 10, index.ticket(), hot=True)  # a truncated file found on disk
    assert reserve(index, k(0), SIZE).status is ReserveStatus.OK
    assert index.used_bytes == 10 + SIZE  # the old file is still on disk during the write
    index.abort(k(0))
    assert index.used_bytes == 10 and indexed_size(index, k(0)) == 10
    assert reserve(index, k(0), SIZE).status is ReserveStatus.OK
    commit(index, k(0), SIZE)
    assert index.used_bytes == SIZE
    check_index(index)


def test_stale_observations_are_ignored() -> None:
    index = CapacityIndex(max_bytes=None)
    ticket = index.ticket()  # a lookup stats k(0): absent...
    assert reserve(index, k(0), SIZE).status is ReserveStatus.OK
    commit(index, k(0), SIZE)  # ...meanwhile this tier writes it...
    assert index.observe(k(0), None, ticket, hot=True)  # ...the late "absent" is stale
    assert indexed_size(index, k(0)) == SIZE
    ticket = index.ticket()  # the scan stats k(0): present...
    assert index.begin_remove(k(0))
    assert not index.observe(k(0), SIZE, index.ticket(), hot=False)  # ignored while removing
    index.finish_remove(k(0), RemoveOutcome.REMOVED, None)
    assert not index.observe(k(0), SIZE, ticket, hot=False)  # ...applied after the removal
    assert index.used_bytes == 0 and k(0) not in index
    check_index(index)


def test_observations_older_than_the_window_are_conservative() -> None:
    index = CapacityIndex(max_bytes=None, change_window=2)
    ticket = index.ticket()
    for i in range(1, 4):
        _store(index, k(i))  # three changes: the window forgot the first
    assert not index.observe(k(0), SIZE, ticket, hot=True)
    assert k(0) not in index
    assert index.observe(k(0), SIZE, index.ticket(), hot=True)
    assert index.used_bytes == 4 * SIZE


def test_evict_to_fit_after_observed_files() -> None:
    index = CapacityIndex(max_bytes=2 * SIZE)
    for i in range(4):
        index.observe(k(i), SIZE, index.ticket(), hot=False)  # found by a scan: coldest first
    assert index.used_bytes == 4 * SIZE  # observations may exceed the bound...
    victims = index.evict_to_fit()  # ...until evicted back under it
    assert sorted(v for v, _ in victims) == sorted([k(2), k(3)])  # scan order is inverted
    for victim, _ in victims:
        index.finish_remove(victim, RemoveOutcome.REMOVED, None)
    assert index.used_bytes == 2 * SIZE


def test_change_callback_only_for_real_changes() -> None:
    changes: list[tuple[OffloadKey, bool]] = []
    index = CapacityIndex(
        max_bytes=SIZE, on_change=lambda key, present: changes.append((key, present))
    )
    index.observe(k(9), SIZE, index.ticket(), hot=True)  # someone else's file: no event
    res = reserve(index, k(0), SIZE)
    assert [v for v, _ in res.victims] == [k(9)]
    index.finish_remove(k(9), RemoveOutcome.VANISHED, None)  # already gone: no event
    commit(index, k(0), SIZE)
    assert index.begin_remove(k(0))
    index.finish_remove(k(0), RemoveOutcome.KEPT, SIZE)  # unlink failed: no event
    assert index.begin_remove(k(0))
    index.finish_remove(k(0), RemoveOutcome.REMOVED, None)
    assert changes == [(k(0), True), (k(0), False)]


# ---------------------------------------------------------------------------------------------
# Stateful model
# ---------------------------------------------------------------------------------------------

KEYS = [k(i) for i in range(3)]
MAX_BYTES = 2 * SIZE
keys_st = st.sampled_from(KEYS)
sizes_st = st.sampled_from([SIZE, SIZE // 2])


class IndexMachine(RuleBasedStateMachine):
    """The tier's protocol against a model directory; checks the accounting after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.index = CapacityIndex(max_bytes=MAX_BYTES, change_window=8)
        self.disk: dict[OffloadKey, int] = {}  # what really exists
        self.writing: dict[OffloadKey, bool] = {}  # reserved key -> renamed yet
        self.unlinks: list[OffloadKey] = []  # victims / corrupt files chosen, not unlinked yet
        self.pending_obs: list[tuple[OffloadKey, int | None, int]] = []
        self.pins: dict[OffloadKey, int] = {}
        self.ext_deleted: set[OffloadKey] = set()  # removed behind the index's back
        self.ext_created: set[OffloadKey] = set()  # created behind the index's back

    # The tier's own writes -------------------------------------------------------------------

    @rule(key=keys_st)
    def reserve(self, key: OffloadKey) -> None:
        before = self.index.used_bytes
        res = reserve(self.index, key, SIZE)
        if res.status is ReserveStatus.OK:
            assert key not in self.writing
            for victim, _ in res.victims:
                assert victim not in self.pins, f"pinned {victim.hex()} chosen as victim"
                self.unlinks.append(victim)
            self.writing[key] = False
            assert self.index.used_bytes <= MAX_BYTES
        elif res.status is ReserveStatus.BUSY_WRITING:
            assert key in self.writing
        elif res.status is ReserveStatus.BUSY_REMOVING:
            assert key in self.unlinks
        else:
            assert self.index.used_bytes == before

    @rule(key=keys_st)
    def store_at_once(self, key: OffloadKey) -> None:
        """The common uncontended path: reserve, unlink the victims, rename, commit."""
        if key in self.writing:
            return
        self.reserve(key)
        if key in self.writing:
            while self.unlinks:
                self._unlink(len(self.unlinks) - 1)
            self._rename(key)
            del self.writing[key]
            commit(self.index, key, SIZE)

    def _rename(self, key: OffloadKey) -> None:
        self.writing[key] = True
        self.disk[key] = SIZE
        self.ext_deleted.discard(key)
        self.ext_created.discard(key)

    @precondition(lambda self: any(not renamed for renamed in self.writing.values()))
    @rule(data=st.data())
    def rename(self, data: st.DataObject) -> None:
        self._rename(data.draw(st.sampled_from([k_ for k_, r in self.writing.items() if not r])))

    @precondition(lambda self: any(self.writing.values()))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k_ for k_, r in self.writing.items() if r]))
        del self.writing[key]
        commit(self.index, key, SIZE)

    @precondition(lambda self: any(not renamed for renamed in self.writing.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from([k_ for k_, r in self.writing.items() if not r]))
        del self.writing[key]
        self.index.abort(key)

    # The tier's own removals ------------------------------------------------------------------

    @rule(key=keys_st)
    def find_corrupt(self, key: OffloadKey) -> None:
        if self.index.begin_remove(key):
            self.unlinks.append(key)
        else:
            assert key in self.writing or key in self.unlinks

    @precondition(lambda self: bool(self.unlinks))
    @rule(data=st.data())
    def unlink(self, data: st.DataObject) -> None:
        self._unlink(data.draw(st.integers(0, len(self.unlinks) - 1)))

    def _unlink(self, i: int) -> None:
        key = self.unlinks.pop(i)
        if key in self.disk:
            del self.disk[key]
            self.ext_created.discard(key)
            outcome = RemoveOutcome.REMOVED
        else:
            outcome = RemoveOutcome.VANISHED
        self.index.finish_remove(key, outcome, None)

    # Observations (lookups, loads, scan), possibly applied late -------------------------------

    @rule(key=keys_st)
    def stat(self, key: OffloadKey) -> None:
        self.pending_obs.append((key, self.disk.get(key), self.index.ticket()))

    @precondition(lambda self: bool(self.pending_obs))
    @rule(data=st.data(), hot=st.booleans())
    def apply_observation(self, data: st.DataObject, hot: bool) -> None:
        key, size, ticket = self.pending_obs.pop(
            data.draw(st.integers(0, len(self.pending_obs) - 1))
        )
        self.index.observe(key, size, ticket, hot=hot)

    # Loads and recency -------------------------------------------------------------------------

    @rule(key=keys_st)
    def pin(self, key: OffloadKey) -> None:
        self.index.pin([key])
        self.pins[key] = self.pins.get(key, 0) + 1

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.pins)))
        self.index.unpin([key])
        self.pins[key] -= 1
        if not self.pins[key]:
            del self.pins[key]

    @rule(keys=st.lists(keys_st, max_size=3))
    def touch(self, keys: list[OffloadKey]) -> None:
        self.index.touch(keys)

    # Other instances sharing the directory ----------------------------------------------------

    @rule(key=keys_st, size=sizes_st)
    def external_create(self, key: OffloadKey, size: int) -> None:
        self.disk[key] = size  # another writer's rename (possibly over ours)
        self.ext_created.add(key)
        self.ext_deleted.discard(key)

    @rule(key=keys_st)
    def external_delete(self, key: OffloadKey) -> None:
        if self.disk.pop(key, None) is not None:
            self.ext_deleted.add(key)
            self.ext_created.discard(key)

    # Invariants --------------------------------------------------------------------------------

    @invariant()
    def accounting_is_exact(self) -> None:
        check_index(self.index)
        snap = self.index.snapshot()
        assert snap.num_writing == len(self.writing)
        assert snap.num_removing == len(set(self.unlinks))

    @invariant()
    def no_phantom_blocks(self) -> None:
        # Every indexed block exists, unless someone removed it behind the index's back.
        for key in lru_keys(self.index):
            assert key in self.disk or key in self.ext_deleted, f"phantom {key.hex()}"

    @invariant()
    def no_unaccounted_files(self) -> None:
        # Every file is indexed, being written or removed, or was created behind our back.
        for key in self.disk:
            assert (
                key in self.index
                or key in self.writing
                or key in self.unlinks
                or key in self.ext_created
            ), f"file of {key.hex()} is not accounted"

    @invariant()
    def sizes_match_disk(self) -> None:
        for key in lru_keys(self.index):
            if key in self.disk and key not in self.ext_created:
                assert indexed_size(self.index, key) == self.disk[key]


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
