# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Helpers shared by the cache-policy tests: keys by integer, and the manager's ref_cnt moves."""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def insert_ready(policy: CachePolicy, i: int) -> BlockStatus:
    """Insert block i as the manager would (ref -1), then complete its store (ref 0)."""
    block = BlockStatus(block_id=i)
    policy.insert(k(i), block)
    block.ref_cnt = 0
    policy.mark_evictable(k(i))
    return block


def pin(policy: CachePolicy, i: int) -> None:
    block = policy.get(k(i))
    assert block is not None
    if block.ref_cnt == 0:
        policy.mark_non_evictable(k(i))
    block.ref_cnt += 1


def unpin(policy: CachePolicy, i: int) -> None:
    block = policy.get(k(i))
    assert block is not None
    block.ref_cnt -= 1
    if block.ref_cnt == 0:
        policy.mark_evictable(k(i))


def evicted_ids(victims: list[tuple[OffloadKey, BlockStatus]] | None) -> list[int]:
    assert victims is not None
    return [block.block_id for _, block in victims]


class CountingSet(set[OffloadKey]):
    """A set that counts membership tests, to bound how many entries an eviction visits."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.lookups = 0

    def __contains__(self, key: object) -> bool:
        self.lookups += 1
        return super().__contains__(key)
