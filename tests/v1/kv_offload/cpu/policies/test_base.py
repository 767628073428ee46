# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of vllm/v1/kv_offload/cpu/policies/base.py: ``BlockStatus``, and the parts of the
``CachePolicy`` contract that every built-in policy keeps alike (each policy's own order is
tested in ``test_lru.py`` and ``test_arc.py``)."""

from __future__ import annotations

import pytest

from tests.v1.kv_offload.cpu.policies.utils import CountingSet, evicted_ids, insert_blocks, k
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

POLICIES = [LRUCachePolicy, ARCCachePolicy]


def test_block_status_defaults() -> None:
    block = BlockStatus(7)
    assert block.block_id == 7
    assert block.ref_cnt == -1
    assert not block.is_ready
    block.ref_cnt = 0
    assert block.is_ready
    with pytest.raises(AttributeError):
        block.other = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_insert_get_len(policy_cls: type[LRUCachePolicy] | type[ARCCachePolicy]) -> None:
    policy = policy_cls(8)
    block = BlockStatus(3)
    policy.insert(k(3), block)
    assert policy.get(k(3)) is block
    assert policy.get(k(4)) is None
    assert len(policy) == 1
    assert policy.num_evictable == 0  # being written
    with pytest.raises(AssertionError, match=k(3).hex()):
        policy.insert(k(3), BlockStatus(4))


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_remove_drops_block_in_any_state(
    policy_cls: type[LRUCachePolicy] | type[ARCCachePolicy],
) -> None:
    policy = policy_cls(8)
    insert_blocks(policy, pinned=[0], writing=[1], ready=[2])
    for i in range(3):
        policy.remove(k(i))
    assert len(policy) == 0
    assert policy.num_evictable == 0
    assert policy.evict(1, ()) is None
    with pytest.raises(AssertionError, match=k(1).hex()):
        policy.remove(k(1))


@pytest.mark.parametrize("policy_cls", POLICIES)
def test_evict_visits_only_evictable_entries(
    policy_cls: type[LRUCachePolicy] | type[ARCCachePolicy],
) -> None:
    """What an eviction looks at is bounded by ``n + |protected|``, however many blocks are
    pinned or being written (an ARC that has only T1 blocks evicts them oldest first, as LRU
    does; ``test_arc`` checks a walk of T2 as well)."""
    policy = policy_cls(5000)
    insert_blocks(policy, pinned=range(2000), writing=range(2000, 4000), ready=range(4000, 4010))
    protected = CountingSet({k(4000), k(4001), k(123)})
    assert evicted_ids(policy.evict(3, protected)) == [4002, 4003, 4004]
    # Two protected evictable entries skipped, then three victims: nothing else looked at.
    assert protected.lookups == 5
