# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``KVCacheManager``: the GPU block tables of the running requests, over one pool per group.

KV-cache group ``g`` has GPU blocks of ``block_sizes[g]`` tokens in its own ``BlockPool``. A
request's block table in group ``g`` lists the blocks holding its tokens ``[j * bs, (j + 1) * bs)``
for ``j = 0, 1, ...``.

Prefix-cache hits are aligned to the lcm of the group block sizes, so every group serves the same
number of tokens, and never cover the request's last token (its logits must be computed).

Sliding-window (SWA) groups (``sliding_windows[g]`` tokens): once a request computed ``n`` tokens,
its SWA blocks lying wholly below ``num_skipped_tokens(n, W)`` are freed and replaced by a null
placeholder (id ``NULL_BLOCK_ID``), as in vLLM; a prefix hit at ``h`` tokens needs, in an SWA
group, only the cached blocks of the window before ``h`` (the rest of its table is null).

KV events (``enable_kv_cache_events``), as vLLM's block pool produces them (medium ``GPU``): a
``BlockStored`` per group for the blocks one ``cache_blocks`` call registered (with their parent
hash and tokens), a ``BlockRemoved`` for the hashes a step's allocations evicted, and
``AllBlocksCleared`` on a prefix-cache reset; ``take_events`` drains them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from vllm.distributed.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.core.sched.output import GroupBlockIds
from vllm.v1.engine.block_pool import BlockPool, KVCacheBlock
from vllm.v1.kv_cache_interface import NULL_BLOCK_ID, num_skipped_blocks
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
        sliding_windows: per group, the window in tokens of a sliding-window group, or None for
            full attention; empty: every group has full attention.
        enable_kv_cache_events: record the prefix cache's KV events (see the module docstring).
    """

    def __init__(
        self,
        num_blocks: int,
        block_sizes: Sequence[int],
        hash_block_size: int,
        enable_caching: bool = True,
        sliding_windows: Sequence[int | None] = (),
        enable_kv_cache_events: bool = False,
    ) -> None:
        for bs in block_sizes:
            if bs % hash_block_size:
                raise ValueError(f"hash_block_size={hash_block_size} must divide block size {bs}")
        self.block_sizes = tuple(block_sizes)
        self.sliding_windows = tuple(sliding_windows) or (None,) * len(self.block_sizes)
        if len(self.sliding_windows) != len(self.block_sizes):
            raise ValueError(f"{len(self.sliding_windows)} sliding windows for {block_sizes}")
        # Placeholder of a freed SWA block in a block table; never in a pool.
        self._null = KVCacheBlock(NULL_BLOCK_ID)
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.alignment = math.lcm(*self.block_sizes)
        record = enable_caching and enable_kv_cache_events
        self.pools = [BlockPool(num_blocks, enable_caching, record) for _ in self.block_sizes]
        self._events: list[KVCacheEvent] | None = [] if record else None
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
            if self.sliding_windows[g] is not None:
                hits.append(group_hits)  # filled once the full-attention hit is known
                continue
            for j in range(min(max_tokens, hit_tokens) // bs):
                block = pool.get_cached_block(self._block_hash(request, g, j))
                if block is None:
                    break
                group_hits.append(block)
            hits.append(group_hits)
            hit_tokens = min(hit_tokens, len(group_hits) * bs)
        hit_tokens -= hit_tokens % self.alignment
        swa = [g for g, w in enumerate(self.sliding_windows) if w is not None]
        previous = -1
        while swa and hit_tokens > 0 and hit_tokens != previous:
            previous = hit_tokens  # each SWA group may lower the hit: repeat until stable
            for g in swa:
                hit_tokens = self._window_hit(request, g, hit_tokens)
        if hit_tokens <= 0:
            return empty, 0
        for g in swa:
            bs = self.block_sizes[g]
            skipped = num_skipped_blocks(hit_tokens, self.sliding_windows[g], bs)
            hits[g] = [self._null] * skipped + [
                self._cached_block(request, g, j) for j in range(skipped, hit_tokens // bs)
            ]
        return [h[: hit_tokens // bs] for h, bs in zip(hits, self.block_sizes, strict=True)], (
            hit_tokens
        )

    def _cached_block(self, request: Request, group: int, index: int) -> KVCacheBlock:
        block = self.pools[group].get_cached_block(self._block_hash(request, group, index))
        assert block is not None
        return block

    def _window_hit(self, request: Request, group: int, max_hit: int) -> int:
        """The longest aligned hit ``<= max_hit`` tokens whose SWA window is cached in ``group``."""
        pool, bs = self.pools[group], self.block_sizes[group]
        window = self.sliding_windows[group]
        for hit in range(max_hit, 0, -self.alignment):
            first = num_skipped_blocks(hit, window, bs)
            if all(
                pool.get_cached_block(self._block_hash(request, group, j)) is not None
                for j in range(first, hit // bs)
            ):
                return hit
        return 0

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
            changed then, except that SWA blocks out of the window were freed, as they would be
            anyway).
        """
        req_id = request.request_id
        self.remove_skipped_blocks(request, request.num_computed_tokens)
        blocks = self._req_blocks.get(req_id)
        if blocks is None:
            blocks = [[] for _ in self.block_sizes]
        null = self._null
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
            taken = sum(1 for b in computed[g] if b.ref_cnt == 0 and b is not null)
            if need > pool.num_free_blocks - taken:
                return None
            needs.append(max(need, 0))
        new_ids: list[list[int]] = []
        for g, pool in enumerate(self.pools):
            pool.touch(b for b in computed[g] if b is not null)
            blocks[g].extend(computed[g])
            new_blocks = pool.get_new_blocks(needs[g])
            if pool.evicted_hashes:
                self._record_evicted(g)
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
        events = self._events
        for g, (pool, bs) in enumerate(zip(self.pools, self.block_sizes, strict=True)):
            full = min(num_tokens // bs, len(blocks[g]))
            stored: list[int] = []
            for j in range(num_cached[g], full):
                if blocks[g][j] is not self._null and pool.cache_block(
                    blocks[g][j], self._block_hash(request, g, j)
                ):
                    stored.append(j)
            num_cached[g] = max(num_cached[g], full)
            if events is not None and stored:
                self._record_stored(events, request, g, stored)

    def _record_stored(
        self, events: list[KVCacheEvent], request: Request, group: int, indices: list[int]
    ) -> None:
        # One event per run of consecutive blocks: its parent is the block before the run.
        bs = self.block_sizes[group]
        tokens = request.all_token_ids
        start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            first, last = indices[start], indices[k - 1]
            events.append(
                BlockStored(
                    block_hashes=[
                        self._block_hash(request, group, j) for j in range(first, last + 1)
                    ],
                    parent_block_hash=(
                        self._block_hash(request, group, first - 1) if first else None
                    ),
                    token_ids=list(tokens[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    group_idx=group,
                )
            )
            start = k

    def _record_evicted(self, group: int) -> None:
        # Recorded as they happen, so a batch orders a hash's removal and re-storing correctly.
        evicted = self.pools[group].evicted_hashes
        assert self._events is not None and evicted is not None
        self._events.append(
            BlockRemoved(block_hashes=list(evicted), medium=MEDIUM_GPU, group_idx=group)
        )
        evicted.clear()

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's events since the last call, in order (empty when not recorded)."""
        events = self._events
        if not events:
            return []
        out = list(events)
        events.clear()
        return out

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
            pool.free_blocks(b for b in reversed(group) if b is not self._null)

    def remove_skipped_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Free the request's SWA blocks that computing from ``num_computed_tokens`` never reads.

        Their table entries become null placeholders. A freed block keeps its prefix-cache hash
        (its KV is valid) until the pool reuses it.
        """
        blocks = self._req_blocks.get(request.request_id)
        if blocks is None:
            return
        for g, window in enumerate(self.sliding_windows):
            table = blocks[g]
            end = min(
                num_skipped_blocks(num_computed_tokens, window, self.block_sizes[g]), len(table)
            )
            freed: list[KVCacheBlock] = []
            for j in range(end - 1, -1, -1):  # nulls form a prefix: stop at the first one
                if table[j] is self._null:
                    break
                freed.append(table[j])
                table[j] = self._null
            self.pools[g].free_blocks(reversed(freed))

    def window_pairs(
        self, pairs: dict[int, list[tuple[int, int]]], num_computed_tokens: int
    ) -> dict[int, list[tuple[int, int]]]:
        """``(logical index, block id)`` pairs per group, without null blocks and without the SWA
        blocks that computing from ``num_computed_tokens`` never reads."""
        out: dict[int, list[tuple[int, int]]] = {}
        for g, group_pairs in pairs.items():
            first = num_skipped_blocks(
                num_computed_tokens, self.sliding_windows[g], self.block_sizes[g]
            )
            out[g] = [(i, b) for i, b in group_pairs if i >= first and b != NULL_BLOCK_ID]
        return out

    @property
    def has_sliding_window(self) -> bool:
        """Whether some group has sliding-window attention."""
        return any(w is not None for w in self.sliding_windows)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (allocated blocks stay with their requests)."""
        for pool in self.pools:
            pool.reset_prefix_cache()
            if pool.evicted_hashes is not None:
                pool.evicted_hashes.clear()
        for counts in self._num_cached.values():
            counts[:] = [0] * len(counts)
        if self._events is not None:
            self._events[:] = [AllBlocksCleared()]

    def usage(self) -> float:
        """Fraction of GPU blocks in use, over all groups."""
        total = sum(p.num_blocks for p in self.pools)
        return 1.0 - sum(p.num_free_blocks for p in self.pools) / total
