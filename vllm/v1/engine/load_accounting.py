# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The scheduler's load accounting: block verification and promoted-token attribution.

``BlockVerifier`` checks GPU blocks against recomputation; the helpers here count what it
checked and attribute the tokens served by promoted (secondary-tier) blocks to their tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import PromotedBlock
from vllm.v1.engine.kv_cache_manager import KVCacheManager
from vllm.v1.engine.stats import SECONDARY, EngineStats
from vllm.v1.request import Request

__all__ = ["BlockVerifier", "account_promoted", "count_verified_promoted", "verify_finished"]

BlockVerifier = Callable[[Request, Mapping[int, list[tuple[int, int]]], int], dict[int, set[int]]]
"""``(request, {group: [(logical_idx, gpu_block_id)]}, num_tokens) -> {group: bad block ids}``."""


def account_promoted(
    stats: EngineStats, promoted: Sequence[PromotedBlock], num_local: int, num_computed: int
) -> int:
    """Attribute the served tokens of promoted blocks to their tiers; return their sum.

    Only tokens in ``[num_local, num_computed)`` were served (the rest failed, did not
    verify, or is the last prompt token, which is always recomputed).
    """
    total = 0
    for block in promoted:
        n = max(0, min(block.end_token, num_computed) - max(block.start_token, num_local))
        if not n:
            continue
        total += n
        tier = block.tier or SECONDARY
        stats.tokens_from_tier[tier] = stats.tokens_from_tier.get(tier, 0) + n
        origins = stats.served_not_stored_here
        if origins is not None and block.stored_here is False:
            origins[(tier, block.key)] = origins.get((tier, block.key), 0) + n
    return total


def count_verified_promoted(
    stats: EngineStats, block_sizes: Sequence[int], promoted: Sequence[PromotedBlock], end: int
) -> None:
    """Count per tier the GPU blocks of promoted offloaded blocks below ``end``.

    They are checked with the rest of the load, so a report can show that they were.
    """
    by_tier = stats.blocks_verified_by_tier
    for block in promoted:
        hi = min(block.end_token, end)
        n = sum(len(range(-(-block.start_token // bs) * bs, hi, bs)) for bs in block_sizes)
        if n:
            tier = block.tier or SECONDARY
            by_tier[tier] = by_tier.get(tier, 0) + n


def verify_finished(
    verifier: BlockVerifier, kv: KVCacheManager, stats: EngineStats, request: Request
) -> None:
    """Check every computed GPU block of a finishing request."""
    blocks = kv.get_block_ids(request.request_id)
    num_tokens = request.num_computed_tokens
    pairs = kv.window_pairs(
        {
            g: [(i, b) for i, b in enumerate(blocks[g]) if i * bs < num_tokens]
            for g, bs in enumerate(kv.block_sizes)
        },
        0,
    )
    mismatched = verifier(request, pairs, num_tokens)
    stats.blocks_verified += sum(len(p) for p in pairs.values())
    stats.verification_failures += sum(len(b) for b in mismatched.values())
