# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of LRUCachePolicy: ordering, touch, evictability hooks and atomic eviction."""

from __future__ import annotations

import pytest

from tests.v1.kv_offload.cpu.policies.utils import (
    evicted_ids,
    insert_blocks,
    insert_ready,
    k,
    pin,
    unpin,
)
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy


def test_insert_ready_block_is_evictable_at_once() -> None:
    policy = LRUCachePolicy(8)
    block = BlockStatus(1)
    block.ref_cnt = 0
    policy.insert(k(1), block)
    assert evicted_ids(policy.evict(1, ())) == [1]


def test_eviction_order_is_least_recently_ready_first() -> None:
    policy = LRUCachePolicy(8)
    for i in range(5):
        insert_ready(policy, i)
    assert evicted_ids(policy.evict(2, ())) == [0, 1]
    assert len(policy) == 3
    assert policy.get(k(0)) is None and policy.get(k(1)) is None
    assert evicted_ids(policy.evict(3, ())) == [2, 3, 4]
    assert len(policy) == 0


def test_touch_first_key_ends_most_recent() -> None:
    policy = LRUCachePolicy(8)
    for i in range(5):
        insert_ready(policy, i)
    policy.touch([k(3), k(1)])
    assert evicted_ids(policy.evict(5, ())) == [0, 2, 4, 1, 3]


def test_touch_accepts_any_collection_and_ignores_absent_keys() -> None:
    policy = LRUCachePolicy(8)
    for i in range(3):
        insert_ready(policy, i)
    policy.touch({k(0): None, k(99): None})  # neither a list nor a tuple
    policy.touch({k(1)})
    assert evicted_ids(policy.evict(3, ())) == [2, 0, 1]


def test_touch_of_pinned_or_in_flight_block_is_harmless() -> None:
    policy = LRUCachePolicy(8)
    insert_ready(policy, 0)
    insert_ready(policy, 1)
    pin(policy, 0)
    policy.insert(k(2), BlockStatus(2))  # being written
    policy.touch([k(0), k(2)])
    assert policy.num_evictable == 1
    assert evicted_ids(policy.evict(1, ())) == [1]


def test_released_block_becomes_most_recent() -> None:
    policy = LRUCachePolicy(8)
    for i in range(3):
        insert_ready(policy, i)
    pin(policy, 0)
    pin(policy, 0)
    unpin(policy, 0)
    assert policy.num_evictable == 2  # still pinned once
    unpin(policy, 0)
    assert evicted_ids(policy.evict(3, ())) == [1, 2, 0]


def test_evict_skips_pinned_in_flight_and_protected() -> None:
    policy = LRUCachePolicy(8)
    insert_blocks(policy, pinned=[0], writing=[1], ready=[2, 3, 4])  # 2 protected below
    victims = policy.evict(2, {k(2)})
    assert evicted_ids(victims) == [3, 4]
    assert [block.ref_cnt for _, block in victims or []] == [0, 0]
    assert {key for key, _ in policy.items()} == {k(0), k(1), k(2)}


def test_failed_eviction_changes_nothing() -> None:
    policy = LRUCachePolicy(8)
    insert_blocks(policy, pinned=[0], writing=[1], ready=[2, 3])
    before = sorted((key, block.block_id, block.ref_cnt) for key, block in policy.items())
    assert policy.evict(2, {k(3)}) is None  # only block 2 is a candidate
    assert policy.evict(5, ()) is None  # more than the whole cache
    after = sorted((key, block.block_id, block.ref_cnt) for key, block in policy.items())
    assert after == before
    assert policy.num_evictable == 2
    # Order is unchanged too.
    assert evicted_ids(policy.evict(2, ())) == [2, 3]


def test_evict_zero_returns_empty_list() -> None:
    policy = LRUCachePolicy(2)
    assert policy.evict(0, ()) == []


def test_clear() -> None:
    policy = LRUCachePolicy(8)
    insert_ready(policy, 0)
    pin(policy, 0)
    insert_ready(policy, 1)
    policy.insert(k(2), BlockStatus(2))
    policy.clear()
    assert len(policy) == 0
    assert list(policy.items()) == []
    assert policy.evict(1, ()) is None


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cache_capacity"):
        LRUCachePolicy(0)
