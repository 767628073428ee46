# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Attention types of KV-cache groups, shared by the engine and the KV connector.

A KV-cache group has full attention or sliding-window attention (SWA) over the last ``W`` tokens:
computing position ``p`` reads the KV of positions ``[p - W + 1, p]``. Once a request has
computed ``n`` tokens, the KV of its first ``n - W + 1`` tokens is never read again by an SWA
group (the next position computed is ``n``), so the engine frees every SWA block lying wholly
below that point and leaves ``NULL_BLOCK_ID`` in the request's block table in its place, as vLLM
does with its null block. The connector mirrors the same rule (``num_skipped_tokens``) to know
which SWA blocks are gone without being told.
"""

from __future__ import annotations

NULL_BLOCK_ID = -1
"""Block-table entry of an SWA block the engine freed (vLLM uses its reserved block 0; this
engine's pools reserve no block, so the placeholder is -1)."""


def num_skipped_tokens(num_computed_tokens: int, sliding_window: int | None) -> int:
    """Leading tokens whose KV a group no longer reads once ``num_computed_tokens`` are computed.

    Args:
        num_computed_tokens: tokens computed (the next position computed is this one).
        sliding_window: the group's window in tokens; None for full attention (nothing skipped).
    """
    if sliding_window is None:
        return 0
    return max(0, num_computed_tokens - sliding_window + 1)


def num_skipped_blocks(
    num_computed_tokens: int, sliding_window: int | None, block_size: int
) -> int:
    """Leading blocks of ``block_size`` tokens lying wholly in the skipped tokens."""
    return num_skipped_tokens(num_computed_tokens, sliding_window) // block_size
