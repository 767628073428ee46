# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``CPUOffloadingManager``: the scheduler-side bookkeeping of the CPU primary tier."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any, cast

from typing_extensions import override

from vllm.v1.kv_offload.base import (
    BLOCK_METHODS,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    check_offload_key,
    check_offload_keys,
    drain_events,
    key_sequence,
    refuse_after_shutdown,
)
from vllm.v1.kv_offload.cpu.common import CPU_MEDIUM, CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import create_cache_policy
from vllm.v1.kv_offload.cpu.request_ledger import RequestLedger
from vllm.v1.kv_offload.cpu.reuse_filter import DEFAULT_MAX_TRACKER_SIZE, StoreReuseFilter

_BLOCK_LEVEL_CONTEXT = RequestOffloadingContext()
# The methods a shut-down manager refuses (``shutdown``): every one that reads or changes blocks.
_REFUSED_AFTER_SHUTDOWN = (
    *BLOCK_METHODS,
    "finish_store",
    "reserve_rows",
    "scan_resident",
    "on_new_request",
    "reset_cache",
)
_REF_CNT = attrgetter("ref_cnt")
_BLOCK_ID = attrgetter("block_id")


class CPUOffloadingManager(OffloadingManager):
    """Tracks which blocks live in the CPU region and in which row (slot).

    Slots: the region has ``num_blocks`` rows. Fresh rows are handed out by a bump pointer
    (``_num_allocated``), recycled rows through ``_free_list``; at all times
    ``free + resident == num_blocks`` where ``free = len(_free_list) + num_blocks -
    _num_allocated`` and ``resident = len(policy)``. One allocator (``_allocate_rows``) hands
    out rows for ``prepare_store`` and for the tiering manager's promotions (``reserve_rows``):
    fresh rows first, then recycled ones, then the victims of one eviction.

    Row status objects: row ``s`` is always described by the same ``BlockStatus`` object,
    ``_rows[s]``, created with the manager and reused by every block that row ever holds. So the
    manager allocates no long-lived object while it serves, and every per-block object exists
    at start-up: an application that freezes its start-up heap (``gc.freeze()``; vLLM's engine
    core and ``vllm.v1.engine.core.EngineCore`` do) keeps full garbage collections from
    traversing the tier's blocks, whose cost otherwise grows with the cache (about 100 ms per
    full collection at a million blocks).

    Block states (``BlockStatus.ref_cnt``): ``-1`` being written (allocated by ``prepare_store``,
    neither readable nor evictable), ``0`` ready (readable, evictable), ``n > 0`` ready and pinned
    by ``n`` readers (``prepare_load`` without ``complete_load`` yet). Only ``ref_cnt == 0``
    blocks are ever evicted. The manager owns ``ref_cnt`` and reports every change of
    evictability to the cache policy (``mark_evictable`` / ``mark_non_evictable``).

    Eviction order within a run: ``complete_store`` and ``complete_load`` hand the blocks they
    make evictable to the policy last key first, so that the policy (LRU or ARC, both queue newly
    evictable blocks at their most recently used end) evicts a run of blocks stored or read
    together tail first, as vLLM's GPU prefix cache does: the head of a prefix stays reachable
    while its tail goes.

    Ownership of pins and stores: every pin and every pending store belongs to the request that
    made it, as the manager's ``RequestLedger`` (``cpu/request_ledger.py``) records: a block's
    ``ref_cnt`` is exactly the number of times its key occurs in all outstanding loads, and a
    block is being written exactly when its key is in one request's pending stores. So a request
    can release only pins it holds and complete only stores it prepared: a duplicate, stray or
    foreign ``complete_load`` is refused (``OffloadKeyStateError``) instead of unpinning a row
    another reader still copies from, and a ``complete_store`` naming a block another request is
    writing is refused instead of publishing a row a worker still writes. Keys a
    ``complete_store`` names that are absent or already stored are ignored, as upstream vLLM's
    contract says. Completions that match one outstanding call exactly (what the connector
    sends) cost O(keys); partial ones O(the request's outstanding keys).

    Errors from callers: every public method checks its arguments and the keys' states before
    it changes anything (see ``OffloadingManager``); a refused call leaves every key's state,
    the pins, the slot accounting, the statistics and the events as they were. The checks sit
    at the public boundary, once: a type check of the keys first (one C-level pass), state
    checks where the algorithm reads the blocks anyway (a refusal builds its error on a slow
    path: ``RequestLedger``), and the refusal of every call after ``shutdown()`` in one place
    (``refuse_after_shutdown``) instead of a flag tested by each method. Internal invariants
    are asserted where they are cheap; the tests check all of them after every step.

    Every call costs O(keys given) amortised (``prepare_store``: plus the eviction's
    O(victims + keys)); nothing scans the cache except ``reset_cache``.

    Events (``enable_events=True``): one ``OffloadingEvent(removed=False)`` per
    ``complete_store`` with the keys it made ready, one ``OffloadingEvent(removed=True)`` per
    evicting ``prepare_store`` with its victims, and one on ``reset_cache`` with the ready keys it
    dropped. Keys never made ready produce no event, so the stored keys minus the removed keys
    are exactly the ready blocks.

    Statistics (``get_stats``), cumulative since construction or the last ``reset_cache``:
    ``hits`` / ``misses`` (lookups answering True / False; an in-flight block's None counts as
    neither), ``stores`` (blocks made ready), ``failed_stores`` (blocks dropped by a failed
    store), ``evictions``, ``stores_skipped`` (only with the reuse filter on: new blocks it
    declined to store), and the gauges ``num_blocks``, ``used_blocks``, ``usage``.

    Subclasses (the tiering manager's primary tier) reach the same state only through these
    public methods, so the same checks protect them.
    """

    medium = CPU_MEDIUM

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str = "lru",
        enable_events: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    ) -> None:
        """Create an empty CPU tier.

        Args:
            num_blocks: number of rows of the CPU region, ``>= 1``.
            cache_policy: the eviction policy, resolved by
                ``vllm.v1.kv_offload.cpu.policies.factory.create_cache_policy`` (``"lru"``,
                ``"arc"``, a registered name, or ``"package.module:ClassName"``).
            enable_events: whether to record ``OffloadingEvent`` s for ``take_events``.
            store_threshold: with 2 or more, the reuse filter stores a block only from its
                ``store_threshold``-th offer on (``vllm.v1.kv_offload.cpu.reuse_filter``); 0 or
                1: every block offered is stored.
            max_tracker_size: most keys whose offers the reuse filter counts.

        Raises:
            ValueError: if ``num_blocks < 1``, the policy name does not resolve, or the reuse
                filter's arguments are out of range.
        """
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks: int = num_blocks
        self._policy: CachePolicy = create_cache_policy(cache_policy, num_blocks)
        # lookup()'s first probe (see CachePolicy.lookup_table): a hit costs no policy call.
        table = self._policy.lookup_table()
        self._lookup_get: Callable[[OffloadKey], Any] = (table if table is not None else {}).get
        self._num_allocated: int = 0
        self._free_list: list[int] = []
        # One status per row, reused by every block the row holds; a row held by no block
        # (fresh, or free-listed after a failed store) has ref_cnt -1, ready to be written.
        self._rows: list[BlockStatus] = [BlockStatus(s) for s in range(num_blocks)]
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._reuse_filter: StoreReuseFilter | None = (
            StoreReuseFilter(store_threshold, max_tracker_size) if store_threshold >= 2 else None
        )
        # Which request holds each pin and each pending store.
        self._ledger = RequestLedger(self._policy)
        self._shut_down = False
        self._hits = 0
        self._misses = 0
        self._stores = 0
        self._failed_stores = 0
        self._evictions = 0

    # -- introspection ------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Number of rows (slots) of the CPU region."""
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Number of slots held by no block (not counting evictable ones)."""
        return len(self._free_list) + self._num_blocks - self._num_allocated

    @property
    def policy(self) -> CachePolicy:
        """The cache policy (owned by the manager; do not mutate it directly)."""
        return self._policy

    # -- OffloadingManager --------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        if key.__class__ is not bytes:
            check_offload_key("lookup", key, req_context)
        block = self._lookup_get(key)
        if block.__class__ is not BlockStatus:
            # Not get: a miss may be a re-reference (ARC ghost).
            block = self._policy.lookup(key)
        if block is None:
            self._misses += 1
            return False
        if block.ref_cnt < 0:
            return None
        self._hits += 1
        return True

    @override
    def lookup_prefix(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> list[bool | None]:
        keys = key_sequence("lookup_prefix", keys, req_context)
        results: list[bool | None] = []
        # Counted after the scan: a key that is not an OffloadKey refuses the call unchanged.
        if self.scan_resident(keys, 0, results, req_context) < len(keys):
            self._misses += 1
            results.append(False)
        self._hits += results.count(True)
        return results

    def scan_resident(
        self,
        keys: Sequence[OffloadKey],
        start: int,
        results: list[bool | None],
        req_context: ReqContext,
    ) -> int:
        """Append ``lookup``'s answer for each of ``keys[start:]`` to ``results`` while the key
        is resident (True: readable, None: being written); return the index of the first key
        that is not (``len(keys)`` if none).

        ``lookup_prefix``'s loop, for it and for the tiering manager's, which asks the slower
        tiers where this one misses. Counts nothing and changes nothing (the callers count the
        hits and misses), so that a key found not to be an ``OffloadKey`` on the way refuses
        the caller's call unchanged; keys after the first miss are not checked.

        Raises:
            TypeError: a key it reached is not an ``OffloadKey``.
        """
        get = self._lookup_get
        policy_lookup = self._policy.lookup
        append = results.append
        for i in range(start, len(keys)):
            key = keys[i]
            if key.__class__ is not bytes:
                check_offload_key("lookup_prefix", key, req_context)
            block = get(key)
            if block.__class__ is not BlockStatus:
                # Not get: a miss may be a re-reference (ARC ghost).
                block = policy_lookup(key)
                if block is None:
                    return i
            append(None if block.ref_cnt < 0 else True)
        return len(keys)

    @override
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        policy = self._policy
        pinned = keys if type(keys) is tuple else tuple(keys)
        blocks = policy.get_many(pinned)
        if not blocks:
            return CPULoadStoreSpec([])
        # Validate every key before pinning any: a None (absent or not a key) has no ref_cnt.
        try:
            loadable = min(map(_REF_CNT, blocks)) >= 0
        except AttributeError:
            loadable = False
        if not loadable:
            raise self._ledger.refusal_of_load("prepare_load", pinned, req_context)
        self._ledger.add_load(req_context.req_id, pinned)
        # The blocks this call pins first (each once, however often the call names it) leave
        # the policy's evictable order, reported in one call once all are counted.
        first_pins = []
        for key, block in zip(pinned, cast("list[BlockStatus]", blocks), strict=True):
            ref_cnt = block.ref_cnt
            if not ref_cnt:
                first_pins.append(key)
            block.ref_cnt = ref_cnt + 1
        if first_pins:
            policy.mark_non_evictable_many(first_pins)
        return CPULoadStoreSpec.from_rows(list(map(_BLOCK_ID, blocks)))

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` as recently used; keys that are not resident (or not keys) are ignored."""
        self._policy.touch(keys)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        req_id = req_context.req_id
        done = keys if type(keys) is tuple else tuple(keys)
        if not done:
            return
        if not self._ledger.take_load(req_id, done):
            self._ledger.release_partial_load("complete_load", done, req_context)
        policy = self._policy
        # Last key first, as in complete_store: a run released together is evicted tail first.
        last_first = done[::-1]
        released = []
        for key, block in zip(last_first, policy.get_many(last_first), strict=True):
            assert block is not None and block.ref_cnt > 0, (
                f"complete_load: key {key.hex()} pinned by request {req_id!r} has {block}"
            )
            ref_cnt = block.ref_cnt - 1
            block.ref_cnt = ref_cnt
            if not ref_cnt:
                released.append(key)
        if released:
            policy.mark_evictable_many(released)

    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if not all(map(isinstance, keys, repeat(bytes))):
            check_offload_keys("prepare_store", keys, req_context)
        policy = self._policy
        # Order-preserving de-duplication; the dict doubles as the O(1) protected set, which
        # covers every key passed in, already stored ones included.
        requested = dict.fromkeys(keys)
        keys_to_store = policy.absent_keys(requested)
        if self._reuse_filter is not None:
            keys_to_store = self._reuse_filter.admit(requested, keys_to_store)
        num_new = len(keys_to_store)
        if num_new == 0:
            return PrepareStoreOutput(keys_to_store=[], store_spec=CPULoadStoreSpec.from_rows([]))

        allocated = self._allocate_rows(num_new, requested)
        if allocated is None:
            return None
        new_blocks, evicted_keys = allocated
        policy.insert_many(zip(keys_to_store, new_blocks, strict=True))
        self._ledger.add_store(req_context.req_id, tuple(keys_to_store))
        assert self._num_allocated - len(self._free_list) == len(policy), self._pool_error()
        return PrepareStoreOutput(
            keys_to_store=keys_to_store,
            store_spec=CPULoadStoreSpec.from_rows([block.block_id for block in new_blocks]),
            evicted_keys=evicted_keys,
        )

    @override
    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Finish the request's pending stores among ``keys``; ignore the other keys.

        As upstream vLLM's contract says: only keys whose store is pending change (on success
        they become readable, on failure they are dropped and their rows freed); keys already
        stored and absent keys are ignored, whatever ``success`` is, so completing a
        ``prepare_store``'s whole key list (not just its ``keys_to_store``) is fine.

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: a key is being written for another request's store; no key
                of the call changes then.
            RuntimeError: the manager is shut down.
        """
        self.finish_store(keys, req_context, success)

    def finish_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> tuple[OffloadKey, ...]:
        """``complete_store``, returning the keys it published (or, on failure, dropped).

        For a manager that fronts this one and acts on what a completion changed (the tiering
        manager cascades exactly the keys made readable). Each key appears once, in the order
        given.
        """
        req_id = req_context.req_id
        done = keys if type(keys) is tuple else tuple(keys)
        if not done:
            return done
        if not self._ledger.take_store(req_id, done):
            done = self._ledger.finish_partial_store(done, req_context)
            if not done:
                return done

        policy = self._policy
        if success:
            # Last key first: blocks that become evictable together are queued tail first, so
            # eviction takes a stored run's tail before its head. Evicting the head first
            # (K0 of K0..Kn) would leave K1..Kn occupying rows that no prefix lookup reaches.
            last_first = done[::-1]
            for key, block in zip(last_first, policy.get_many(last_first), strict=True):
                assert block is not None and block.ref_cnt == -1, (
                    f"complete_store: key {key.hex()} pending for request {req_id!r} has {block}"
                )
                block.ref_cnt = 0
            policy.mark_evictable_many(last_first)
            self._stores += len(done)
            if self._events is not None:
                self._events.append(
                    OffloadingEvent(keys=list(done), medium=CPU_MEDIUM, removed=False)
                )
            return done

        free_list = self._free_list
        remove = policy.remove
        get = policy.get
        for key in done:
            block = get(key)
            assert block is not None and block.ref_cnt == -1, (
                f"complete_store: key {key.hex()} pending for request {req_id!r} has {block}"
            )
            remove(key)
            free_list.append(block.block_id)
        self._failed_stores += len(done)
        assert self._num_allocated - len(free_list) == len(policy), self._pool_error()
        return done

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return _BLOCK_LEVEL_CONTEXT

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        return drain_events(self._events)

    @override
    def reset_cache(self) -> None:
        """Drop every block, whatever its state, every pin and pending store, and zero the
        counters.

        Blocks being written or pinned are dropped too: the caller guarantees that no
        ``complete_*`` call for a pre-reset job follows (as upstream's connector does; a
        ``complete_store`` that does follow finds its keys absent and is ignored, a
        ``complete_load`` is refused as stray). O(cache size).

        Raises:
            RuntimeError: the manager is shut down.
        """
        if self._events is not None:
            ready = [key for key, block in self._policy.items() if block.ref_cnt >= 0]
            if ready:
                self._events.append(OffloadingEvent(keys=ready, medium=CPU_MEDIUM, removed=True))
        self._policy.clear()
        self._free_list.clear()
        self._ledger.clear()
        self._num_allocated = 0
        for block in self._rows:
            block.ref_cnt = -1  # every row is fresh again
        if self._reuse_filter is not None:
            self._reuse_filter.reset_stats()
        self._hits = 0
        self._misses = 0
        self._stores = 0
        self._failed_stores = 0
        self._evictions = 0
        assert len(self._policy) == 0, self._pool_error()

    @override
    def get_stats(self) -> dict[str, int | float]:
        used = self._num_allocated - len(self._free_list)
        stats: dict[str, int | float] = {
            "hits": self._hits,
            "misses": self._misses,
            "stores": self._stores,
            "failed_stores": self._failed_stores,
            "evictions": self._evictions,
            "num_blocks": self._num_blocks,
            "used_blocks": used,
            "usage": used / self._num_blocks,
        }
        if self._reuse_filter is not None:
            # Only with the filter on, as upstream registers vllm:kv_offload_stores_skipped.
            stats["stores_skipped"] = self._reuse_filter.num_skipped
        return stats

    @override
    def shutdown(self) -> None:
        """Refuse every later call that reads or changes blocks; idempotent.

        Afterwards ``lookup``, ``prepare_*``, ``complete_*``, ``touch``, ``reset_cache`` and
        ``on_new_request`` raise ``RuntimeError``: the rows they would name belong to a region
        that is being released. ``take_events`` and ``get_stats`` still answer. Subclasses that
        own the region release it after calling this.
        """
        self._shut_down = True
        refuse_after_shutdown(self, _REFUSED_AFTER_SHUTDOWN)

    @property
    def is_shut_down(self) -> bool:
        """Whether ``shutdown()`` was called."""
        return self._shut_down

    # -- for the tiering manager ----------------------------------------------------------------

    def has_pending_stores(self, req_id: str) -> bool:
        """Whether request ``req_id`` has a prepared store it has not completed (O(1))."""
        return self._ledger.has_pending_stores(req_id)

    def reserve_rows(
        self,
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
        protected: Collection[OffloadKey] | None = None,
    ) -> list[int] | None:
        """Reserve a row for each of blocks ``keys`` (distinct, none resident) that a secondary
        tier will write: all of them or none.

        ``prepare_store(keys, req_context)`` without the reuse filter, the de-duplication and the
        transfer spec, for the tiering manager's promotions (never subject to the reuse filter: a
        block found in a secondary tier was stored before). The rows come from the same
        allocator, in one allocation; the blocks are inserted being written (``ref_cnt == -1``,
        unreadable) and their store is pending for ``req_context``'s request, as
        ``prepare_store`` leaves them. Finish them with ``complete_store``.

        Args:
            keys: the blocks, in order.
            req_context: who owns the pending stores.
            protected: resident blocks the eviction must spare (the readable blocks a lookup
                answered in the same call), with O(1) membership; None: none (``keys`` are not
                resident, so they are never victims).

        Returns:
            The rows, in the order of ``keys``, or None if not that many rows can be freed
            (nothing changed).
        """
        policy = self._policy
        assert not any(map(policy.get, keys)), "reserve_rows: a key is resident"
        allocated = self._allocate_rows(len(keys), () if protected is None else protected)
        if allocated is None:
            return None
        blocks = allocated[0]
        policy.insert_many(zip(keys, blocks, strict=True))
        self._ledger.add_store(req_context.req_id, keys if type(keys) is tuple else tuple(keys))
        assert self._num_allocated - len(self._free_list) == len(policy), self._pool_error()
        return [block.block_id for block in blocks]

    def _allocate_rows(
        self, n: int, protected: Collection[OffloadKey]
    ) -> tuple[list[BlockStatus], list[OffloadKey]] | None:
        """Take ``n`` (>= 1) rows for new blocks: fresh rows first, then recycled ones, then the
        victims of one eviction (never of a key in ``protected``, which needs O(1) membership).

        An eviction is counted and, with events on, reported (one removal event). The returned
        status objects are the rows' own (``_rows[row]``), each with ``ref_cnt == -1``; the
        caller inserts them into the policy.

        Returns:
            The rows' status objects and the evicted keys, or None if ``n`` rows cannot be
            freed (nothing changed).
        """
        free_list = self._free_list
        num_allocated = self._num_allocated
        num_fresh = self._num_blocks - num_allocated
        need = n - len(free_list) - num_fresh
        rows = self._rows
        if need <= 0:
            num_from_fresh = min(num_fresh, n)
            blocks = rows[num_allocated : num_allocated + num_from_fresh]
            self._num_allocated = num_allocated + num_from_fresh
            num_from_free = n - num_from_fresh
            if num_from_free:
                blocks += [rows[s] for s in free_list[-num_from_free:]]
                del free_list[-num_from_free:]
            # Rows held by no block (fresh or free-listed) keep ref_cnt -1 (see _rows).
            return blocks, []
        if n > self._num_blocks:
            return None
        victims = self._policy.evict(need, protected)
        if victims is None:
            return None
        assert len(victims) == need, f"policy evicted {len(victims)} blocks, {need} requested"
        evicted_keys = [key for key, _ in victims]
        self._evictions += need
        if self._events is not None:
            self._events.append(
                OffloadingEvent(keys=list(evicted_keys), medium=CPU_MEDIUM, removed=True)
            )
        # Every free row is taken, then the victims' rows (a victim's status object is its
        # row's, ``rows[victim.block_id]``).
        blocks = rows[num_allocated:]
        self._num_allocated = self._num_blocks
        if free_list:
            blocks += [rows[s] for s in free_list]
            free_list.clear()
        for _, block in victims:
            block.ref_cnt = -1  # a victim was ready (0): now being written
            blocks.append(block)
        return blocks, evicted_keys

    def _pool_error(self) -> str:
        return (
            f"slot accounting broken: {self._num_allocated} allocated - "
            f"{len(self._free_list)} free-listed != {len(self._policy)} resident "
            f"(num_blocks={self._num_blocks})"
        )
