# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The reuse filter (``store_threshold`` / ``max_tracker_size``): upstream's semantics, wired
from the config through the specs, never applied to promotions."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.v1.kv_offload.utils import make_cpu_spec, make_tiering_spec
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.reuse_filter import StoreReuseFilter
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

CTX = ReqContext("r")


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ks(*indices: int) -> list[OffloadKey]:
    return [k(i) for i in indices]


def offer(manager: CPUOffloadingManager, *indices: int) -> list[OffloadKey]:
    """``prepare_store`` + ``complete_store`` of ``indices``; return the keys stored."""
    out = manager.prepare_store(ks(*indices), CTX)
    assert out is not None
    manager.complete_store(out.keys_to_store, CTX)
    return out.keys_to_store


def test_first_offers_are_skipped_and_counted() -> None:
    manager = CPUOffloadingManager(4, store_threshold=2)
    out = manager.prepare_store(ks(1, 2, 3), CTX)
    assert out is not None
    assert out.keys_to_store == [] and out.evicted_keys == []
    assert len(out.store_spec.block_ids) == 0  # type: ignore[attr-defined]
    assert manager.get_stats()["stores_skipped"] == 3
    assert manager.num_free_blocks == 4  # a skipped block uses no row


def test_a_block_is_stored_from_its_threshold_th_offer() -> None:
    manager = CPUOffloadingManager(8, store_threshold=3)
    assert offer(manager, 1, 2) == []
    assert offer(manager, 1) == []
    assert offer(manager, 1, 2) == ks(1)
    assert offer(manager, 2) == ks(2)
    assert manager.lookup(k(1), CTX) is True
    stats = manager.get_stats()
    assert stats["stores"] == 2 and stats["stores_skipped"] == 4


def test_the_tracker_forgets_the_least_recently_offered_key() -> None:
    """Upstream's test, with offers counted instead of lookups (PR #52227)."""
    manager = CPUOffloadingManager(8, store_threshold=2, max_tracker_size=3)
    assert offer(manager, 1, 2) == []
    assert offer(manager, 1) == ks(1)  # 1 offered twice
    assert offer(manager, 3) == []
    assert offer(manager, 4) == []  # the tracker is full: 2, the least recent, is dropped
    assert offer(manager, 2) == []  # counted from 1 again
    assert offer(manager, 2) == ks(2)


def test_an_offer_larger_than_the_tracker_keeps_its_tracked_counts() -> None:
    """Upstream PR #54759: an offer's tracked keys are not dropped for its new keys."""
    reuse = StoreReuseFilter(2, max_tracker_size=2)
    assert reuse.admit(ks(1, 2), ks(1, 2)) == []
    assert reuse.admit(ks(1, 2, 3), ks(1, 2, 3)) == ks(1, 2)
    assert (reuse.count(k(1)), reuse.count(k(2)), reuse.count(k(3))) == (2, 2, 0)
    assert len(reuse) == 2 and reuse.num_skipped == 3


def test_stored_keys_are_offered_but_stay_protected_and_are_not_skips() -> None:
    manager = CPUOffloadingManager(2, store_threshold=2)
    offer(manager, 1)
    assert offer(manager, 1) == ks(1)
    offer(manager, 2)
    assert offer(manager, 2) == ks(2)  # the cache is full: 1, 2
    skipped = manager.get_stats()["stores_skipped"]
    # 3 is admitted; 1 and 2 are stored: 2 is protected by this call, so 1 is the victim.
    offer(manager, 3)
    out = manager.prepare_store(ks(2, 3), CTX)
    assert out is not None and out.keys_to_store == ks(3) and out.evicted_keys == ks(1)
    assert manager.get_stats()["stores_skipped"] == skipped + 1  # only 3's first offer


def test_stats_without_the_filter_and_reset() -> None:
    assert "stores_skipped" not in CPUOffloadingManager(4).get_stats()
    assert "stores_skipped" not in CPUOffloadingManager(4, store_threshold=1).get_stats()
    manager = CPUOffloadingManager(4, store_threshold=2)
    offer(manager, 1)
    manager.reset_cache()
    assert manager.get_stats()["stores_skipped"] == 0
    assert offer(manager, 1) == ks(1), "the offer counts survive a cache reset"


@pytest.mark.parametrize(("threshold", "tracker"), [(2, 0), (2, -1)])
def test_filter_arguments_are_checked(threshold: int, tracker: int) -> None:
    with pytest.raises(ValueError, match="max_tracker_size"):
        CPUOffloadingManager(4, store_threshold=threshold, max_tracker_size=tracker)
    with pytest.raises(ValueError, match="store_threshold"):
        StoreReuseFilter(1)


