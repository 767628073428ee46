# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Test oracle: a straightforward ARC over ordered dicts, the semantics ARCCachePolicy must keep.

This was the first implementation of ``ARCCachePolicy``; the production class was since rewritten
for fewer cache misses per block (one dict for resident blocks and ghosts, FIFOs with lazy
deletion). ``test_arc_differential.py`` drives both with the same operations and compares them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy, reversed_keys


class ReferenceARCCachePolicy(CachePolicy):
    """ARC with the semantics documented on ``ARCCachePolicy``, in the plainest layout.

    ``_blocks`` maps every resident key to its status; T1 and T2 each keep an ordered dict of
    their evictable blocks; B1 and B2 are ordered dicts of ghost keys, oldest first, trimmed
    after every insert to the ARC paper's directory bounds.

    Ghost hits (where this differs from the paper and from upstream vLLM, see ``ARCCachePolicy``):
    whichever call first observes a ghost key being requested again (``touch``, ``lookup``, or
    the ``insert`` of ``prepare_store``) adapts the target and moves the ghost to its list's most
    recently used end; the ghost is then *seen* (``_seen``) and adapts no more. Inserting a
    ghost key puts its block in T2 (the paper's cases II and III), adapting first if it was not
    seen.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._blocks: dict[OffloadKey, BlockStatus] = {}
        # OrderedDict: O(1) pops at the old end and O(1) move-to-end, unlike a plain dict.
        self._t1_evictable: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._t2_evictable: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        # T2 blocks that are not evictable: pinned, or being written after a ghost hit.
        self._t2_pinned: set[OffloadKey] = set()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._seen: set[OffloadKey] = set()  # ghosts whose re-reference was counted
        self.target_t1_size: float = 0.0

    # -- introspection (O(size): tests and debugging only) -----------------------------------

    @property
    def t1_keys(self) -> set[OffloadKey]:
        """Keys resident in T1."""
        return set(self._blocks) - self.t2_keys

    @property
    def t2_keys(self) -> set[OffloadKey]:
        """Keys resident in T2."""
        return {*self._t2_evictable, *self._t2_pinned}

    @property
    def b1_keys(self) -> list[OffloadKey]:
        """Ghost keys evicted from T1, oldest first."""
        return list(self._b1)

    @property
    def b2_keys(self) -> list[OffloadKey]:
        """Ghost keys evicted from T2, oldest first."""
        return list(self._b2)

    @property
    def num_evictable(self) -> int:
        """Number of blocks with ``ref_cnt == 0`` (O(1))."""
        return len(self._t1_evictable) + len(self._t2_evictable)

    # -- CachePolicy ---------------------------------------------------------------------------

    @override
    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self._blocks.get(key)

    @override
    def lookup(self, key: OffloadKey) -> BlockStatus | None:
        block = self._blocks.get(key)
        if block is None:
            self._ghost_hit(key)
        return block

    @override
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        blocks = self._blocks
        assert key not in blocks, f"insert: key {key.hex()} is already resident"
        b1 = self._b1
        b2 = self._b2
        blocks[key] = block
        if key in b1 or key in b2:
            # A ghost hit: adapt unless already counted, then the block joins T2.
            if key not in self._seen:
                self._adapt(key in b1)
            self._seen.discard(key)
            if b1.pop(key, False) is False:
                del b2[key]
            if block.ref_cnt == 0:
                self._t2_evictable[key] = block
            else:
                self._t2_pinned.add(key)
        elif block.ref_cnt == 0:
            self._t1_evictable[key] = block
        # The directory bounds of the ARC paper: |T1| + |B1| <= c, then
        # |T1| + |T2| + |B1| + |B2| <= 2c, the oldest ghosts dropped first.
        capacity = self.cache_capacity
        t1_size = len(self.t1_keys)
        seen = self._seen
        while b1 and t1_size + len(b1) > capacity:
            seen.discard(b1.popitem(last=False)[0])
        while b2 and len(blocks) + len(b1) + len(b2) > 2 * capacity:
            seen.discard(b2.popitem(last=False)[0])

    @override
    def remove(self, key: OffloadKey) -> None:
        block = self._blocks.pop(key, None)
        assert block is not None, f"remove: key {key.hex()} is not resident"
        if block.ref_cnt == 0:
            if self._t1_evictable.pop(key, None) is None:
                del self._t2_evictable[key]
        else:
            self._t2_pinned.discard(key)

    @override
    def touch(self, keys: Collection[OffloadKey]) -> None:
        blocks = self._blocks
        t2_evictable = self._t2_evictable
        move_to_end = t2_evictable.move_to_end
        for key in reversed_keys(keys):
            block = blocks.get(key)
            if block is not None:
                ref_cnt = block.ref_cnt
                if ref_cnt == 0:
                    if key in t2_evictable:
                        move_to_end(key)
                    else:  # T1 -> T2, at its most recently used end
                        del self._t1_evictable[key]
                        t2_evictable[key] = block
                elif ref_cnt > 0:
                    # Pinned: promoted now, placed when its last reader unpins it.
                    self._t2_pinned.add(key)
                # ref_cnt < 0: being written, stays where it is.
                continue
            self._ghost_hit(key)

    def _ghost_hit(self, key: OffloadKey) -> None:
        """Non-resident ``key`` is requested: the first time a ghost is seen, adapt."""
        if key in self._seen:
            return
        if key in self._b1:
            self._adapt(True)
            self._b1.move_to_end(key)
        elif key in self._b2:
            self._adapt(False)
            self._b2.move_to_end(key)
        else:
            return
        self._seen.add(key)

    def _adapt(self, in_b1: bool) -> None:
        b1 = self._b1
        b2 = self._b2
        if in_b1:
            delta = max(1.0, len(b2) / len(b1))
            self.target_t1_size = min(self.target_t1_size + delta, float(self.cache_capacity))
        else:
            delta = max(1.0, len(b1) / len(b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0.0)

    @override
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        assert n >= 0, f"evict: n={n} must be non-negative"
        t1_evictable = self._t1_evictable
        t2_evictable = self._t2_evictable
        if n > len(t1_evictable) + len(t2_evictable):
            return None
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        if n == 0:
            return victims
        # Each iterator only moves forward, so the whole walk visits at most
        # n + |protected| entries; nothing is mutated until all n victims are known.
        t1_victims: list[tuple[OffloadKey, BlockStatus]] = []
        t2_victims: list[tuple[OffloadKey, BlockStatus]] = []
        t1_iter = iter(t1_evictable.items())
        t2_iter = iter(t2_evictable.items())
        t1_left = True
        t2_left = True
        virtual_t1_size = len(self._blocks) - len(t2_evictable) - len(self._t2_pinned)
        target = int(self.target_t1_size)
        while len(victims) < n:
            if t1_left and (virtual_t1_size >= target or not t2_left):
                for item in t1_iter:
                    if item[0] not in protected:
                        victims.append(item)
                        t1_victims.append(item)
                        virtual_t1_size -= 1
                        break
                else:
                    t1_left = False
            elif t2_left:
                for item in t2_iter:
                    if item[0] not in protected:
                        victims.append(item)
                        t2_victims.append(item)
                        break
                else:
                    t2_left = False
            else:
                return None

        blocks = self._blocks
        for name, taken, evictable, ghosts in (
            ("T1", t1_victims, t1_evictable, self._b1),
            ("T2", t2_victims, t2_evictable, self._b2),
        ):
            for key, block in taken:
                assert block.ref_cnt == 0, (
                    f"evict: key {key.hex()} is in {name}'s evictable index "
                    f"with ref_cnt={block.ref_cnt}"
                )
                del evictable[key]
                del blocks[key]
                ghosts[key] = None
        return victims

    @override
    def clear(self) -> None:
        self._blocks.clear()
        self._t1_evictable.clear()
        self._t2_evictable.clear()
        self._t2_pinned.clear()
        self._b1.clear()
        self._b2.clear()
        self._seen.clear()
        self.target_t1_size = 0.0

    @override
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(list(self._blocks.items()))

    @override
    def __len__(self) -> int:
        return len(self._blocks)

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        block = self._blocks.get(key)
        if block is None:
            raise AssertionError(f"mark_evictable: key {key.hex()} is not resident")
        assert block.ref_cnt == 0, (
            f"mark_evictable: key {key.hex()} has ref_cnt={block.ref_cnt}, expected 0"
        )
        t2_pinned = self._t2_pinned
        if t2_pinned and key in t2_pinned:
            t2_pinned.remove(key)
            self._t2_evictable[key] = block
        else:
            self._t1_evictable[key] = block

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        if self._t2_evictable.pop(key, None) is not None:
            self._t2_pinned.add(key)
        elif self._t1_evictable.pop(key, None) is None:
            raise AssertionError(f"mark_non_evictable: key {key.hex()} is not evictable")
