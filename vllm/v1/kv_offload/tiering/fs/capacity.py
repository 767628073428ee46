# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Capacity accounting and removal of the filesystem tier's block files.

``CapacityIndex`` is the tier's exact running account of which block files exist, how big, in LRU
order, so that ``max_bytes`` can be enforced without listing directories; ``FileRemover`` removes
block files through it (evictions, invalid files), freeing their capacity slots; ``RankFiles``
hands the rank directory, the index, the slots and the counters to the remover, the transfers and
the walker together. The directory is the source of truth; every change of a block file's
existence goes through the index:

* Files this tier writes: ``reserve_many`` (room accounted, LRU victims chosen, for a job's
  blocks at once) -> write -> ``commit_many`` (the files exist) or ``abort`` (one does not).
* Files this tier removes (LRU victims, corrupt files): ``begin_remove`` (or chosen by a
  reservation) -> unlink -> ``finish_remove`` with what really happened (``FileRemover.remove``).
* Files others create or remove (another instance on the same root, an operator, the start-up
  scan finding files): ``observe`` after a ``stat``, with a ``ticket`` taken *before* the stat.

Races are resolved with tickets: every change the index records for a key (a commit, a finished
removal, an applied observation that added, removed or resized the file) is numbered, and an
observation whose ticket predates the latest change of its key is stale and ignored (the index
already holds newer information, so an old stat can neither resurrect a removed file nor undo a
newer stat). Keys being written or removed are not touched by observations at all. This keeps
``used_bytes`` equal to the sum of the sizes of the files the index holds plus the reservations
in progress, under any interleaving.

Locking: one lock; every method is O(keys passed) (eviction: O(victims + pinned entries skipped)),
and no system call is made while holding it, so the scheduler thread may call ``pin``/``touch``
and the lookups read membership without it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering import block_format
from vllm.v1.kv_offload.tiering.fs.block_io import open_block_dir, regular_file_size, unlink_block
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath, FileMapper
from vllm.v1.kv_offload.tiering.fs.meters import Counters, RateLimitedLog

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.fs.slots import CapacitySlots

logger = init_logger(__name__)

BucketOf = Callable[[OffloadKey], tuple[Hashable, Hashable]]
"""The directory a key's file lives in, as ``(outer, inner)`` (``<hhh>``, ``<hh>_g<group>``):
the reconcile re-reads one directory at a time and asks which keys the index holds there."""

ChangeCallback = Callable[[OffloadKey, bool], None]
"""``(key, present)`` called (under the index lock, so in order) when this tier really wrote
(``present=True``) or removed (``present=False``) the file of ``key``."""


class ReserveStatus(enum.Enum):
    """Outcome of one key's reservation (``CapacityIndex.reserve_many``)."""

    OK = enum.auto()
    """Room accounted; the caller must unlink the victims, write, then commit or abort."""
    BUSY_WRITING = enum.auto()
    """Another thread of this tier is writing the key right now."""
    BUSY_REMOVING = enum.auto()
    """This tier is removing the key's file right now."""
    NO_ROOM = enum.auto()
    """Not enough unpinned blocks to evict (or the file is larger than ``max_bytes``)."""


Victims = list[tuple[OffloadKey, int]]
"""``(key, size)`` of evicted blocks, being removed (``begin_remove`` done): the caller unlinks
each and calls ``finish_remove`` (``FileRemover.remove_victims``)."""


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
    """A consistent copy of the index's counters (``usage()``, stats)."""

    used_bytes: int
    num_blocks: int
    num_writing: int
    num_removing: int
    num_pinned: int
    max_bytes: int | None


