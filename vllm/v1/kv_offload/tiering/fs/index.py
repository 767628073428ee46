# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Capacity accounting of the filesystem tier: which block files exist, how big, in LRU order.

The directory is the source of truth; this index is the tier's exact running account of it, so
that ``max_bytes`` can be enforced without listing directories. Every change of a block file's
existence goes through the index:

* Files this tier writes: ``reserve`` (room accounted, LRU victims chosen) -> write ->
  ``commit`` (the file exists) or ``abort`` (it does not).
* Files this tier removes (LRU victims, corrupt files): ``begin_remove`` -> unlink ->
  ``finish_remove`` with what really happened.
* Files others create or remove (another instance on the same root, an operator, the start-up
  scan finding files): ``observe`` after a ``stat``, with a ``ticket`` taken *before* the stat.

Races are resolved with tickets: every change the index records for a key (a commit, a finished
removal, an applied observation that added, removed or resized the file) is numbered, and an
observation whose ticket predates the latest change of its key is stale and ignored (the index
already holds newer information, so an old stat can neither resurrect a removed file nor undo a
newer stat). Keys being written or
removed are not touched by observations at all. This keeps ``used_bytes`` equal to the sum of the
sizes of the files the index holds plus the reservations in progress, under any interleaving.

Locking: one lock; every method is O(keys passed) (eviction: O(victims + pinned entries skipped)),
and no system call is made while holding it, so the scheduler thread may call ``pin``/``touch``.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey

BucketOf = Callable[[OffloadKey], tuple[Hashable, Hashable]]
"""The directory a key's file lives in, as ``(outer, inner)`` (``<hhh>``, ``<hh>_g<group>``):
the reconcile re-reads one directory at a time and asks which keys the index holds there."""

ChangeCallback = Callable[[OffloadKey, bool], None]
"""``(key, present)`` called (under the index lock, so in order) when this tier really wrote
(``present=True``) or removed (``present=False``) the file of ``key``."""


class ReserveStatus(enum.Enum):
    """Outcome of ``CapacityIndex.reserve``."""

    OK = enum.auto()
    """Room accounted; the caller must unlink the victims, write, then commit or abort."""
    BUSY_WRITING = enum.auto()
    """Another thread of this tier is writing the key right now."""
    BUSY_REMOVING = enum.auto()
    """This tier is removing the key's file right now."""
    NO_ROOM = enum.auto()
    """Not enough unpinned blocks to evict (or the file is larger than ``max_bytes``)."""


@dataclass(frozen=True)
class Reservation:
    """Result of ``reserve``: the status and, when OK, the files to unlink first.

    Attributes:
        status: see ``ReserveStatus``.
        victims: ``(key, size)`` of each evicted block, now being removed (``begin_remove``
            already done); the caller unlinks each and calls ``finish_remove``.
    """

    status: ReserveStatus
    victims: tuple[tuple[OffloadKey, int], ...] = ()


class RemoveOutcome(enum.Enum):
    """What an unlink really did (``finish_remove``)."""

    REMOVED = enum.auto()
    """The file was unlinked by this tier."""
    VANISHED = enum.auto()
    """The file was already gone (removed by someone else)."""
    KEPT = enum.auto()
    """The file is still there (unlink failed, or it was replaced by another writer)."""


@dataclass(slots=True)
class _Write:
    size: int  # bytes reserved for the new file
    replaced: int | None  # size of an indexed file the new one replaces (still on disk)


@dataclass(frozen=True)
class IndexSnapshot:
    """A consistent copy of the index's counters (tests, stats)."""

    used_bytes: int
    num_blocks: int
    num_writing: int
    num_removing: int
    num_pinned: int
    max_bytes: int | None


