# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the in-memory reference tier ``ExampleSecondaryTierManager``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from vllm.v1.kv_offload.base import OffloadKey, OffloadPolicy, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, TierJob
from vllm.v1.kv_offload.tiering.example.manager import (
    EXAMPLE_MEDIUM,
    ExampleSecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

CTX = ReqContext(req_id="r")
NUM_BLOCKS = 8


def keys(*ints: int) -> list[OffloadKey]:
    return [make_offload_key(str(i).encode(), 0) for i in ints]


class Harness:
    def __init__(self, tmp_path: Path) -> None:
        # The primary owns the region (and releases it); the harness keeps it to check that.
        self.region = SharedOffloadRegion("example-tier", NUM_BLOCKS, 64, directory=tmp_path)
        self.primary = CPUPrimaryTierOffloadingManager(NUM_BLOCKS, self.region)
        self.view = self.primary.get_kv_memoryview()
        self.rows: npt.NDArray[np.uint8] = np.asarray(self.view)
        self.next_job = 0
        self.tiers: list[ExampleSecondaryTierManager] = []

    def tier(self, **kwargs: object) -> ExampleSecondaryTierManager:
        # The example tier does not read the spec; None keeps these tests independent of it.
        tier = ExampleSecondaryTierManager(None, self.view, "example", **kwargs)  # type: ignore[arg-type]
        self.tiers.append(tier)
        return tier

    def job(self, job_keys: list[OffloadKey], rows: list[int], promotion: bool) -> TierJob:
        self.next_job += 1
        return TierJob(self.next_job, job_keys, np.array(rows, np.int64), promotion, CTX)

    def fill(self, row: int, value: int) -> None:
        self.rows[row] = value

    def close(self) -> None:
        for tier in self.tiers:
            tier.shutdown()
        del self.rows
        self.primary.shutdown()


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_basic_store_and_lookup(h: Harness) -> None:
    tier = h.tier()
    k = keys(1, 2)
    assert [tier.lookup(x, CTX) for x in k] == [False, False]
    job = h.job(k, [0, 1], promotion=False)
    tier.submit_store(job)
    assert [tier.lookup(x, CTX) for x in k] == [True, True]
    assert tier.get_num_blocks() == 2
    assert list(tier.get_finished_jobs()) == [JobResult(job.job_id, True)]
    assert list(tier.get_finished_jobs()) == []  # reported exactly once


def test_store_then_load_roundtrip_copies_bytes(h: Harness) -> None:
    tier = h.tier()
    k = keys(1, 2)
    h.fill(0, 11)
    h.fill(1, 22)
    tier.submit_store(h.job(k, [0, 1], promotion=False))
    h.rows[:] = 0
    tier.submit_load(h.job(list(reversed(k)), [5, 6], promotion=True))
    assert [r.success for r in tier.get_finished_jobs()] == [True, True]
    assert (h.rows[5] == 22).all() and (h.rows[6] == 11).all()
    assert (h.rows[:5] == 0).all() and (h.rows[7] == 0).all()  # only the job's rows written
    stored = tier.get_block_bytes(k[0])
    assert stored is not None and len(stored) == h.rows.shape[1]


def test_store_skips_present_blocks(h: Harness) -> None:
    tier = h.tier(enable_events=True)
    k = keys(1)
    h.fill(0, 1)
    tier.submit_store(h.job(k, [0], promotion=False))
    h.fill(0, 2)
    tier.submit_store(h.job(k, [0], promotion=False))
    assert tier.get_block_bytes(k[0]) == bytes([1]) * h.rows.shape[1]
    events = list(tier.take_events())
    assert [(e.keys, e.medium, e.removed) for e in events] == [(k, EXAMPLE_MEDIUM, False)]


def test_failed_load_missing_key_writes_nothing(h: Harness) -> None:
    tier = h.tier()
    tier.submit_store(h.job(keys(1), [0], promotion=False))
    h.rows[:] = 7
    job = h.job(keys(1, 2), [3, 4], promotion=True)
    tier.submit_load(job)
    assert list(tier.get_finished_jobs())[-1] == JobResult(job.job_id, False)
    assert (h.rows == 7).all()


def test_capacity_evicts_lru_and_protects_the_job(h: Harness) -> None:
    tier = h.tier(capacity_blocks=3, enable_events=True)
    tier.submit_store(h.job(keys(1, 2, 3), [0, 1, 2], promotion=False))
    tier.touch(keys(1), CTX)  # 2 is now the least recently used
    tier.submit_store(h.job(keys(3, 4), [2, 3], promotion=False))  # 3 present, 4 new
    assert tier.keys_lru_order() == keys(3, 1, 4)
    assert not tier.lookup(keys(2)[0], CTX)
    events = list(tier.take_events())
    assert [(e.keys, e.removed) for e in events] == [
        (keys(1, 2, 3), False),
        (keys(2), True),
        (keys(4), False),
    ]


def test_job_larger_than_capacity_fails(h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    tier = h.tier(capacity_blocks=2)
    tier.submit_store(h.job(keys(9), [0], promotion=False))
    job = h.job(keys(1, 2, 3), [0, 1, 2], promotion=False)
    with caplog.at_level(logging.WARNING):
        tier.submit_store(job)
    assert list(tier.get_finished_jobs())[-1] == JobResult(job.job_id, False)
    assert tier.keys_lru_order() == keys(9)


def test_touch_first_key_most_recent(h: Harness) -> None:
    tier = h.tier()
    tier.submit_store(h.job(keys(1, 2, 3, 4), [0, 1, 2, 3], promotion=False))
    tier.touch(keys(2, 3, 99), CTX)
    assert tier.keys_lru_order() == keys(1, 4, 3, 2)


def test_load_refreshes_recency(h: Harness) -> None:
    tier = h.tier()
    tier.submit_store(h.job(keys(1, 2), [0, 1], promotion=False))
    tier.submit_load(h.job(keys(1), [4], promotion=True))
    assert tier.keys_lru_order() == keys(2, 1)


def test_request_level_and_defaults(h: Harness) -> None:
    assert h.tier().on_new_request(CTX).policy is OffloadPolicy.BLOCK_LEVEL
    assert h.tier(request_level=True).on_new_request(CTX).policy is OffloadPolicy.REQUEST_LEVEL
    tier = h.tier()
    assert list(tier.take_events()) == []  # events disabled
    assert tier.has_pending_work() is False
    tier.drain_jobs()


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "3"])
def test_invalid_capacity(h: Harness, capacity: object) -> None:
    with pytest.raises(ValueError, match=r"'example'.*capacity_blocks"):
        h.tier(capacity_blocks=capacity)


def test_unknown_kwarg_rejected(h: Harness) -> None:
    with pytest.raises(TypeError):
        h.tier(bogus=1)


def test_shutdown_releases_the_primary_view(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    harness = Harness(tmp_path)
    tier = harness.tier()
    tier.submit_store(harness.job(keys(1), [0], promotion=False))
    # The primary owns its region and lends only the rows (get_kv_memoryview).
    region = harness.region
    with caplog.at_level(logging.WARNING):
        harness.close()
    assert region.closed
    assert "still alive" not in caplog.text, "the tier kept an array over the primary view"
    with pytest.raises(RuntimeError):
        tier.submit_store(harness.job(keys(2), [0], promotion=False))
