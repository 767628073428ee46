# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Chained prefix hashing of token blocks.

A request's token ids are cut into blocks of ``block_size`` tokens. The hash of block ``i`` covers
the hash of block ``i - 1`` (its parent) and the token ids of block ``i``, so two blocks share a
hash exactly when their whole token prefixes are identical. Only full blocks are hashed.

The chain starts from ``NONE_HASH``, a fixed seed: hashes are deterministic across processes and
runs, which is what lets a persistent tier (the filesystem tier) serve blocks written by another
engine instance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NewType

import numpy as np

if TYPE_CHECKING:
    from vllm.v1.request import Request

BlockHash = NewType("BlockHash", bytes)
"""SHA-256 digest (32 bytes) identifying a full block and its whole token prefix."""

NONE_HASH = BlockHash(hashlib.sha256(b"vllm-kv-offload/NONE_HASH/v1").digest())
"""Parent hash of the first block of every request: a fixed, documented seed."""


def hash_block_tokens(parent_block_hash: BlockHash, block_token_ids: Sequence[int]) -> BlockHash:
    """Hash one full block given its parent's hash.

    Args:
        parent_block_hash: the previous block's hash, or ``NONE_HASH`` for the first block.
        block_token_ids: the block's token ids (non-negative, < 2**32).

    Returns:
        ``sha256(parent_block_hash || token_ids as little-endian uint32)``.
    """
    tokens = np.asarray(block_token_ids, dtype=np.uint32)
    return BlockHash(hashlib.sha256(parent_block_hash + tokens.tobytes()).digest())


BlockHasher = Callable[["Request"], list[BlockHash]]
"""Given a request, returns the hashes of its full blocks that are not hashed yet."""


def get_request_block_hasher(block_size: int) -> BlockHasher:
    """Return a hasher that extends ``request.block_hashes`` block by block.

    Args:
        block_size: tokens per hashed block (``> 0``).

    The returned callable looks at ``request.block_hashes`` (already computed) and
    ``request.all_token_ids`` and returns the hashes of the full blocks after the last hashed one.
    It is incremental: each call costs O(new tokens).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

    def request_block_hasher(request: Request) -> list[BlockHash]:
        done = len(request.block_hashes)
        parent = request.block_hashes[-1] if done else NONE_HASH
        tokens = request.all_token_ids
        new_hashes: list[BlockHash] = []
        start = done * block_size
        while start + block_size <= len(tokens):
            parent = hash_block_tokens(parent, tokens[start : start + block_size])
            new_hashes.append(parent)
            start += block_size
        return new_hashes

    return request_block_hasher
