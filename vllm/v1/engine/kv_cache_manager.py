"""``KVCacheManager``: the GPU block tables of the running requests, over one pool per group.

KV-cache group ``g`` has GPU blocks of ``block_sizes[g]`` tokens in its own ``BlockPool``. A
request's block table in group ``g`` lists the blocks holding its tokens ``[j * bs, (j + 1) * bs)``
for ``j = 0, 1, ...``.

Prefix-cache hits are aligned to the lcm of the group block sizes, so every group serves the same
number of tokens, and never cover the request's last token (its logits must be computed).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.core.sched.output import GroupBlockIds
from vllm.v1.engine.block_pool import BlockPool, KVCacheBlock
from vllm.v1.request import Request

GroupBlocks = list[list[KVCacheBlock]]


class KVCacheManager:
    """Allocates, caches and frees the GPU blocks of requests.

    Args:
        num_blocks: blocks per group.
        block_sizes: tokens per GPU block, per group.
        hash_block_size: tokens per hashed block of ``Request.block_hashes``; divides every block
            size.
        enable_caching: prefix caching on or off.
    """

    def __init__(
        self,
        num_blocks: int,
        block_sizes: Sequence[int],
        hash_block_size: int,
        enable_caching: bool = True,
    ) -> None:
        for bs in block_sizes:
            if bs % hash_block_size:
                raise ValueError(f"hash_block_size={hash_block_size} must divide block size {bs}")
        self.block_sizes = tuple(block_sizes)
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.alignment = math.lcm(*self.block_sizes)
        self.pools = [BlockPool(num_blocks, enable_caching) for _ in self.block_sizes]
        self._req_blocks: dict[str, GroupBlocks] = {}
        self._num_cached: dict[str, list[int]] = {}

    @property
    def num_groups(self) -> int:
        """Number of KV-cache groups."""
        return len(self.block_sizes)

    def _block_hash(self, request: Request, group: int, index: int) -> BlockHash:
        per_block = self.block_sizes[group] // self.hash_block_size
        return request.block_hashes[(index + 1) * per_block - 1]

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The request's longest cached prefix: blocks per group and the tokens they hold."""
        empty: GroupBlocks = [[] for _ in self.block_sizes]
        if not self.enable_caching:
            return empty, 0
        max_tokens = request.num_tokens - 1
        hits: GroupBlocks = []
        hit_tokens = max_tokens
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes, strict=True)):
            group_hits: list[KVCacheBlock] = []
            for j in range(min(max_tokens, hit_tokens) // bs):
                block = pool.get_cached_block(self._block_hash(request, g, j))
                if block is None:
                    break
                group_hits.append(block)
            hits.append(group_hits)
            hit_tokens = min(hit_tokens, len(group_hits) * bs)
        hit_tokens -= hit_tokens % self.alignment
        if hit_tokens <= 0:
            return empty, 0
        return [h[: hit_tokens // bs] for h, bs in zip(hits, self.block_sizes, strict=True)], (
            hit_tokens
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: GroupBlocks | None = None,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
    ) -> GroupBlockIds | None:
        """Give the request blocks for its computed, loaded and new tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have blocks.
            num_new_tokens: tokens to compute this step.
            num_new_computed_tokens: tokens served by ``new_computed_blocks`` (prefix hits).
            new_computed_blocks: the prefix-hit blocks, per group.
            num_external_computed_tokens: tokens the connector will load.
            delay_cache_blocks: do not register the blocks in the prefix cache yet (their KV is
                still being loaded).

        Returns:
            The ids of the newly allocated blocks per group, or None if they do not fit (nothing
            changed then).
        """
        req_id = request.request_id
        blocks = self._req_blocks.get(req_id)
        if blocks is None:
            blocks = [[] for _ in self.block_sizes]
        computed = new_computed_blocks or [[] for _ in self.block_sizes]
        total = (
            request.num_computed_tokens
            + num_new_computed_tokens
            + num_external_computed_tokens
            + num_new_tokens
        )
        needs: list[int] = []
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes, strict=True)):
            need = -(-total // bs) - len(blocks[g]) - len(computed[g])
            # Touching a free cached block takes it out of the free queue.
            taken = sum(1 for b in computed[g] if b.ref_cnt == 0)
            if need > pool.num_free_blocks - taken:
                return None
            needs.append(max(need, 0))
        new_ids: list[list[int]] = []
        for g, pool in enumerate(self.pools):
            pool.touch(computed[g])
            blocks[g].extend(computed[g])
            new_blocks = pool.get_new_blocks(needs[g])
            blocks[g].extend(new_blocks)
            new_ids.append([b.block_id for b in new_blocks])
        self._req_blocks[req_id] = blocks
        self._num_cached.setdefault(req_id, [0] * self.num_groups)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(total, request.num_tokens))
        return tuple(new_ids)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens."""
        if not self.enable_caching:
            return
        blocks = self._req_blocks[request.request_id]
        num_cached = self._num_cached[request.request_id]
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes, strict=True)):
            full = min(num_tokens // bs, len(blocks[g]))
            for j in range(num_cached[g], full):
                pool.cache_block(blocks[g][j], self._block_hash(request, g, j))
            num_cached[g] = max(num_cached[g], full)

    def get_blocks(self, req_id: str) -> GroupBlocks:
        """The request's blocks per group (empty lists if it holds none)."""
        return self._req_blocks.get(req_id) or [[] for _ in self.block_sizes]

    def get_block_ids(self, req_id: str) -> GroupBlockIds:
        """The request's block ids per group."""
        return tuple([b.block_id for b in group] for group in self.get_blocks(req_id))

    def free(self, request: Request) -> None:
        """Release every block of the request, its last blocks first in eviction order."""
        blocks = self._req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if blocks is None:
            return
        for pool, group in zip(self.pools, blocks, strict=True):
            pool.free_blocks(reversed(group))

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (allocated blocks stay with their requests)."""
        for pool in self.pools:
            pool.reset_prefix_cache()
        for counts in self._num_cached.values():
            counts[:] = [0] * len(counts)

    def usage(self) -> float:
        """Fraction of GPU blocks in use, over all groups."""
        total = sum(p.num_blocks for p in self.pools)
        return 1.0 - sum(p.num_free_blocks for p in self.pools) / total
