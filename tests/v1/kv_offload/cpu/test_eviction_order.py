# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Eviction order within a stored run: a request's blocks are evicted tail first.

A prefix lookup stops at the first miss, so evicting the head K0 of a run K0..Kn stored together
leaves K1..Kn occupying rows that no lookup can reach. Both policies must evict the tail first,
as vLLM's GPU prefix cache does.
"""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

CTX = ReqContext("req-0")


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*indices: int) -> list[OffloadKey]:
    return [k(i) for i in indices]


def prefix_hits(manager: CPUOffloadingManager, keys: list[OffloadKey]) -> int:
    hits = 0
    for key in keys:
        if manager.lookup(key, CTX) is not True:
            break
        hits += 1
    return hits


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_stored_run_is_evicted_tail_first(policy: str) -> None:
    manager = CPUOffloadingManager(4, cache_policy=policy)
    run = ks(0, 1, 2, 3)
    out = manager.prepare_store(run, CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)

    evicted: list[OffloadKey] = []
    for i in range(10, 13):
        out = manager.prepare_store(ks(i), CTX)
        assert out is not None
        manager.complete_store(out.keys_to_store, CTX)
        evicted += out.evicted_keys

    assert evicted == ks(3, 2, 1)
    # The head of the run still serves a one-block prefix hit.
    assert prefix_hits(manager, run) == 1


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_run_released_by_its_last_reader_is_evicted_tail_first(policy: str) -> None:
    manager = CPUOffloadingManager(6, cache_policy=policy)
    out = manager.prepare_store(ks(0, 1, 2, 3), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    # Read back together: the run becomes evictable again when the load completes.
    manager.prepare_load(ks(0, 1, 2, 3), CTX)
    out = manager.prepare_store(ks(10, 11), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    manager.complete_load(ks(0, 1, 2, 3), CTX)

    # LRU order now: 11, 10 (older), then the released run, tail first: 3, 2, 1, 0.
    out = manager.prepare_store(ks(20, 21, 22, 23), CTX)
    assert out is not None
    assert out.evicted_keys == ks(11, 10, 3, 2)
    assert prefix_hits(manager, ks(0, 1, 2, 3)) == 2


def test_store_events_keep_the_callers_key_order() -> None:
    manager = CPUOffloadingManager(4, enable_events=True)
    out = manager.prepare_store(ks(0, 1, 2), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    (event,) = list(manager.take_events())
    assert event.keys == ks(0, 1, 2) and not event.removed
