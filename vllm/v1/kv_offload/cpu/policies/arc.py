# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Adaptive Replacement Cache (ARC) policy of the CPU primary tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping
from itertools import chain, repeat

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.arc_lists import LazyFIFO, T1Walk
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy, reversed_keys

_B1 = 1
"""``_entries`` value of a ghost in B1 (a small int: shared, never allocated per ghost)."""
_B2 = -1
"""``_entries`` value of a ghost in B2."""
_B1_SEEN = 2
"""``_entries`` value of a ghost in B1 whose re-reference was already counted (adapted on)."""
_B2_SEEN = -2
"""``_entries`` value of a ghost in B2 whose re-reference was already counted."""


class _GCAnchor(BlockStatus):
    """Type of ``_ANCHOR``: neither a resident block (``type(v) is BlockStatus`` is False)
    nor a ghost (not an int)."""

    __slots__ = ()


_ANCHOR_KEY = OffloadKey(b"")
"""``_entries``' permanent entry (no offload key is empty), see ``ARCCachePolicy.__init__``."""
_ANCHOR = _GCAnchor(-1)


class ARCCachePolicy(CachePolicy):
    """ARC: balances recency (T1) against frequency (T2) with ghost-list feedback.

    Lists:
        * T1: resident blocks seen once (inserted, not touched since they became ready).
        * T2: resident blocks touched at least once while ready, and blocks stored again after
          a ghost hit (the paper moves a ghost-hit block to T2: it was requested twice).
        * B1 / B2: ghost lists, keys only, of blocks recently evicted from T1 / T2, oldest
          first. A resident key is never a ghost.
        * Directory bounds, those of the ARC paper (Megiddo and Modha, FAST 2003), with
          ``c = cache_capacity``: ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``.
          Only an insert can break them: a new block joins T1, growing L1 = T1 + B1 and the
          directory (a stored ghost key only moves from B1 or B2 to T2), while touch, evict,
          remove and the evictability hooks only move keys (T1 to T2, a victim to its ghost
          list) or drop them. After each inserted block the oldest
          ghost of B1, then of B2, is dropped until both bounds hold again; with at most ``c``
          resident blocks, B2 always has enough (``|T2| <= c``). So a cache that T1 fills
          keeps no B1 history (a scan leaves no ghosts behind), and the directory never holds
          more than ``2c`` keys. (Upstream vLLM instead bounds each ghost list by ``c`` on its
          own, which lets a scan keep ``c`` ghosts, up to ``3c`` keys in all, and makes every
          stored block of a scan drop a cold ghost.)
        * ``target_t1_size``: the adaptive target size of T1, in ``[0, cache_capacity]``,
          starting at 0. A ghost hit in B1 (a block evicted too early from T1) raises it by
          ``max(1, |B2| / |B1|)``; one in B2 lowers it by ``max(1, |B1| / |B2|)``.

    Ghost hits: the paper adapts when a request misses on a ghost and then stores the block in
    T2. Here a request reaches the tier through several calls (the connector may ``touch`` a
    request's keys, then ``lookup`` them until the first miss, then ``prepare_store`` the
    missing ones), and whichever of them first observes a ghost counts the hit: ``touch``,
    ``lookup`` (a miss) and ``insert`` (through ``prepare_store``) all adapt. The first
    observation marks the ghost *seen* (``_B1_SEEN`` / ``_B2_SEEN``) and moves it to its list's
    most recently used end; later observations of a seen ghost do not adapt again, so one
    re-reference seen by three calls (or by the lookups of a request deferred for several steps)
    adapts once, as the paper's single miss does. Storing a ghost key places its block in T2.
    (Upstream vLLM adapts on ``touch`` only, once per touch, and stores ghost keys in T1; with a
    connector that touches only hit keys its target never moves.)

    Eviction takes from T1 while T1's size (shrinking virtually with every victim taken from it)
    is at least ``int(target_t1_size)``, else from T2, falling back to the other list when the
    preferred one has no candidate left. Victims move to B1 or B2 by the list they left.

    A block that becomes evictable (store completed, last reader gone) enters its list's
    evictable order at the most recently used end, since it was just written or read. A block
    being written stays in T1 when touched (it was just prepared for a store, not really used
    twice); it takes T1's most recently used position when its store completes. A ready block
    pinned by readers is promoted to T2 when touched, like any ready block.

    Layout, chosen to touch as little cold memory per stored and evicted block as possible (with
    a million blocks every table is far larger than the CPU caches, and each random probe of
    one is a cache and TLB miss; see docs/benchmarks.md, "CPU tier bookkeeping"):

    * ``_entries``: one dict for resident blocks *and* ghosts: ``key -> BlockStatus`` if
      resident, ``key -> _B1`` or ``key -> _B2`` (two shared small ints) if a ghost. Evicting
      a block turns its entry into a ghost in place, and storing a ghost key turns it back, so
      neither costs a probe of a second table.
    * T1's evictable blocks (``ref_cnt == 0``) are a FIFO of keys, oldest first: T1 has no
      move-to-end (a touch promotes to T2), so a block enters at the MRU end and leaves from
      the LRU end, or from anywhere (promotion, pin, removal, eviction behind a protected key)
      by lazy deletion (``LazyFIFO``).
    * T2's order, ``_t2``: an ``OrderedDict``, least recently used first (touches move
      them), holding every evictable T2 block and, lazily, T2 blocks pinned while in it. A
      pin (``mark_non_evictable``) only counts the block in ``_t2_num_pinned``; its release
      moves it to the most recently used end, where a release places it anyway, so the
      evictable blocks keep the order they would have without it. ``evict`` skips a pinned
      block it walks past and parks it: ``_t2_parked`` (a small set) holds the T2 blocks
      outside the order, pinned or being written after a ghost hit. A Zipf workload pins its
      hot T2 blocks over and over, and each pin then costs no dict operation; a walk parks a
      block at most once per pin, so ``evict`` stays O(n + |protected|) amortised. A
      non-evictable block outside ``_t2`` is in T2 if it is parked, else in T1.
    * A ghost's *seen* state is its ``_entries`` value, so it costs no memory and no probe.
    * B1 / B2 order: a ``LazyFIFO`` of keys per list, with lazy deletion counted like T1's
      (a ghost hit re-appends the key, a stored ghost key leaves its entry stale). Trimming
      pops from the left, skipping stale entries.

    Every FIFO is appended and popped sequentially (cheap, prefetch-friendly memory) and
    compacted once its stale entries exceed its live ones by ``_COMPACT_SLACK``, so memory is
    O(capacity) and every operation O(1) amortised (``evict``: O(n + |protected|) amortised).

    Hot paths, for the manager's calls (measured in docs/benchmarks.md, trace mode): ``_entries``
    is the manager's ``lookup_table`` (a resident hit costs the manager one probe and no call
    into the policy); a call's keys are handled in one batch call (``get_many``,
    ``absent_keys``, ``mark_evictable_many``, ``mark_non_evictable_many``, ``insert_many``)
    whose loop inlines the per-key work and updates the FIFO counts once; ``evict`` takes its
    victims in at most three runs (T1, T2, T1) instead of deciding victim by victim. None of
    this changes a decision: ``tests/v1/kv_offload/cpu/policies/test_arc_differential.py``
    checks every observable state against a straightforward reference.
    """

    _COMPACT_SLACK: int = 64
    """A FIFO is compacted once its stale entries outnumber its live ones by this much, so memory
    stays O(live entries) while the O(len) rebuild is amortised over as many cheap appends."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._entries: dict[OffloadKey, BlockStatus | int] = {}
        # The one table that grows with the cache (every block and ghost) must stay the object a
        # start-up gc.freeze() took out of the collector's sight. CPython untracks a plain dict
        # that holds no container during a full collection (before the freeze, while it is
        # empty) and tracks it again, as a young object, when the first block is stored: every
        # later full collection would traverse all its entries. The anchor keeps it tracked.
        self._entries[_ANCHOR_KEY] = _ANCHOR
        self._num_resident = 0
        self._t1 = LazyFIFO()  # T1's evictable blocks
        # OrderedDict: O(1) pops at the old end and O(1) move-to-end, unlike a plain dict.
        # T2's evictable blocks and the pinned ones no eviction walked past yet.
        self._t2: OrderedDict[OffloadKey, BlockStatus] = OrderedDict()
        self._t2_num_pinned = 0  # pinned blocks in _t2
        # T2 blocks outside _t2: pinned (ref_cnt > 0) ones an eviction walked past or a touch
        # promoted, and blocks being written after a ghost hit (ref_cnt -1).
        self._t2_parked: set[OffloadKey] = set()
        self._b1 = LazyFIFO()
        self._b2 = LazyFIFO()
        self.target_t1_size: float = 0.0

    @property
    def num_evictable(self) -> int:
        """Number of blocks with ``ref_cnt == 0`` (O(1))."""
        return self._t1.live + len(self._t2) - self._t2_num_pinned

    # -- CachePolicy ---------------------------------------------------------------------------

    @override
    def get(self, key: OffloadKey) -> BlockStatus | None:
        entry = self._entries.get(key)
        return entry if type(entry) is BlockStatus else None

    @override
    def lookup(self, key: OffloadKey) -> BlockStatus | None:
        entry = self._entries.get(key)
        if type(entry) is BlockStatus:
            return entry
        if type(entry) is int:
            self._ghost_hit(key, entry)
        return None

    @override
    def lookup_table(self) -> Mapping[OffloadKey, object]:
        # Resident blocks map to their BlockStatus; ghosts (ints) and the anchor (a subclass)
        # fall back to lookup(), which counts a ghost hit.
        return self._entries

    @override
    def get_many(self, keys: Iterable[OffloadKey]) -> list[BlockStatus | None]:
        status = BlockStatus
        return [e if type(e) is status else None for e in map(self._entries.get, keys)]

    @override
    def absent_keys(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        get = self._entries.get
        status = BlockStatus
        return [key for key in keys if type(get(key)) is not status]

    @override
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.insert_many(((key, block),))

    @override
    def insert_many(self, items: Iterable[tuple[OffloadKey, BlockStatus]]) -> None:
        entries = self._entries
        t1 = self._t1
        t1_append = t1.keys.append
        t2 = self._t2
        b1 = self._b1
        b2 = self._b2
        num_resident = self._num_resident
        # T1's size: only the new keys below change it (each joins T1; a stored ghost joins T2).
        t1_size = num_resident - len(t2) - len(self._t2_parked)
        # A run of new keys needs one trim after its last block: it drops exactly the ghosts one
        # trim per block would (each block grows L1 and the directory by one, and the oldest
        # ghosts go first either way). A ghost key breaks the run: which ghosts the trims of the
        # blocks before it drop decides what it finds (and the list sizes its adaptation sees),
        # so the deferred trim runs first. Storing a ghost key moves it from B1 or B2 to T2,
        # which grows neither L1 nor the directory, so it needs no trim of its own.
        it = iter(items)
        setdefault = entries.setdefault
        added = 0
        first_old: tuple[OffloadKey, BlockStatus] | None = None
        for key, block in it:
            # One probe: a new key gets its block; a ghost (or, a caller's bug, a resident
            # key) keeps its entry, and the batch goes on key by key from it.
            if setdefault(key, block) is not block:
                first_old = (key, block)
                break
            added += 1
            if block.ref_cnt == 0:
                t1_append(key)
                t1.live += 1
        t1_size += added
        num_resident += added
        if first_old is not None:
            pending_trim = added > 0
            for key, block in chain((first_old,), it):
                old = entries.get(key)
                if old is not None and pending_trim:
                    # The deferred trim may drop this very ghost.
                    self._bound_directory(t1_size, num_resident)
                    pending_trim = False
                    old = entries.get(key)
                if old is None:  # a new key joins T1
                    entries[key] = block
                    t1_size += 1
                    pending_trim = True
                    if block.ref_cnt == 0:
                        t1_append(key)
                        t1.live += 1
                else:
                    # A ghost hit (the paper's cases II and III): adapt unless an earlier call
                    # already counted this re-reference, and store the block in T2.
                    assert type(old) is int, f"insert: key {key.hex()} is already resident"
                    if old in (_B1, _B2):
                        self._adapt(old)
                    (b1 if old > 0 else b2).leave(key)
                    entries[key] = block
                    if block.ref_cnt == 0:
                        t2[key] = block
                    else:
                        self._t2_parked.add(key)
                num_resident += 1
            b1.maybe_compact(self._COMPACT_SLACK)
            b2.maybe_compact(self._COMPACT_SLACK)
        assert num_resident <= self.cache_capacity, (
            f"insert: {num_resident} resident blocks exceed the capacity {self.cache_capacity} "
            "(the caller evicts before it inserts)"
        )
        self._num_resident = num_resident
        self._bound_directory(t1_size, num_resident)

    @override
    def remove(self, key: OffloadKey) -> None:
        entries = self._entries
        block = entries.get(key)
        assert type(block) is BlockStatus, f"remove: key {key.hex()} is not resident"
        del entries[key]
        self._num_resident -= 1
        if self._t2.pop(key, None) is not None:
            if block.ref_cnt:
                self._t2_num_pinned -= 1
        elif block.ref_cnt == 0:
            self._t1_leave(key)
        else:
            self._t2_parked.discard(key)

    @override
    def touch(self, keys: Collection[OffloadKey]) -> None:
        entries_get = self._entries.get
        t2 = self._t2
        move_to_end = t2.move_to_end
        t1 = self._t1
        t1_stale = t1.stale
        promoted = 0
        for key in reversed_keys(keys):
            # T2's order first: the hot blocks a Zipf workload touches again and again, which
            # then cost two probes and no type checks. A pinned block in it moves too, which
            # changes nothing: its release moves it to the most recently used end anyway.
            if key in t2:
                move_to_end(key)
                continue
            entry = entries_get(key)
            if entry is None:
                continue
            if type(entry) is BlockStatus:
                ref_cnt = entry.ref_cnt
                if ref_cnt == 0:
                    # In T1 (not in T2's order): T1 -> T2, at its most recently used end. T1's
                    # FIFO entry goes stale (``LazyFIFO.leave``, inlined; the counts are
                    # updated once below).
                    t1_stale[key] = t1_stale.get(key, 0) + 1
                    promoted += 1
                    t2[key] = entry
                elif ref_cnt > 0:
                    # Pinned (in T1, or parked in T2): promoted now, placed in T2's order when
                    # its last reader unpins it.
                    self._t2_parked.add(key)
                # ref_cnt < 0: being written, stays where it is (T1, or T2 after a ghost hit).
                continue
            if type(entry) is int:
                self._ghost_hit(key, entry)  # reads only B1's and B2's sizes, not T1's
        if promoted:
            t1.num_stale += promoted
            t1.live -= promoted
            t1.maybe_compact(self._COMPACT_SLACK)

    @override
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        assert n >= 0, f"evict: n={n} must be non-negative"
        t1 = self._t1
        t1_fifo = t1.keys
        t2 = self._t2
        if n > t1.live + len(t2) - self._t2_num_pinned:
            return None
        if n == 0:
            return []
        # The choice, victim by victim: T1 while T1's virtual size (shrinking with every T1
        # victim) is at least the target, else T2, falling back to the other list when the
        # preferred one has no unprotected candidate left. Since only T1 victims shrink that
        # size, the sequence is three runs: T1 until the size drops below the target, T2, then
        # T1 again (a run ends early only when its list runs out). Each iterator only moves
        # forward, so the walk visits at most n + |protected| live entries (plus stale T1
        # entries, each paid for by the operation that made it stale, and pinned T2 blocks, each
        # parked once the victims are taken); nothing is mutated until all n victims are known.
        walk = T1Walk(iter(t1_fifo), t1.stale, protected)
        virtual_t1_size = self._num_resident - len(t2) - len(self._t2_parked)
        target = int(self.target_t1_size)
        first_t1: list[OffloadKey] = []
        from_t2: list[tuple[OffloadKey, BlockStatus]] = []
        last_t1: list[OffloadKey] = []
        pinned_t2: list[OffloadKey] = []
        if virtual_t1_size >= target:
            walk.take(first_t1, min(n, virtual_t1_size - target + 1))
        want = n - len(first_t1)
        if want:
            for item in t2.items():
                if item[1].ref_cnt:  # pinned: parked below
                    pinned_t2.append(item[0])
                elif item[0] not in protected:
                    from_t2.append(item)
                    if len(from_t2) == want:
                        break
            want -= len(from_t2)
            if want:
                if walk.exhausted:
                    return None
                walk.take(last_t1, want)
                if len(last_t1) < want:
                    return None

        # Commit: drop the walked T1 prefix but its protected entries, consume the stale
        # entries walked past, park the pinned T2 blocks walked past, then turn each victim's
        # entry into a ghost in place.
        popleft = t1_fifo.popleft
        for _ in repeat(None, walk.walked):
            popleft()
        if walk.kept:
            t1_fifo.extendleft(reversed(walk.kept))
        t1_stale = t1.stale
        for key, seen in walk.stale_seen.items():
            left = t1_stale[key] - seen
            if left:
                t1_stale[key] = left
            else:
                del t1_stale[key]
            t1.num_stale -= seen
        if pinned_t2:
            for key in pinned_t2:
                del t2[key]
            self._t2_parked.update(pinned_t2)
            self._t2_num_pinned -= len(pinned_t2)

        entries = self._entries
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        if first_t1:
            victims = self._t1_to_ghosts(first_t1)
        if from_t2:
            b2_append = self._b2.keys.append
            for key, _ in from_t2:
                del t2[key]
                entries[key] = _B2
                b2_append(key)
            self._b2.live += len(from_t2)
            victims += from_t2
        if last_t1:
            victims += self._t1_to_ghosts(last_t1)
        self._num_resident -= n
        # An eviction moves blocks from T1 to B1 and from T2 to B2: L1, L2 and the directory
        # keep their sizes, so the bounds need no trim here.
        return victims

    def _t1_to_ghosts(self, keys: list[OffloadKey]) -> list[tuple[OffloadKey, BlockStatus]]:
        """Turn T1 victims ``keys`` (already off T1's FIFO) into B1 ghosts; their pairs."""
        entries = self._entries
        victims: list[tuple[OffloadKey, BlockStatus]] = []
        append = victims.append
        for key in keys:
            block = entries[key]
            # A ghost (an int) has no ref_cnt: AttributeError, as loud as a failed type check.
            assert block.ref_cnt == 0, (  # type: ignore[union-attr]
                f"evict: key {key.hex()} is in T1's evictable FIFO but is {block!r}"
            )
            entries[key] = _B1
            append((key, block))  # type: ignore[arg-type]
        self._t1.live -= len(keys)
        self._b1.keys.extend(keys)
        self._b1.live += len(keys)
        return victims

    @override
    def clear(self) -> None:
        self._entries.clear()
        self._entries[_ANCHOR_KEY] = _ANCHOR
        self._num_resident = 0
        self._t1.clear()
        self._t2.clear()
        self._t2_num_pinned = 0
        self._t2_parked.clear()
        self._b1.clear()
        self._b2.clear()
        self.target_t1_size = 0.0

    @override
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(
            [(key, entry) for key, entry in self._entries.items() if type(entry) is BlockStatus]
        )

    def __len__(self) -> int:
        return self._num_resident

    @override
    def mark_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        # The manager checked every block (resident, ref_cnt == 0) just before this call.
        t1 = self._t1
        t1_keys = t1.keys
        if not isinstance(keys, (list, tuple)):
            keys = list(keys)
        parked = self._t2_parked
        if not self._t2_num_pinned and not parked:
            # No pinned T2 block anywhere, so every key is a T1 block joining T1's order.
            t1_keys.extend(keys)
            t1.live += len(keys)
            return
        t2 = self._t2
        move_to_end = t2.move_to_end
        entries = self._entries
        t1_append = t1_keys.append
        joined = 0
        unpinned = 0
        for key in keys:
            if key in t2:  # pinned while in T2's order: to its most recently used end
                move_to_end(key)
                unpinned += 1
            elif key in parked:
                parked.remove(key)
                t2[key] = entries[key]  # type: ignore[assignment]
            else:
                t1_append(key)
                joined += 1
        self._t2_num_pinned -= unpinned
        t1.live += joined

    @override
    def mark_non_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        # The manager checked every block (resident, was ref_cnt == 0) just before this call.
        t2 = self._t2
        t1 = self._t1
        t1_keys = t1.keys
        t1_stale = t1.stale
        left = 0
        popped = 0
        pinned_t2 = 0
        for key in keys:
            if key in t2:
                # Stays in T2's order (see the class docstring), counted as pinned.
                pinned_t2 += 1
            # Evictable and not in T2, so in T1's FIFO. If its entry is the newest one (a block
            # pinned right after its store completed: the tiering manager's cascades) it is
            # dropped outright: a key's live entry follows its stale ones, so the newest entry,
            # if it is the key's, is the live one. Otherwise the entry goes stale
            # (``LazyFIFO.leave``, inlined; the counts are updated once below).
            elif t1_keys[-1] == key:
                t1_keys.pop()
                popped += 1
            else:
                t1_stale[key] = t1_stale.get(key, 0) + 1
                left += 1
        self._t2_num_pinned += pinned_t2
        t1.live -= left + popped
        if left:
            t1.num_stale += left
            t1.maybe_compact(self._COMPACT_SLACK)

    # -- helpers -------------------------------------------------------------------------------

    def _ghost_hit(self, key: OffloadKey, entry: int) -> None:
        """A call observed ghost ``key`` (value ``entry``) being requested again.

        The first observation adapts the target, marks the ghost seen and moves it to its
        list's most recently used end; a seen ghost is left as it is.
        """
        if entry not in (_B1, _B2):
            assert entry in (_B1_SEEN, _B2_SEEN), f"key {key.hex()} maps to {entry!r}"
            return
        self._adapt(entry)
        ghosts = self._b1 if entry == _B1 else self._b2
        self._entries[key] = 2 * entry  # seen
        ghosts.leave(key)
        ghosts.append(key)
        ghosts.maybe_compact(self._COMPACT_SLACK)

    def _adapt(self, entry: int) -> None:
        """Move the target for a ghost hit in B1 (``entry == _B1``) or B2 (the paper's deltas)."""
        b1_live = self._b1.live
        b2_live = self._b2.live
        if entry == _B1:
            delta = max(1.0, b2_live / b1_live)
            self.target_t1_size = min(self.target_t1_size + delta, float(self.cache_capacity))
        else:
            delta = max(1.0, b1_live / b2_live)
            self.target_t1_size = max(self.target_t1_size - delta, 0.0)

    def _bound_directory(self, t1_size: int, num_resident: int) -> None:
        """Drop the oldest ghosts of B1, then of B2, until ``|T1| + |B1| <= c`` and the
        directory holds at most ``2c`` keys, given T1's and the resident count (O(dropped))."""
        capacity = self.cache_capacity
        b1 = self._b1
        b2 = self._b2
        excess = min(t1_size + b1.live - capacity, b1.live)
        if excess > 0:
            b1.trim(excess, self._entries, _B1)
        excess = min(num_resident + b1.live + b2.live - 2 * capacity, b2.live)
        if excess > 0:
            b2.trim(excess, self._entries, _B2)

    def _t1_leave(self, key: OffloadKey) -> None:
        """Evictable T1 block ``key`` leaves T1's evictable order: its FIFO entry goes stale."""
        self._t1.leave(key)
        self._t1.maybe_compact(self._COMPACT_SLACK)
