# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Chained prefix hashing of token blocks."""

from __future__ import annotations

import hashlib

import numpy as np

from vllm.v1.core.kv_cache_utils import NONE_HASH, get_request_block_hasher, hash_block_tokens
from vllm.v1.request import Request


def test_none_hash_is_a_fixed_documented_seed() -> None:
    assert hashlib.sha256(b"vllm-kv-offload/NONE_HASH/v1").digest() == NONE_HASH


def test_block_hash_covers_parent_and_tokens() -> None:
    h = hash_block_tokens(NONE_HASH, [1, 2, 3, 4])
    expected = hashlib.sha256(NONE_HASH + np.array([1, 2, 3, 4], dtype="<u4").tobytes()).digest()
    assert h == expected and len(h) == 32
    assert hash_block_tokens(h, [5, 6]) != hash_block_tokens(NONE_HASH, [5, 6])


def test_identical_prefixes_share_hashes_only_up_to_the_first_difference() -> None:
    hasher = get_request_block_hasher(4)
    a = Request("a", list(range(12)), 1, block_hasher=hasher)
    b = Request("b", [*range(6), 99, *range(7, 12)], 1, block_hasher=hasher)
    assert len(a.block_hashes) == len(b.block_hashes) == 3
    assert a.block_hashes[0] == b.block_hashes[0]
    assert a.block_hashes[1:] != b.block_hashes[1:]
    assert a.block_hashes[2] != b.block_hashes[2]


def test_hashes_extend_incrementally_as_tokens_are_generated() -> None:
    hasher = get_request_block_hasher(4)
    grown = Request("a", [1, 2, 3, 4, 5, 6], 8, block_hasher=hasher)
    assert len(grown.block_hashes) == 1
    grown.append_output_token_ids([7, 8])
    grown.append_output_token_ids(9)
    whole = Request("b", list(range(1, 10)), 1, block_hasher=hasher)
    assert grown.block_hashes == whole.block_hashes and len(whole.block_hashes) == 2