def test_the_cpu_spec_builds_the_filter_from_the_config() -> None:
    spec = make_cpu_spec(4096, 8)
    config = OffloadingConfig(cpu_bytes_to_use=8 * 4096, store_threshold=2, max_tracker_size=10)
    filtered = CPUOffloadingSpec(config, spec.run)
    manager = filtered.get_manager()
    assert offer(manager, 1) == [] and offer(manager, 1) == ks(1)
    assert manager.get_stats()["stores_skipped"] == 1
    assert "stores_skipped" not in spec.get_manager().get_stats()


@pytest.fixture
def tiering(tmp_path: Path) -> Iterator[TieringOffloadingManager]:
    spec = make_tiering_spec(tmp_path, 4, 4096, secondary_tiers=[{"type": "example"}])
    config = dataclasses.replace(spec.config, store_threshold=2, max_tracker_size=100)
    spec = TieringOffloadingSpec(config, spec.run)
    manager = spec.get_manager()
    yield manager
    manager.shutdown()


def test_tiering_filters_gpu_stores_but_never_promotions(
    tiering: TieringOffloadingManager,
) -> None:
    manager = tiering
    out = manager.prepare_store(ks(1), CTX)
    assert out is not None and out.keys_to_store == []  # nothing to write: no job
    out = manager.prepare_store(ks(1), CTX)
    assert out is not None and out.keys_to_store == ks(1)
    manager.complete_store(out.keys_to_store, CTX)  # cascaded to the example tier
    manager.on_schedule_end()
    manager.reset_cache()  # the primary forgets 1; the example tier keeps it
    # A lookup finds 1 in the secondary tier and promotes it without any further offer.
    assert manager.lookup(k(1), CTX) is None
    manager.on_schedule_end()  # submits the promotion; the example tier completes it
    manager.on_schedule_end()
    assert manager.lookup(k(1), CTX) is True
    assert manager.get_stats()["stores_skipped"] == 0  # reset_cache zeroed the first skip


class _ModelFilter:
    """Upstream's tracker, written plainly: counts in a list, least recently offered first."""

    def __init__(self, threshold: int, size: int) -> None:
        self.threshold = threshold
        self.size = size
        self.order: list[OffloadKey] = []
        self.counts: dict[OffloadKey, int] = {}

    def admit(self, offered: list[OffloadKey], new: list[OffloadKey]) -> list[OffloadKey]:
        # The offer's keys, tracked before or from now on, are never dropped for its others.
        protected = list(offered)
        for key in [key for key in offered if key in self.counts]:
            self.counts[key] += 1
            self.order.remove(key)
            self.order.append(key)
        for key in offered:
            if key in self.counts:
                continue
            if len(self.order) >= self.size:
                victims = [v for v in self.order if v not in protected]
                if not victims:
                    continue
                self.order.remove(victims[0])
                del self.counts[victims[0]]
            self.order.append(key)
            self.counts[key] = 1
        return [key for key in new if self.counts.get(key, 0) >= self.threshold]


@settings(max_examples=300, deadline=None)
@given(
    threshold=st.integers(2, 4),
    size=st.integers(1, 6),
    offers=st.lists(st.lists(st.integers(0, 9), max_size=8, unique=True), max_size=40),
    stored=st.sets(st.integers(0, 9), max_size=4),
)
def test_the_filter_agrees_with_a_plain_model(
    threshold: int, size: int, offers: list[list[int]], stored: set[int]
) -> None:
    reuse = StoreReuseFilter(threshold, size)
    model = _ModelFilter(threshold, size)
    skipped = 0
    for indices in offers:
        offered = ks(*indices)
        new = [key for i, key in zip(indices, offered, strict=True) if i not in stored]
        admitted = model.admit(offered, new)
        assert reuse.admit(offered, new) == admitted
        skipped += len(new) - len(admitted)
        assert reuse.num_skipped == skipped
        assert len(reuse) == len(model.order) <= size
        for key in model.order:
            assert reuse.count(key) == model.counts[key]


def test_a_refused_offer_is_not_counted() -> None:
    """A ``prepare_store`` refused for a value that is not a key changes nothing, the reuse
    filter's counts included: the next real offer is still the key's first."""
    manager = CPUOffloadingManager(8, store_threshold=2)
    with pytest.raises(TypeError, match="got int 7"):
        manager.prepare_store([k(1), 7], CTX)  # type: ignore[list-item]
    assert manager.get_stats()["stores_skipped"] == 0
    assert offer(manager, 1) == [], "the first offer is skipped"
    assert offer(manager, 1) == ks(1), "the second is stored"
