# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The GPU block pool of one KV-cache group, with prefix caching and LRU eviction.

Blocks are reference counted. A block with ``ref_cnt == 0`` is free and sits in the free queue,
least recently freed first; if it still carries a block hash it is also *cached*: a later request
with the same token prefix can take it back (``touch``) instead of recomputing it. Allocating a
new block pops the head of the free queue and evicts its hash, if any, from the cache.

Every operation is O(blocks touched): the free queue is an insertion-ordered dict used as an
O(1)-removal linked list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from vllm.v1.core.kv_cache_utils import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One GPU block.

    Attributes:
        block_id: index of the block in the group's KV tensors.
        ref_cnt: number of requests holding the block; 0 means free (in the free queue).
        block_hash: the hash of the full block it holds while registered in the prefix cache.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    """The GPU blocks of one KV-cache group.

    Args:
        num_blocks: blocks in the group's KV tensors.
        enable_caching: keep freed full blocks in the prefix cache.
        record_evictions: keep the hashes evicted from the prefix cache in ``evicted_hashes``
            (drained by the owner, for ``BlockRemoved`` events).
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, record_evictions: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.evicted_hashes: list[BlockHash] | None = [] if record_evictions else None

    @property
    def num_free_blocks(self) -> int:
        """Free blocks (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (free or in use)."""
        return len(self._cached)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block caching ``block_hash``, if any."""
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks a request hit (a free one leaves the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Allocate ``num_blocks`` blocks (ref_cnt 1), evicting the least recently freed.

        Raises:
            AssertionError: fewer than ``num_blocks`` blocks are free.
        """
        assert num_blocks <= len(self._free), (
            f"cannot allocate {num_blocks} blocks, {len(self._free)} free"
        )
        out: list[KVCacheBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                cached = self._cached.get(block.block_hash)
                if cached is block:
                    del self._cached[block.block_hash]
                    self.num_evictions += 1
                    if self.evicted_hashes is not None:
                        self.evicted_hashes.append(block.block_hash)
                block.block_hash = None
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
            block.ref_cnt = 1
            out.append(block)
        return out

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail.

        Pass blocks in eviction order: the first ones freed are evicted first.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Register a full block under ``block_hash``; False (no-op) if the block already is
        registered or another block caches that hash."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
