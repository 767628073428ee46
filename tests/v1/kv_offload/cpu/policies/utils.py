# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Helpers shared by the cache-policy tests: keys by integer, the manager's ref_cnt moves, and
the policies' lists (``arc_lists``, ``lru_order``)."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, NamedTuple

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def insert_ready(policy: CachePolicy, i: int) -> BlockStatus:
    """Insert block i as the manager would (ref -1), then complete its store (ref 0)."""
    block = BlockStatus(block_id=i)
    policy.insert(k(i), block)
    block.ref_cnt = 0
    policy.mark_evictable(k(i))
    return block


def insert_blocks(
    policy: CachePolicy,
    *,
    pinned: Iterable[int] = (),
    writing: Iterable[int] = (),
    ready: Iterable[int] = (),
) -> None:
    """Insert blocks in each state, in this order: ``pinned`` (ready, then pinned by a reader),
    ``writing`` (being written: ref -1, never evictable) and ``ready`` (evictable)."""
    for i in pinned:
        insert_ready(policy, i)
        pin(policy, i)
    for i in writing:
        policy.insert(k(i), BlockStatus(block_id=i))
    for i in ready:
        insert_ready(policy, i)


def pin(policy: CachePolicy, i: int) -> None:
    block = policy.get(k(i))
    assert block is not None
    if block.ref_cnt == 0:
        policy.mark_non_evictable(k(i))
    block.ref_cnt += 1


def unpin(policy: CachePolicy, i: int) -> None:
    block = policy.get(k(i))
    assert block is not None
    block.ref_cnt -= 1
    if block.ref_cnt == 0:
        policy.mark_evictable(k(i))


def evicted_ids(victims: list[tuple[OffloadKey, BlockStatus]] | None) -> list[int]:
    assert victims is not None
    return [block.block_id for _, block in victims]


class CountingSet(set[OffloadKey]):
    """A set that counts membership tests, to bound how many entries an eviction visits."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.lookups = 0

    def __contains__(self, key: object) -> bool:
        self.lookups += 1
        return super().__contains__(key)


class ARCLists(NamedTuple):
    """ARC's four lists, as the ARC paper names them (a snapshot)."""

    t1: set[OffloadKey]
    """Keys resident in T1."""
    t2: set[OffloadKey]
    """Keys resident in T2 (in its order or parked)."""
    b1: list[OffloadKey]
    """Ghost keys evicted from T1, oldest first."""
    b2: list[OffloadKey]
    """Ghost keys evicted from T2, oldest first."""
    t2_order: list[OffloadKey]
    """T2's eviction order, least recently used first (pinned blocks included, parked not)."""
    t2_parked: set[OffloadKey]
    """T2 blocks an eviction walked past while pinned (back in T2's order when released)."""
    t2_num_pinned: int
    """Pinned blocks in T2's order."""
    t1_order: list[OffloadKey]
    """T1's live entries, oldest first."""


def arc_lists(policy: Any) -> ARCLists:
    """ARC's lists, which no caller of a cache policy needs (the manager asks only ``get``,
    ``evict`` and the hooks): the tests' view of ARC's decisions, O(cache size).

    ``policy`` is an ``ARCCachePolicy``, or the tests' reference ARC (which keeps only the
    four lists: its orders and pin counts are left empty).
    """
    if not isinstance(policy, ARCCachePolicy):
        return ARCLists(
            t1=set(policy.t1_keys),
            t2=set(policy.t2_keys),
            b1=list(policy.b1_keys),
            b2=list(policy.b2_keys),
            t2_order=[],
            t2_parked=set(),
            t2_num_pinned=0,
            t1_order=[],
        )
    # private: the lists are ARC's own layout (one dict for resident blocks and ghosts, lazy
    # FIFOs); no caller of a policy needs them.
    entries = policy._entries
    t2_order = list(policy._t2)
    t2_parked = set(policy._t2_parked)
    t2 = {*t2_order, *t2_parked}
    resident = {key for key, value in entries.items() if type(value) is BlockStatus}
    return ARCLists(
        t1=resident - t2,
        t2=t2,
        b1=policy._b1.live_keys(),
        b2=policy._b2.live_keys(),
        t2_order=t2_order,
        t2_parked=t2_parked,
        t2_num_pinned=policy._t2_num_pinned,
        t1_order=policy._t1.live_keys(),
    )


def lru_order(policy: LRUCachePolicy) -> tuple[list[OffloadKey], list[OffloadKey]]:
    """LRU's evictable keys in eviction order, and its other keys sorted (a snapshot).

    The order is what ``evict`` answers, asked of a copy so that ``policy`` is left as it was.
    """
    victims = copy.deepcopy(policy).evict(policy.num_evictable, ())
    assert victims is not None, "LRU could not evict its evictable blocks"
    others = sorted(key for key, block in policy.items() if block.ref_cnt != 0)
    return [key for key, _ in victims], others
