# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The scheduler's load accounting: promoted-token attribution and what the oracle records.

The helpers here attribute the tokens served by promoted (secondary-tier) blocks to their tiers,
count the promoted blocks the oracle will check, and hand a finishing request's blocks to the
oracle (``verification.KVOracle``).
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import PromotedBlock
from vllm.v1.engine.kv_cache_manager import KVCacheManager
from vllm.v1.engine.stats import SECONDARY, EngineStats
from vllm.v1.engine.verification import KVOracle
from vllm.v1.request import Request

__all__ = ["account_promoted", "count_verified_promoted", "record_finished"]


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

    The oracle checks them with the rest of the load, so a report can show that they were.
    """
    by_tier = stats.blocks_verified_by_tier
    for block in promoted:
        hi = min(block.end_token, end)
        n = sum(len(range(-(-block.start_token // bs) * bs, hi, bs)) for bs in block_sizes)
        if n:
            tier = block.tier or SECONDARY
            by_tier[tier] = by_tier.get(tier, 0) + n


def record_finished(oracle: KVOracle, kv: KVCacheManager, request: Request) -> None:
    """Record every full computed GPU block of a finishing request for the oracle's check."""
    blocks = kv.get_block_ids(request.request_id)
    num_tokens = min(request.num_computed_tokens, request.num_tokens)
    pairs = kv.window_pairs(
        {
            g: [(i, b) for i, b in enumerate(blocks[g]) if (i + 1) * bs <= num_tokens]
            for g, bs in enumerate(kv.block_sizes)
        },
        0,
    )
    oracle.record_blocks(request, pairs, loaded=False)