class CapacityIndex:
    """LRU accounting of one run directory's block files, bounded by ``max_bytes``.

    Invariant (``check_invariants``): ``used_bytes == sum(sizes of indexed files) +
    sum(reserved + replaced of writes in progress)``, and, when ``max_bytes`` is set, every
    successful ``reserve`` leaves ``used_bytes <= max_bytes``. Observed files (written by others)
    may push ``used_bytes`` above ``max_bytes`` until the next ``reserve`` or ``evict_to_fit``.
    This bounds the index's view; the directory as a whole, which the view may lag, is bounded
    by the capacity slots, which ask for more victims with ``evict_lru`` when it is full.

    Protection: a pinned key (a load in flight) is never chosen as a victim; nor is a key being
    written (it is not indexed until ``commit``).

    Args:
        max_bytes: the bound, or None for none.
        on_change: called under the lock for every file this tier really wrote or removed.
        change_window: how many recent changes are remembered to judge observation tickets;
            an observation older than the window is conservatively treated as stale.
        bucket_of: groups indexed keys by directory (``keys_in_bucket``, ``inner_buckets``,
            ``outer_buckets``); None: no grouping.
    """

    def __init__(
        self,
        max_bytes: int | None,
        on_change: ChangeCallback | None = None,
        change_window: int = 1 << 16,
        bucket_of: BucketOf | None = None,
    ) -> None:
        assert max_bytes is None or max_bytes > 0, f"max_bytes={max_bytes}"
        assert change_window > 0, f"change_window={change_window}"
        self._lock = threading.Lock()
        self._max_bytes = max_bytes
        self._on_change = on_change
        self._bucket_of = bucket_of
        self._buckets: dict[Hashable, dict[Hashable, set[OffloadKey]]] = {}
        # key -> file size, least recently used first.
        self._entries: OrderedDict[OffloadKey, int] = OrderedDict()
        self._writing: dict[OffloadKey, _Write] = {}
        # key -> size it had in the index (already subtracted from _used).
        self._removing: dict[OffloadKey, int] = {}
        self._pins: dict[OffloadKey, int] = {}
        self._used = 0
        # Change log for observation tickets.
        self._seq = 0
        self._last_change: dict[OffloadKey, int] = {}
        self._changes: deque[tuple[int, OffloadKey]] = deque()
        self._change_window = change_window
        self._forgotten_seq = 0  # every change up to this number has left the window
        self._outside_changes = 0

    # -----------------------------------------------------------------------------------------
    # Introspection
    # -----------------------------------------------------------------------------------------

    @property
    def max_bytes(self) -> int | None:
        """The bound (None: unbounded)."""
        return self._max_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of indexed files plus writes in progress."""
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def size_of(self, key: OffloadKey) -> int | None:
        """Indexed size of ``key``'s file, or None if not indexed."""
        with self._lock:
            return self._entries.get(key)

    def keys_lru_order(self) -> list[OffloadKey]:
        """Indexed keys, least recently used first (tests; O(n))."""
        with self._lock:
            return list(self._entries)

    def keys_in_bucket(self, outer: Hashable, inner: Hashable) -> list[OffloadKey]:
        """Indexed keys whose ``bucket_of`` is ``(outer, inner)`` (O(those keys))."""
        with self._lock:
            return list(self._buckets.get(outer, {}).get(inner, ()))

    def inner_buckets(self, outer: Hashable) -> list[Hashable]:
        """The ``inner`` of every non-empty bucket ``(outer, inner)`` (O(those))."""
        with self._lock:
            return list(self._buckets.get(outer, ()))

    def outer_buckets(self) -> list[Hashable]:
        """The ``outer`` of every non-empty bucket (O(those): at most 4096 x groups)."""
        with self._lock:
            return list(self._buckets)

    def snapshot(self) -> IndexSnapshot:
        """Counters, read under the lock."""
        with self._lock:
            return IndexSnapshot(
                used_bytes=self._used,
                num_blocks=len(self._entries),
                num_writing=len(self._writing),
                num_removing=len(self._removing),
                num_pinned=len(self._pins),
                max_bytes=self._max_bytes,
            )

    def check_invariants(self) -> None:
        """Assert the accounting invariant (O(n); tests and debugging)."""
        with self._lock:
            expected = sum(self._entries.values()) + sum(
                w.size + (w.replaced or 0) for w in self._writing.values()
            )
            assert self._used == expected, f"used_bytes={self._used} but files sum to {expected}"
            for key in self._writing:
                assert key not in self._entries, f"key {key.hex()} both indexed and being written"
                assert key not in self._removing, f"key {key.hex()} both written and removed"
            for key in self._removing:
                assert key not in self._entries, f"key {key.hex()} both indexed and being removed"
            for key, count in self._pins.items():
                assert count > 0, f"key {key.hex()} has pin count {count}"
            if self._bucket_of is not None:
                grouped = 0
                for outer, inners in self._buckets.items():
                    assert inners, f"empty bucket {outer!r}"
                    for inner, keys in inners.items():
                        assert keys, f"empty bucket {(outer, inner)!r}"
                        grouped += len(keys)
                        for key in keys:
                            assert key in self._entries
                            assert self._bucket_of(key) == (outer, inner)
                assert grouped == len(self._entries), f"{grouped} grouped keys"

    # -----------------------------------------------------------------------------------------
    # Observations (files found by a stat)
    # -----------------------------------------------------------------------------------------

    def ticket(self) -> int:
        """Take before the ``stat`` whose result is passed to ``observe``."""
        with self._lock:
            return self._seq

    @property
    def num_outside_changes(self) -> int:
        """Observations, other than the reconcile walk's, that changed the index: a file found
        that it lacked, or a file it held found gone or resized. Each is evidence that the
        directory changed behind this tier's back (another writer, an operator): the reconcile
        then walks it again even when this tier is the only registered writer."""
        return self._outside_changes

    def observe(
        self, key: OffloadKey, size: int | None, ticket: int, *, hot: bool, from_walk: bool = False
    ) -> bool:
        """Record that a stat taken after ``ticket`` found ``key``'s file (``size``) or not (None).

        Ignored while the key is being written or removed by this tier, and when the key changed
        since ``ticket`` (the stat may predate that change).

        Args:
            key: the block.
            size: the file's size, or None if it does not exist (or is not a regular file).
            ticket: from ``ticket()``, taken before the stat.
            hot: place a newly found file at the most recently used end (a lookup hit) rather
                than the least recently used end (found by the start-up scan).
            from_walk: the stat is the reconcile walk's (not counted in
                ``num_outside_changes``: the walk is what corrects them).

        Returns:
            Whether the key counts as present now. While it is being written, the stat's answer;
            while it is being removed, False.
        """
        with self._lock:
            if key in self._removing:
                return False
            if key in self._writing:
                return size is not None
            if ticket < self._forgotten_seq or self._last_change.get(key, -1) > ticket:
                return key in self._entries
            old = self._entries.get(key)
            if size is None:
                if old is not None:
                    self._pop(key)
                    self._used -= old
                    self._record_change(key, outside=not from_walk)
                return False
            if old is None:
                self._add(key, size)
                self._used += size
                if not hot:
                    self._entries.move_to_end(key, last=False)
                self._record_change(key, outside=not from_walk)
            else:
                if size != old:
                    self._used += size - old
                    self._entries[key] = size
                    self._record_change(key, outside=not from_walk)
                if hot:
                    self._entries.move_to_end(key)
            return True

    # -----------------------------------------------------------------------------------------
    # Writes
    # -----------------------------------------------------------------------------------------

    def reserve(self, key: OffloadKey, size: int) -> Reservation:
        """Account ``size`` bytes for a new file of ``key``, evicting LRU blocks if needed.

        On OK the key is "being written": observations leave it alone and it cannot be evicted.
        The victims are "being removed". Nothing changes unless the status is OK.
        """
        assert size > 0, f"reserve of {size} bytes for key {key.hex()}"
        with self._lock:
            if key in self._writing:
                return Reservation(ReserveStatus.BUSY_WRITING)
            if key in self._removing:
                return Reservation(ReserveStatus.BUSY_REMOVING)
            replaced = self._entries.get(key)
            victims: list[tuple[OffloadKey, int]] = []
            if self._max_bytes is not None:
                if size > self._max_bytes:
                    return Reservation(ReserveStatus.NO_ROOM)
                # The replaced file is freed by our own rename, not by eviction.
                excess = self._used + size - self._max_bytes
                if excess > 0:
                    victims = self._pick_victims(excess, exclude=key)
                    if sum(v for _, v in victims) < excess:
                        return Reservation(ReserveStatus.NO_ROOM)
            for victim, victim_size in victims:
                self._pop(victim)
                self._used -= victim_size
                self._removing[victim] = victim_size
            if replaced is not None:
                self._pop(key)
            self._writing[key] = _Write(size, replaced)
            self._used += size
            return Reservation(ReserveStatus.OK, tuple(victims))

    def commit(self, key: OffloadKey, size: int) -> None:
        """The new file of ``key`` (``size`` bytes) is in place: index it as most recently used."""
        with self._lock:
            write = self._writing.pop(key, None)
            assert write is not None, f"commit of key {key.hex()} that is not being written"
            self._used -= write.size + (write.replaced or 0)
            self._add(key, size)
            self._used += size
            self._record_change(key)
            if self._on_change is not None:
                self._on_change(key, True)

    def abort(self, key: OffloadKey) -> None:
        """The write of ``key`` failed; the final name is unchanged (a replaced file stays)."""
        with self._lock:
            write = self._writing.pop(key, None)
            assert write is not None, f"abort of key {key.hex()} that is not being written"
            self._used -= write.size
            if write.replaced is not None:
                self._add(key, write.replaced)

    # -----------------------------------------------------------------------------------------
    # Removals
    # -----------------------------------------------------------------------------------------

    def begin_remove(self, key: OffloadKey, *, unless_pinned: bool = False) -> bool:
        """Mark ``key``'s file as being removed by this tier (e.g. found corrupt by a load).

        Args:
            key: the block.
            unless_pinned: refuse if a load of ``key`` is in flight (an eviction; a corrupt file
                is removed even while pinned: its load fails anyway).

        Returns:
            False if this tier is writing (the write will replace the file), already removing
            it, or (``unless_pinned``) loading it: the caller must not unlink.
        """
        with self._lock:
            if key in self._writing or key in self._removing:
                return False
            if unless_pinned and key in self._pins:
                return False
            size = self._entries.get(key)
            if size is not None:
                self._pop(key)
                self._used -= size
            self._removing[key] = size or 0
            return True

    def finish_remove(self, key: OffloadKey, outcome: RemoveOutcome, size: int | None) -> None:
        """End a removal started by ``begin_remove`` or chosen by ``reserve``.

        Args:
            key: the block.
            outcome: what the unlink did.
            size: for KEPT, the size of the file still there (None: not a regular file).
        """
        with self._lock:
            had = self._removing.pop(key, None)
            assert had is not None, f"finish_remove of key {key.hex()} that is not being removed"
            if outcome is RemoveOutcome.KEPT and size is not None:
                self._add(key, size)
                self._used += size
            self._record_change(key)
            if outcome is RemoveOutcome.REMOVED and self._on_change is not None:
                self._on_change(key, False)

    def evict_to_fit(self) -> list[tuple[OffloadKey, int]]:
        """Choose LRU victims until ``used_bytes <= max_bytes`` (after files were observed).

        Returns:
            The victims, being removed; the caller unlinks each and calls ``finish_remove``.
        """
        with self._lock:
            if self._max_bytes is None or self._used <= self._max_bytes:
                return []
            return self._take_victims(self._used - self._max_bytes)

    def evict_lru(self, count: int = 1) -> list[tuple[OffloadKey, int]]:
        """Choose up to ``count`` least recently used unpinned blocks as victims, whatever
        ``used_bytes`` (the directory is full by a measure this index does not see).

        Returns:
            The victims, being removed; the caller unlinks each and calls ``finish_remove``.
        """
        with self._lock:
            victims: list[tuple[OffloadKey, int]] = []
            for key, size in self._entries.items():
                if len(victims) >= count:
                    break
                if key not in self._pins:
                    victims.append((key, size))
            for victim, victim_size in victims:
                self._pop(victim)
                self._used -= victim_size
                self._removing[victim] = victim_size
            return victims

    # -----------------------------------------------------------------------------------------
    # Reads and recency
    # -----------------------------------------------------------------------------------------

    def pin(self, keys: Iterable[OffloadKey]) -> None:
        """Protect ``keys`` from eviction (a load of them is in flight); nests."""
        with self._lock:
            pins = self._pins
            for key in keys:
                pins[key] = pins.get(key, 0) + 1

    def unpin(self, keys: Iterable[OffloadKey]) -> None:
        """Undo one ``pin`` of each of ``keys``."""
        with self._lock:
            pins = self._pins
            for key in keys:
                count = pins.get(key, 0)
                assert count > 0, f"unpin of key {key.hex()} that is not pinned"
                if count == 1:
                    del pins[key]
                else:
                    pins[key] = count - 1

    def demote(self, key: OffloadKey) -> None:
        """Make ``key`` (if indexed) the least recently used block: the next victim."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key, last=False)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Mark indexed ``keys`` as recently used; the first key ends up the most recent."""
        with self._lock:
            entries = self._entries
            for key in reversed(list(keys)):
                if key in entries:
                    entries.move_to_end(key)

    # -----------------------------------------------------------------------------------------
    # Internals (lock held)
    # -----------------------------------------------------------------------------------------

    def _pick_victims(
        self, needed: int, exclude: OffloadKey | None
    ) -> list[tuple[OffloadKey, int]]:
        victims: list[tuple[OffloadKey, int]] = []
        freed = 0
        pins = self._pins
        for key, size in self._entries.items():
            if freed >= needed:
                break
            if key == exclude or key in pins:
                continue
            victims.append((key, size))
            freed += size
        return victims

    def _take_victims(self, needed: int) -> list[tuple[OffloadKey, int]]:
        victims = self._pick_victims(needed, exclude=None)
        for victim, victim_size in victims:
            self._pop(victim)
            self._used -= victim_size
            self._removing[victim] = victim_size
        return victims

    def _add(self, key: OffloadKey, size: int) -> None:
        """Index ``key`` (not indexed yet) as most recently used."""
        self._entries[key] = size
        if self._bucket_of is not None:
            outer, inner = self._bucket_of(key)
            inners = self._buckets.get(outer)
            if inners is None:
                inners = self._buckets[outer] = {}
            keys = inners.get(inner)
            if keys is None:
                keys = inners[inner] = set()
            keys.add(key)

    def _pop(self, key: OffloadKey) -> None:
        """Forget indexed ``key``."""
        del self._entries[key]
        if self._bucket_of is not None:
            outer, inner = self._bucket_of(key)
            inners = self._buckets[outer]
            keys = inners[inner]
            keys.discard(key)
            if not keys:
                del inners[inner]
                if not inners:
                    del self._buckets[outer]

    def _record_change(self, key: OffloadKey, *, outside: bool = False) -> None:
        if outside:
            self._outside_changes += 1
        self._seq += 1
        self._last_change[key] = self._seq
        self._changes.append((self._seq, key))
        if len(self._changes) > self._change_window:
            seq, old_key = self._changes.popleft()
            if self._last_change.get(old_key) == seq:
                del self._last_change[old_key]
            self._forgotten_seq = seq
