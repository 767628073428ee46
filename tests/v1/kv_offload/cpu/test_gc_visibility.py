# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The CPU tier allocates no long-lived object while it serves.

Every per-block object (one ``BlockStatus`` per row) and every container of the policies exists
from construction on, so after an application freezes its start-up heap (``gc.freeze()``, as
vLLM's engine core does) a full garbage collection traverses none of the tier's blocks: its pause
no longer grows with the cache.
"""

from __future__ import annotations

import gc

import pytest

from tests.v1.kv_offload.cpu.manager_state import check_invariants
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus

CTX = ReqContext("r")


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def serve(manager: CPUOffloadingManager, num_requests: int) -> None:
    """Stores (some failing), loads and touches, 8 blocks per request, on a full cache."""
    for r in range(num_requests):
        keys = [k(r * 4 + i) for i in range(8)]  # half of each request overlaps the last one
        hits = 0
        for key in keys:
            if manager.lookup(key, CTX) is not True:
                break
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], CTX)
            manager.complete_load(keys[:hits], CTX)
        manager.touch(keys, CTX)
        out = manager.prepare_store(keys[hits:], CTX)
        assert out is not None
        manager.complete_store(out.keys_to_store, CTX, success=r % 7 != 0)
        if r % 50 == 0:
            check_invariants(manager)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_no_block_status_is_created_while_serving(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = CPUOffloadingManager(64, cache_policy=policy)
    created: list[int] = []
    original = BlockStatus.__init__

    def counting_init(self: BlockStatus, block_id: int) -> None:
        created.append(block_id)
        original(self, block_id)

    monkeypatch.setattr(BlockStatus, "__init__", counting_init)
    serve(manager, 200)
    manager.reset_cache()
    serve(manager, 50)
    assert created == []


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_after_a_start_up_freeze_the_collector_sees_no_block(policy: str) -> None:
    manager = CPUOffloadingManager(128, cache_policy=policy)
    gc.collect()  # as vLLM's freeze_gc_heap(): collect, then freeze what is left
    gc.freeze()
    try:
        serve(manager, 400)
        visible = gc.get_objects()
    finally:
        gc.unfreeze()
    assert not any(type(obj) is BlockStatus for obj in visible)
    # Every container that grows with the cache stays frozen. (LRU's map of the blocks being
    # written or read is tracked again once it holds one: it holds only in-flight blocks.)
    containers = {
        id(value): name for name, value in vars(manager.policy).items() if name != "_non_evictable"
    }
    assert [containers[id(obj)] for obj in visible if id(obj) in containers] == []
