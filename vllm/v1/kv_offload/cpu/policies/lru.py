# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Least-recently-used cache policy of the CPU primary tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy, reversed_keys


class LRUCachePolicy(CachePolicy):
    """Evicts the least recently used evictable block first.

    Layout: every resident block is in exactly one of two maps. ``_evictable`` holds the blocks
    with ``ref_cnt == 0``, least recently used first; ``_non_evictable`` holds the blocks being
    written or pinned (``ref_cnt != 0``), in no order. Eviction walks ``_evictable`` alone, so
    it costs O(n + |protected|) however many blocks are pinned or being written.

    Why no third map of all resident blocks: with a million blocks every map is far larger than
    the CPU caches, and each extra map costs cache misses on every insert and eviction (and
    memory per block). ``_non_evictable`` only holds in-flight blocks, so it stays small and
    cached; a ``get`` that misses ``_evictable`` probes it as well. Measured with
    ``benchmarks/kv_offload/bench_manager.py``: ~9% faster per step at 1e6 blocks than an
    all-blocks map plus an evictable index, ~10% slower at 1e3 blocks.

    Recency of a block that becomes evictable (``mark_evictable``): it enters at the most
    recently used end, because it was just used: either just written (store completed) or just
    read (its last reader unpinned it). Touching a pinned or in-flight block therefore needs no
    bookkeeping: it will be most recently used when it is released anyway.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # OrderedDict rather than dict: popping from the LRU end of a plain dict leaves dead
        # slots that every later scan from the front must skip until the next resize.
        self._evictable: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._non_evictable: dict[OffloadKey, BlockStatus] = {}

    @property
    def num_evictable(self) -> int:
        """Number of blocks with ``ref_cnt == 0`` (O(1))."""
        return len(self._evictable)

    @override
    def get(self, key: OffloadKey) -> BlockStatus | None:
        block = self._evictable.get(key)
        if block is None:
            block = self._non_evictable.get(key)
        return block

    # get itself, rather than the base's call to it: the manager's lookup is the hottest path.
    lookup = get

    @override
    def lookup_table(self) -> Mapping[OffloadKey, object]:
        # The evictable blocks; a pinned or in-flight one falls back to lookup().
        return self._evictable

    @override
    def get_many(self, keys: Iterable[OffloadKey]) -> list[BlockStatus | None]:
        evictable_get = self._evictable.get
        non_evictable_get = self._non_evictable.get
        # A BlockStatus is always true (it defines neither __bool__ nor __len__).
        return [evictable_get(key) or non_evictable_get(key) for key in keys]

    @override
    def absent_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        evictable = self._evictable
        non_evictable = self._non_evictable
        return [key for key in keys if key not in evictable and key not in non_evictable]

    @override
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.insert_many(((key, block),))

    @override
    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        evictable = self._evictable
        non_evictable = self._non_evictable
        for key, block in items:
            assert key not in non_evictable and key not in evictable, (
                f"insert: key {key.hex()} is already resident"
            )
            if block.ref_cnt == 0:
                evictable[key] = block
            else:
                non_evictable[key] = block

    @override
    def remove(self, key: OffloadKey) -> None:
        if self._non_evictable.pop(key, None) is None and self._evictable.pop(key, None) is None:
            raise AssertionError(f"remove: key {key.hex()} is not resident")

    @override
    def touch(self, keys: Collection[OffloadKey]) -> None:
        evictable = self._evictable
        move_to_end = evictable.move_to_end
        for key in reversed_keys(keys):
            if key in evictable:
                move_to_end(key)

    @override
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        assert n >= 0, f"evict: n={n} must be non-negative"
        evictable = self._evictable
        if n > len(evictable):
            return None
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        if n == 0:
            return victims
        # Collect first, mutate only once n victims are known: a failure changes nothing.
        for item in evictable.items():
            if item[0] not in protected:
                victims.append(item)
                if len(victims) == n:
                    break
        else:
            return None
        for key, block in victims:
            assert block.ref_cnt == 0, (
                f"evict: key {key.hex()} is in the evictable index with ref_cnt={block.ref_cnt}"
            )
            del evictable[key]
        return victims

    @override
    def clear(self) -> None:
        self._evictable.clear()
        self._non_evictable.clear()

    @override
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter([*self._non_evictable.items(), *self._evictable.items()])

    def __len__(self) -> int:
        return len(self._evictable) + len(self._non_evictable)

    @override
    def mark_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        # The manager checked every block (resident, ref_cnt == 0) just before this call.
        self._move_blocks(keys, self._non_evictable, self._evictable)

    @override
    def mark_non_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        # The manager checked every block (resident, was ref_cnt == 0) just before this call.
        self._move_blocks(keys, self._evictable, self._non_evictable)

    @staticmethod
    def _move_blocks(
        keys: Iterable[OffloadKey],
        source: dict[OffloadKey, BlockStatus],
        dest: dict[OffloadKey, BlockStatus],
    ) -> None:
        """Move the blocks of ``keys`` (all in ``source``) from ``source`` to the end of
        ``dest`` (for ``_evictable``, its most recently used end)."""
        pop = source.pop
        for key in keys:
            dest[key] = pop(key)
