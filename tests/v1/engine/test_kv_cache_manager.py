# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""GPU block tables over one pool per KV-cache group."""

from __future__ import annotations

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.engine.kv_cache_manager import KVCacheManager
from vllm.v1.request import Request


def _request(req_id: str, tokens: list[int], hash_block_size: int = 8) -> Request:
    return Request(req_id, tokens, 4, block_hasher=get_request_block_hasher(hash_block_size))


def test_prefix_hits_are_aligned_and_never_cover_the_last_token() -> None:
    kv = KVCacheManager(16, (8, 16), hash_block_size=8)
    a = _request("a", list(range(48)))
    assert kv.allocate_slots(a, 48) is not None
    kv.free(a)
    blocks, tokens = kv.get_computed_blocks(_request("b", list(range(48))))
    assert tokens == 32  # 48 tokens cached, capped below the last token, aligned to 16
    assert [len(g) for g in blocks] == [4, 2]
    _, tokens = kv.get_computed_blocks(_request("c", [*range(20), 7, *range(21, 48)]))
    assert tokens == 16  # diverges inside the second 16-token block


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    kv = KVCacheManager(4, (16,), hash_block_size=16)
    a = _request("a", list(range(40)))
    assert kv.allocate_slots(a, 40) == ([0, 1, 2],)
    b = _request("b", list(range(100, 140)))
    assert kv.allocate_slots(b, 40) is None
    assert kv.pools[0].num_free_blocks == 1 and kv.get_block_ids("b") == ([],)
    a.num_computed_tokens = 40
    assert kv.allocate_slots(a, 9) == ([3],)
    assert kv.usage() == 1.0
    kv.free(a)
    assert kv.pools[0].num_free_blocks == 4


def test_delayed_caching_registers_blocks_only_when_asked() -> None:
    kv = KVCacheManager(8, (16,), hash_block_size=16)
    a = _request("a", list(range(64)))
    kv.allocate_slots(a, 0, num_external_computed_tokens=48, delay_cache_blocks=True)
    assert kv.get_computed_blocks(_request("b", list(range(64))))[1] == 0
    kv.cache_blocks(a, 32)
    assert kv.get_computed_blocks(_request("c", list(range(64))))[1] == 32


def test_sliding_window_blocks_out_of_the_window_are_freed_as_the_request_advances() -> None:
    kv = KVCacheManager(16, (8, 8), hash_block_size=8, sliding_windows=(None, 12))
    a = _request("a", list(range(40)))
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    free_before = kv.pools[1].num_free_blocks
    assert kv.allocate_slots(a, 8) is not None
    # Computing from 24 reads tokens 13..23: block 0 (0..7) is out of the window, block 1
    # (8..15) is not.
    assert kv.get_block_ids("a") == ([0, 1, 2, 3], [-1, 1, 2, 3])
    assert kv.pools[1].num_free_blocks == free_before  # one block taken, one freed
    kv.free(a)  # null placeholders are not freed twice
    assert kv.pools[0].num_free_blocks == kv.pools[1].num_free_blocks == 16


def _evict(kv: KVCacheManager, request: Request, group: int, index: int) -> None:
    """Evict the cached block ``index`` of ``request``'s group ``group`` from the prefix cache.

    The pool evicts free blocks in its free-queue order only: every other free block is held,
    so taking one free block takes that one, and then all of them are given back (as uncached
    free blocks, at the queue's tail).
    """
    pool = kv.pools[group]
    per_block = kv.block_sizes[group] // kv.hash_block_size
    block_hash = request.block_hashes[(index + 1) * per_block - 1]
    target = pool.get_cached_block(block_hash)
    assert target is not None and target.ref_cnt == 0, "not a free cached block"
    others = [b for b in pool.blocks if b.ref_cnt == 0 and b is not target]
    pool.touch(others)
    taken = pool.get_new_blocks(1)
    assert taken == [target]
    pool.free_blocks([*taken, *others])
    assert pool.get_cached_block(block_hash) is None


def test_a_sliding_window_prefix_hit_needs_only_the_window_before_it() -> None:
    kv = KVCacheManager(16, (8, 8), hash_block_size=8, sliding_windows=(None, 12))
    a = _request("a", list(range(48)))
    assert kv.allocate_slots(a, 48) is not None
    kv.free(a)
    # Evict the SWA group's first cached blocks: a hit at 40 tokens still needs only blocks
    # 3 and 4 (tokens 24..39; computing from 40 reads 29..40).
    for j in range(3):
        _evict(kv, a, 1, j)
    blocks, tokens = kv.get_computed_blocks(_request("b", list(range(48))))
    assert tokens == 40
    assert [b.block_id for b in blocks[0]] == [0, 1, 2, 3, 4]
    assert [b.block_id for b in blocks[1]] == [-1, -1, -1, 3, 4]
    # Evicting a block of that window moves the hit back to where a window is cached.
    _evict(kv, a, 1, 3)
    _, tokens = kv.get_computed_blocks(_request("c", list(range(48))))
    assert tokens == 0  # a hit at 32 needs block 3 (24..31); at 24 block 2; ... all evicted


def test_kv_events_announce_cached_evicted_and_cleared_blocks() -> None:
    kv = KVCacheManager(4, (16,), hash_block_size=16, enable_kv_cache_events=True)
    a = _request("a", list(range(40)), 16)  # two full blocks, one partial
    assert kv.allocate_slots(a, 40) is not None
    (stored,) = kv.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == a.block_hashes[:2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(32)) and stored.block_size == 16
    assert (stored.medium, stored.group_idx) == ("GPU", 0)
    assert kv.take_events() == []  # drained
    kv.free(a)
    # Four blocks for b: the two cached ones of a are evicted, in eviction order (a request's
    # last blocks are freed first).
    b = _request("b", list(range(100, 164)), 16)
    assert kv.allocate_slots(b, 64) is not None
    removed, stored_b = kv.take_events()
    evicted = [a.block_hashes[1], a.block_hashes[0]]
    assert removed == BlockRemoved(block_hashes=evicted, medium="GPU", group_idx=0)
    assert isinstance(stored_b, BlockStored) and stored_b.block_hashes == b.block_hashes
    kv.reset_prefix_cache()
    assert kv.take_events() == [AllBlocksCleared()]


def test_kv_events_of_a_later_run_name_their_parent() -> None:
    kv = KVCacheManager(8, (8, 16), hash_block_size=8, enable_kv_cache_events=True)
    a = _request("a", list(range(32)))
    kv.allocate_slots(a, 0, num_external_computed_tokens=32, delay_cache_blocks=True)
    kv.cache_blocks(a, 16)
    kv.take_events()
    kv.cache_blocks(a, 32)
    g0, g1 = kv.take_events()
    assert isinstance(g0, BlockStored) and isinstance(g1, BlockStored)
    assert (g0.group_idx, g0.block_hashes, g0.parent_block_hash) == (
        0,
        a.block_hashes[2:4],
        a.block_hashes[1],
    )
    assert (g1.group_idx, g1.block_hashes, g1.parent_block_hash) == (
        1,
        [a.block_hashes[3]],
        a.block_hashes[1],
    )
    assert g1.token_ids == list(range(16, 32))


def test_without_kv_events_nothing_is_recorded() -> None:
    kv = KVCacheManager(4, (16,), hash_block_size=16)
    assert kv.allocate_slots(_request("a", list(range(40))), 40) is not None
    assert kv.take_events() == [] and kv.pools[0].evicted_hashes is None
