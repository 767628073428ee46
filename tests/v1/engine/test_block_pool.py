# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""GPU block pool: reference counts, prefix cache and LRU eviction."""

from __future__ import annotations

import pytest

from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.engine.block_pool import BlockPool


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def test_allocation_evicts_the_least_recently_freed_cached_block() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    for i, block in enumerate(a):
        pool.cache_block(block, _h(i))
    pool.free_blocks([a[3], a[2]])  # freed first: evicted first
    pool.free_blocks([a[1], a[0]])
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 4
    (first,) = pool.get_new_blocks(1)
    assert first is a[3] and first.block_hash is None
    assert pool.get_cached_block(_h(3)) is None and pool.num_evictions == 1
    assert pool.get_cached_block(_h(0)) is a[0]


def test_touch_takes_a_free_cached_block_out_of_the_free_queue() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, _h(7))
    pool.free_blocks([block])
    pool.touch([pool.get_cached_block(_h(7))])  # type: ignore[list-item]
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    assert block not in pool.get_new_blocks(2)
    with pytest.raises(AssertionError, match="cannot allocate"):
        pool.get_new_blocks(1)


def test_a_hash_is_cached_once_and_reset_forgets_all() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, _h(1))
    pool.cache_block(b, _h(1))  # duplicate content: b stays uncached
    assert pool.get_cached_block(_h(1)) is a and b.block_hash is None
    pool.reset_prefix_cache()
    assert pool.get_cached_block(_h(1)) is None and a.block_hash is None
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free_blocks([a, a])