class CapacityIndex:
    """LRU accounting of one run directory's block files, bounded by ``max_bytes``.

    Invariant (checked by the tests' ``tier_state.check_index``): ``used_bytes == sum(sizes of
    indexed files) + sum(reserved + replaced of writes in progress)``, and, when ``max_bytes`` is
    set, every successful reservation leaves ``used_bytes <= max_bytes``. Observed files
    (written by others) may push ``used_bytes`` above ``max_bytes`` until the next reservation
    or ``evict_to_fit``.
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

    def observe_many(self, keys: Iterable[OffloadKey], size: int, ticket: int) -> None:
        """``observe(key, size, ticket, hot=True)`` for each of ``keys`` (files a load just
        read), under one lock."""
        with self._lock:
            for key in keys:
                self._observe(key, size, ticket, hot=True, from_walk=False)

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
            return self._observe(key, size, ticket, hot=hot, from_walk=from_walk)

    def _observe(
        self, key: OffloadKey, size: int | None, ticket: int, *, hot: bool, from_walk: bool
    ) -> bool:
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

    def reserve_many(
        self, keys: Sequence[OffloadKey], size: int
    ) -> tuple[list[ReserveStatus], Victims]:
        """Account ``size`` bytes for a new file of each of ``keys`` (a job's blocks, in order),
        evicting LRU blocks if needed; one lock for all.

        A key whose status is OK is "being written": observations leave it alone and it cannot
        be evicted. The victims (never one of ``keys``) are "being removed". Nothing changes for
        a key whose status is not OK.

        Returns:
            The status of each key, and the victims of them all.
        """
        assert size > 0, f"reserve of {size} bytes"
        exclude = set(keys)
        statuses: list[ReserveStatus] = []
        victims: Victims = []
        with self._lock:
            for key in keys:
                statuses.append(self._reserve(key, size, exclude, victims))
        return statuses, victims

    def _reserve(
        self, key: OffloadKey, size: int, exclude: set[OffloadKey], victims: Victims
    ) -> ReserveStatus:
        """One key of ``reserve_many`` (lock held); its victims are appended to ``victims``."""
        if key in self._writing:
            return ReserveStatus.BUSY_WRITING
        if key in self._removing:
            return ReserveStatus.BUSY_REMOVING
        replaced = self._entries.get(key)
        chosen: Victims = []
        if self._max_bytes is not None:
            if size > self._max_bytes:
                return ReserveStatus.NO_ROOM
            # The replaced file is freed by our own rename, not by eviction.
            excess = self._used + size - self._max_bytes
            if excess > 0:
                chosen = self._pick_victims(excess, exclude)
                if sum(v for _, v in chosen) < excess:
                    return ReserveStatus.NO_ROOM
        for victim, victim_size in chosen:
            self._pop(victim)
            self._used -= victim_size
            self._removing[victim] = victim_size
        victims.extend(chosen)
        if replaced is not None:
            self._pop(key)
        self._writing[key] = _Write(size, replaced)
        self._used += size
        return ReserveStatus.OK

    def commit_many(self, keys: Iterable[OffloadKey], size: int) -> None:
        """The new files of ``keys`` (``size`` bytes each) are in place: index them as most
        recently used, in order."""
        with self._lock:
            for key in keys:
                self._commit(key, size)

    def _commit(self, key: OffloadKey, size: int) -> None:
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

    def _pick_victims(self, needed: int, exclude: Collection[OffloadKey]) -> Victims:
        victims: Victims = []
        freed = 0
        pins = self._pins
        for key, size in self._entries.items():
            if freed >= needed:
                break
            if key in exclude or key in pins:
                continue
            victims.append((key, size))
            freed += size
        return victims

    def _take_victims(self, needed: int) -> list[tuple[OffloadKey, int]]:
        victims = self._pick_victims(needed, ())
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


@dataclass(frozen=True, slots=True)
class RankFiles:
    """The block files of one rank directory as one tier instance keeps them: what its
    ``FileRemover``, ``BlockTransfers`` and ``RankDirWalker`` share.

    Borrowed by each of them: the tier owns the descriptor and the slots (and closes them only
    after every thread using them stopped).

    Attributes:
        rank_fd: the rank directory.
        mapper: key -> path mapping and run digest.
        index: the capacity index.
        counters: the tier's counters and busy clocks.
        row_bytes: payload bytes of a block file (one primary row).
        slots: the capacity slots that bound the directory as a whole (None: ``max_bytes`` is
            only enforced on this instance's index, or there is no ``max_bytes``).
        file_size: bytes of a block file of this run (a file of another size is never indexed).
    """

    rank_fd: int
    mapper: FileMapper
    index: CapacityIndex
    counters: Counters
    row_bytes: int
    slots: CapacitySlots | None
    file_size: int = field(init=False)

    def __post_init__(self) -> None:
        # Computed once: the remover and the walker compare every file they meet against it.
        object.__setattr__(self, "file_size", block_format.file_size(self.row_bytes))


class FileRemover:
    """Removes block files of one rank directory through the capacity index and frees their
    capacity slots: evictions, and files found invalid.

    Thread-safety: any thread (the index has its lock; the unlink of one inode is checked, see
    ``block_io.unlink_block``). Borrowed: ``files`` (removals are counted in its counters).

    Args:
        files: the rank directory, its index, slots and counters.
    """

    def __init__(self, files: RankFiles) -> None:
        self._files = files
        self._log = RateLimitedLog(logger)

    def remove_victims(self, victims: Iterable[tuple[OffloadKey, int]]) -> None:
        """Unlink evicted blocks (already chosen and marked by the index) and settle each."""
        for key, size in victims:
            path = self._files.mapper.block_path(key)
            self.remove(key, path, None, "blocks_evicted", begun=True, size_if_unknown=size)

    def evict(self, key: OffloadKey, file_id: tuple[int, int]) -> bool:
        """Evict ``key``'s block file for the capacity slots (``CapacitySlots.bind_remover``):
        if it is still inode ``file_id`` and this tier is neither writing nor reading it."""
        return self.remove(
            key, self._files.mapper.block_path(key), file_id, "blocks_evicted", unless_pinned=True
        )

    def remove_wrong_size(
        self, leaf_fd: int, key: OffloadKey, path: BlockPath, st: os.stat_result
    ) -> bool:
        """Delete ``key``'s file of the wrong size (the inode ``st`` describes, only), counted
        as corrupt; returns whether this call removed it."""
        self._log(
            logging.WARNING,
            "wrong_size",
            "fs tier: block file %s has %d bytes instead of %d; deleting it",
            path.rel,
            st.st_size,
            self._files.file_size,
        )
        return self.remove(key, path, (st.st_dev, st.st_ino), "corrupt_removed", leaf_fd=leaf_fd)

    def remove(
        self,
        key: OffloadKey,
        path: BlockPath,
        file_id: tuple[int, int] | None,
        counter: str,
        *,
        leaf_fd: int | None = None,
        begun: bool = False,
        unless_pinned: bool = False,
        size_if_unknown: int | None = None,
    ) -> bool:
        """Remove ``key``'s block file if it is inode ``file_id`` (None: whatever file), through
        the index (``begin_remove`` unless ``begun``, then ``finish_remove`` with what really
        happened), free its capacity slot, and count ``counter`` if this call removed it.

        Args:
            leaf_fd: the block's directory if the caller has it open (else opened here).
            unless_pinned: do nothing if a load of ``key`` is in flight.
            size_if_unknown: what the index keeps counting if the directory cannot be opened.

        Returns:
            Whether this call removed the file.
        """
        if not begun and not self._files.index.begin_remove(key, unless_pinned=unless_pinned):
            return False  # this tier is rewriting it (the rename replaces it) or removing it
        outcome, kept = RemoveOutcome.KEPT, size_if_unknown
        fd = leaf_fd
        try:
            if fd is None:
                fd = open_block_dir(self._files.rank_fd, path)
        except FileNotFoundError:
            outcome, kept = RemoveOutcome.VANISHED, None
        except OSError as e:
            self._log(logging.WARNING, "unlink", "fs tier: cannot remove %s: %s", path.rel, e)
        else:
            try:
                removed = unlink_block(fd, path.name, file_id)
                if removed is not None:
                    outcome, kept = RemoveOutcome.REMOVED, None
                    self._release_slot(removed, path)
                else:
                    # Gone, or replaced by another writer since it was judged: leave the new one.
                    kept = regular_file_size(fd, path.name)
                    outcome = RemoveOutcome.VANISHED if kept is None else RemoveOutcome.KEPT
            except OSError as e:
                self._log(logging.WARNING, "unlink", "fs tier: cannot remove %s: %s", path.rel, e)
                with contextlib.suppress(OSError):
                    kept = regular_file_size(fd, path.name)
            finally:
                if leaf_fd is None:
                    os.close(fd)
        if kept is not None and kept != self._files.file_size:
            kept = None  # a file of the wrong size is never indexed (it is retried when met)
        self._files.index.finish_remove(key, outcome, kept)
        if outcome is RemoveOutcome.REMOVED:
            self._files.counters.incr(counter)
        return outcome is RemoveOutcome.REMOVED

    def _release_slot(self, st: os.stat_result, path: BlockPath) -> None:
        """The block name of inode ``st`` is gone: free its capacity slot (if known)."""
        if self._files.slots is None:
            return
        try:
            self._files.slots.release_inode(st.st_ino)
        except OSError as e:
            # The slot stays as garbage; the reconcile (or a claim that meets it) frees it.
            self._log(
                logging.WARNING, "slot", "fs tier: cannot free the slot of %s: %s", path.rel, e
            )
