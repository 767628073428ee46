# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Block status and the cache-policy ABC of the CPU primary tier.

A ``CachePolicy`` owns the ``key -> BlockStatus`` map of the CPU tier and decides which blocks to
evict. The manager (``CPUOffloadingManager``) owns the slots and the ``ref_cnt`` state machine and
tells the policy about every ``ref_cnt`` transition that changes evictability.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping

from vllm.v1.kv_offload.base import OffloadKey


def reversed_keys(keys: Collection[OffloadKey]) -> Iterator[OffloadKey]:
    """Iterate over ``keys`` last to first (lists and tuples without a copy)."""
    if isinstance(keys, (list, tuple)):
        return reversed(keys)
    return reversed(list(keys))


class BlockStatus:
    """State of one block resident in the CPU tier.

    A plain ``__slots__`` class rather than a ``ctypes.Structure``: attribute access on it is on
    the manager's hot path, and slot access on a Python object is several times cheaper than a
    ctypes field descriptor.

    Attributes:
        ref_cnt: ``-1`` while the block is being written (allocated by ``prepare_store``; neither
            readable nor evictable); ``0`` once ready (readable and evictable); ``n > 0`` while
            ``n`` readers have it pinned (readable, not evictable).
        block_id: the CPU slot of the block, i.e. its row index in the CPU region.
    """

    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.ref_cnt: int = -1
        self.block_id: int = block_id

    @property
    def is_ready(self) -> bool:
        """Whether the block's store completed, i.e. it is readable (``ref_cnt >= 0``)."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"BlockStatus(block_id={self.block_id}, ref_cnt={self.ref_cnt})"


class CachePolicy(ABC):
    """Organises the resident blocks of the CPU tier and chooses eviction victims.

    Ownership: the policy owns the ``key -> BlockStatus`` map; the ``BlockStatus`` objects are
    shared with the manager, which alone changes ``ref_cnt``. The manager reports every change of
    evictability through ``mark_evictable`` (``ref_cnt`` became 0: ``-1 -> 0`` when a store
    completes, ``1 -> 0`` when the last reader unpins) and ``mark_non_evictable`` (``0 -> 1``
    when a reader pins a ready block). A block is evictable exactly when ``ref_cnt == 0``.

    Complexity contract: every method except ``clear`` and ``items`` is O(1) amortised per key
    it is given (``evict``: O(n + |protected|)); none may scan the whole cache.
    """

    def __init__(self, cache_capacity: int) -> None:
        """Create an empty policy.

        Args:
            cache_capacity: number of blocks the CPU tier holds (bounds e.g. ARC's ghost lists).

        Raises:
            ValueError: if ``cache_capacity < 1``.
        """
        if cache_capacity < 1:
            raise ValueError(f"cache_capacity must be >= 1, got {cache_capacity}")
        self.cache_capacity: int = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> BlockStatus | None:
        """Return the status of resident block ``key``, or None if it is not resident.

        Pure lookup: does not change recency.
        """

    def get_many(self, keys: Iterable[OffloadKey]) -> list[BlockStatus | None]:
        """``get`` of each key, in order: the status of each resident key, None for the others.

        Pure lookup, like ``get``. The manager reads a call's blocks through this one call
        instead of one ``get`` per key. Default: ``get`` per key; the built-in policies inline
        it.
        """
        return list(map(self.get, keys))

    def absent_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys that are not resident, in order (``prepare_store``'s new blocks).

        Pure lookup, like ``get``. Default: ``get`` per key; the built-in policies inline it.
        """
        get = self.get
        return [key for key in keys if get(key) is None]

    def lookup_table(self) -> Mapping[OffloadKey, object] | None:
        """An optional short cut for the manager's ``lookup``, or None (the default).

        A mapping in which every value of type exactly ``BlockStatus`` is the resident block of
        its key, and what ``lookup`` would return for it without side effects (other values, or
        no value: the manager calls ``lookup``). The manager probes it first, so a hit costs no
        Python call into the policy. The policy must keep every such entry current and keep
        returning the same object (mutate it, never replace it): the manager binds its ``get``
        once.
        """
        return None

    def lookup(self, key: OffloadKey) -> BlockStatus | None:
        """``get`` on behalf of a request's lookup: the status of ``key``, or None.

        The manager's ``lookup`` calls this instead of ``get`` because a lookup is a request
        for the block: a policy with history (ARC) counts a miss on a key it evicted recently
        as the re-reference it adapts on. Default: ``get``.
        """
        return self.get(key)

    @abstractmethod
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        """Add block ``key`` (not resident yet) at the most recently used position.

        The block is evictable at once if ``block.ref_cnt == 0``; the manager inserts blocks
        with ``ref_cnt == -1`` (being written) and calls ``mark_evictable`` when the store
        completes. The caller keeps at most ``cache_capacity`` blocks resident (it evicts
        first); a policy may rely on that (ARC's ghost bounds do).
        """

    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        """Insert several blocks, in order, with the effect of one ``insert`` per item.

        The manager stores a request's new blocks through this call. Default: calls ``insert``
        for each item. Policies override it to save the per-call overhead on the hot path; the
        built-in ones then implement ``insert`` through it. So a subclass of a built-in policy
        that changes insertion must override ``insert_many`` (the manager never calls its
        ``insert``).

        Args:
            items: ``(key, block)`` pairs; no key may be resident or repeated.
        """
        insert = self.insert
        for key, block in items:
            insert(key, block)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Drop resident block ``key`` whatever its ``ref_cnt`` (used after a failed store).

        Unlike an eviction, a removal leaves no history behind (e.g. no ARC ghost entry).
        """

    @abstractmethod
    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Mark ``keys`` as recently used; keys that are not resident are ignored.

        Keys are applied in reverse order so that the first key ends up the most recently used.
        """

    @abstractmethod
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        """Evict exactly ``n`` blocks with ``ref_cnt == 0`` whose keys are not in ``protected``.

        Atomic: either exactly ``n`` victims are removed from the policy and returned, or None
        is returned and nothing changed. Ownership of the victims' ``BlockStatus`` objects (and
        of their slots) passes to the caller, which may reuse them for new blocks: the policy
        must keep no reference to them.

        Args:
            n: number of victims wanted, ``n >= 0`` (``0`` returns ``[]``).
            protected: keys that must not be evicted; membership tests on it must be O(1)
                (pass a set, frozenset or dict).

        Returns:
            The ``(key, block)`` pairs evicted, least valuable first, or None if fewer than ``n``
            evictable, unprotected blocks exist.
        """

    @abstractmethod
    def clear(self) -> None:
        """Drop every block whatever its ``ref_cnt`` and reset all history and adaptive state."""

    @abstractmethod
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        """Iterate over every resident ``(key, block)`` pair, in no particular order.

        O(cache size): for ``reset_cache`` (the manager's), never on a hot path.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks, whatever their ``ref_cnt``."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """Hook: resident block ``key`` just reached ``ref_cnt == 0``.

        Policies that keep a separate index of evictable blocks update it here or in
        ``mark_evictable_many`` (the manager calls only that one); a policy that ignores the
        hooks must filter on ``ref_cnt`` in ``evict`` itself. Default: ``mark_evictable_many``
        of the one key if the policy overrides that, else nothing.
        """
        if type(self).mark_evictable_many is not CachePolicy.mark_evictable_many:
            self.mark_evictable_many((key,))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Hook: resident block ``key`` is leaving ``ref_cnt == 0`` (``0 -> 1``): called while
        its ``ref_cnt`` is still 0. Default: ``mark_non_evictable_many`` of the one key if the
        policy overrides that, else nothing."""
        if type(self).mark_non_evictable_many is not CachePolicy.mark_non_evictable_many:
            self.mark_non_evictable_many((key,))

    def mark_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        """``mark_evictable`` for each key, in order (every block has ``ref_cnt == 0`` already).

        The manager reports the blocks a ``complete_store`` or ``complete_load`` made evictable
        through this one call, after it checked each block's state and set its ``ref_cnt``: a
        policy's override may skip re-checking them. Default: ``mark_evictable`` per key if the
        policy overrides that (a policy written to the one-key hooks), else nothing.
        """
        if type(self).mark_evictable is CachePolicy.mark_evictable:
            return
        mark_evictable = self.mark_evictable
        for key in keys:
            mark_evictable(key)

    def mark_non_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        """Resident blocks ``keys`` (distinct) just left ``ref_cnt == 0``; unlike
        ``mark_non_evictable``, called after the manager counted the pins (``ref_cnt >= 1``).

        The manager reports the blocks a ``prepare_load`` pinned first through this one call,
        after it checked each block's state: a policy's override may skip re-checking them.
        Default: nothing if ``mark_non_evictable`` is not overridden, else (for a policy that
        implements only the one-key hook) ``mark_non_evictable`` per key, with the block's
        ``ref_cnt`` shown as 0 during the call, as that hook's contract says.
        """
        if type(self).mark_non_evictable is CachePolicy.mark_non_evictable:
            return
        get = self.get
        mark_non_evictable = self.mark_non_evictable
        for key in keys:
            block = get(key)
            assert block is not None and block.ref_cnt >= 1, (
                f"mark_non_evictable_many: key {key.hex()} has {block!r}, expected a pinned block"
            )
            ref_cnt = block.ref_cnt
            block.ref_cnt = 0
            try:
                mark_non_evictable(key)
            finally:
                block.ref_cnt = ref_cnt
