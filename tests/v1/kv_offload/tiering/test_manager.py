# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``TieringOffloadingManager``: cascade, promotion, step lifecycle, request lifecycle.

Every component is real: the primary tier runs over a real ``SharedOffloadRegion`` (in
``tmp_path``) and the secondary tiers are the in-memory example tier, which really copies rows.
``RecordingTier`` only adds a call log to it, so that call order can be asserted.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from typing_extensions import override

from tests.v1.kv_offload.tiering.gated_tier import WatchedExampleTier
from tests.v1.kv_offload.tiering.manager_state import (
    jobs_in_flight,
    queued_promotions,
    request_level_tiers,
    request_states,
)
from tests.v1.kv_offload.utils import make_tiering_spec
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TierJob
from vllm.v1.kv_offload.tiering.example.manager import (
    EXAMPLE_MEDIUM,
    ExampleSecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    SecondaryTierReportError,
    TieringOffloadingManager,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

_CTX = ReqContext(req_id="test")
NUM_PRIMARY_BLOCKS = 5
WORKER_PAGE_BYTES = 16  # rows are padded to one page


def to_keys(ints: Iterable[int]) -> list[OffloadKey]:
    return [make_offload_key(str(i).encode(), 0) for i in ints]


def count_hits(
    manager: TieringOffloadingManager | CPUPrimaryTierOffloadingManager,
    keys: Sequence[OffloadKey],
    ctx: ReqContext = _CTX,
) -> int | None:
    """Leading keys that hit; None as soon as one lookup answers None."""
    hits = 0
    for key in keys:
        result = manager.lookup(key, ctx)
        if result is None:
            return None
        if not result:
            break
        hits += 1
    return hits


def key_content(key: OffloadKey, row_bytes: int) -> npt.NDArray[np.uint8]:
    """Deterministic bytes of block ``key`` (one primary row)."""
    digest = hashlib.sha256(key).digest()
    return np.frombuffer(digest * (row_bytes // len(digest)), dtype=np.uint8)


def make_spec(tmp_path: Path, num_blocks: int = NUM_PRIMARY_BLOCKS) -> TieringOffloadingSpec:
    return make_tiering_spec(
        tmp_path,
        num_blocks,
        gpu_kv_bytes_per_block=WORKER_PAGE_BYTES,
        instance_id=f"tiering-test-{tmp_path.name}",
    )


def make_region(tmp_path: Path, num_blocks: int = NUM_PRIMARY_BLOCKS) -> SharedOffloadRegion:
    return SharedOffloadRegion(
        f"tiering-test-{tmp_path.name}",
        num_blocks,
        WORKER_PAGE_BYTES,
        directory=tmp_path,
        prefault=False,
    )


def make_primary(
    tmp_path: Path,
    num_blocks: int = NUM_PRIMARY_BLOCKS,
    enable_events: bool = False,
    region: SharedOffloadRegion | None = None,
) -> CPUPrimaryTierOffloadingManager:
    """A primary tier over ``region`` (by default a new one of ``num_blocks`` rows)."""
    if region is None:
        region = make_region(tmp_path, num_blocks)
    return CPUPrimaryTierOffloadingManager(num_blocks, region, enable_events=enable_events)


class RecordingTier(ExampleSecondaryTierManager):
    """The example tier, logging every manager-facing call into a shared list.

    Attributes:
        raise_in_submit: ``submit_*`` raise ``OSError`` (a tier that cannot start a job).
        request_level: new requests are answered ``REQUEST_LEVEL`` (as the example tier built
            with ``request_level=True`` answers them).
        lost: keys the tier has lost: it no longer finds them, and a load of one fails.
        extra_reports: reports added to the next poll's (a broken tier's).
    """

    def __init__(self, *args: Any, log: list[tuple[Any, ...]], name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log
        self.name = name
        self.raise_in_submit = False
        self.request_level = False
        self.lost: set[OffloadKey] = set()
        self.extra_reports: list[JobResult] = []

    def calls(self, method: str) -> list[tuple[Any, ...]]:
        return [entry[2:] for entry in self.log if entry[:2] == (self.name, method)]

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        self.log.append((self.name, "lookup", key))
        if key in self.lost:
            return False
        return super().lookup(key, req_context)

    @override
    def submit_store(self, job: TierJob) -> None:
        self.log.append((self.name, "submit_store", tuple(job.keys), job.req_context))
        if self.raise_in_submit:
            raise OSError("injected submit_store failure")
        super().submit_store(job)

    @override
    def submit_load(self, job: TierJob) -> None:
        self.log.append((self.name, "submit_load", tuple(job.keys), job.req_context))
        if self.raise_in_submit:
            raise OSError("injected submit_load failure")
        if self.lost.intersection(job.keys):
            self.extra_reports.append(JobResult(job.job_id, False))
            return
        super().submit_load(job)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = list(super().get_finished_jobs())
        finished += self.extra_reports
        self.extra_reports = []
        self.log.append((self.name, "get_finished_jobs", tuple(r.job_id for r in finished)))
        return finished

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.log.append((self.name, "touch", tuple(keys), req_context))
        super().touch(keys, req_context)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.log.append((self.name, "on_new_request", req_context))
        if self.request_level:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return super().on_new_request(req_context)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.log.append((self.name, "on_request_finished", req_context))

    @override
    def on_schedule_end(self) -> None:
        self.log.append((self.name, "on_schedule_end"))

    @override
    def drain_jobs(self) -> None:
        self.log.append((self.name, "drain_jobs"))

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        self.log.append((self.name, "take_events"))
        return super().take_events()

    @override
    def shutdown(self) -> None:
        self.log.append((self.name, "shutdown"))
        super().shutdown()

    @property
    def num_unreported_jobs(self) -> int:
        return len(self._finished)


class MinimalTier(SecondaryTierManager):
    """Implements only the abstract primitives: every optional hook is the base default."""

    def __init__(
        self,
        offloading_spec: TieringOffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str = "minimal",
        **kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, **kwargs)
        self.blocks: set[OffloadKey] = set()
        self.finished: list[JobResult] = []

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return key in self.blocks

    @override
    def submit_store(self, job: TierJob) -> None:
        self.blocks.update(job.keys)
        self.finished.append(JobResult(job.job_id, True))

    @override
    def submit_load(self, job: TierJob) -> None:
        self.finished.append(JobResult(job.job_id, all(k in self.blocks for k in job.keys)))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self.finished = self.finished, []
        return finished

    @override
    def drain_jobs(self) -> None:
        pass

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


class TestTieringOffloadingManager:
    @pytest.fixture(autouse=True)
    def manager_setup(self, tmp_path: Path) -> Iterable[None]:
        self.tmp_path = tmp_path
        self.spec = make_spec(tmp_path)
        self.region = make_region(tmp_path)  # the primary owns it (and releases it)
        self.primary = make_primary(tmp_path, enable_events=True, region=self.region)
        self.view = self.primary.get_kv_memoryview()
        self.rows = np.asarray(self.view)
        self.log: list[tuple[Any, ...]] = []
        self.tiers = [
            RecordingTier(
                self.spec, self.view, "example", enable_events=True, log=self.log, name=f"tier{i}"
            )
            for i in range(2)
        ]
        self.manager = TieringOffloadingManager(self.primary, self.tiers)
        yield
        del self.rows
        self.manager.shutdown()

    def _simulate_on_schedule_end(self) -> None:
        """Simulate end of scheduler step: lifecycle flush + drain events."""
        self.manager.on_schedule_end()
        list(self.manager.take_events())

    # -- helpers ------------------------------------------------------------------------------

    def _ref_cnt(self, key: OffloadKey) -> int:
        block = self.primary.policy.get(key)
        assert block is not None, f"key {key.hex()} not in primary"
        return block.ref_cnt

    def _store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext = _CTX, success: bool = True
    ) -> list[OffloadKey]:
        """prepare_store + write each new key's content into its row + complete_store."""
        output = self.manager.prepare_store(keys, ctx)
        assert output is not None
        assert isinstance(output.store_spec, CPULoadStoreSpec)
        for key, block_id in zip(output.keys_to_store, output.store_spec.block_ids, strict=True):
            self.rows[block_id] = key_content(key, self.rows.shape[1])
        self.manager.complete_store(output.keys_to_store, ctx, success)
        return output.keys_to_store

    def _store_in_tiers_only(self, keys: Sequence[OffloadKey]) -> None:
        """Store, cascade, then reset the primary (tiers keep the data) and wipe its rows."""
        self._store(keys)
        self.manager.reset_cache()
        self.rows[:] = 0
        self.log.clear()

    def _assert_rows_hold(self, keys: Sequence[OffloadKey]) -> None:
        spec = self.manager.prepare_load(keys, _CTX)
        assert isinstance(spec, CPULoadStoreSpec)
        for key, block_id in zip(keys, spec.block_ids, strict=True):
            np.testing.assert_array_equal(self.rows[block_id], key_content(key, self.rows.shape[1]))
        self.manager.complete_load(keys, _CTX)

    # -- store / cascade ----------------------------------------------------------------------

    def test_basic_store_to_primary(self) -> None:
        keys = to_keys([1, 2, 3])
        assert self._store(keys) == keys
        assert count_hits(self.primary, keys) == 3
        assert count_hits(self.manager, keys) == 3
        self._assert_rows_hold(keys)

    def test_cascade_to_all_secondary_tiers(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store(keys)
        for tier in self.tiers:
            assert tier.calls("submit_store") == [(tuple(keys), _CTX)]
            assert tier.get_num_blocks() == 3
            for key in keys:
                stored = tier.get_block_bytes(key)
                assert stored is not None
                np.testing.assert_array_equal(
                    np.frombuffer(stored, np.uint8), key_content(key, self.rows.shape[1])
                )

    def test_ref_cnt_protection_during_cascade(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store(keys)
        assert [self._ref_cnt(k) for k in keys] == [2, 2, 2]
        assert all(tier.num_unreported_jobs == 1 for tier in self.tiers)
        # prepare_store already polled this step: the first step end does not poll again.
        self._simulate_on_schedule_end()
        assert [self._ref_cnt(k) for k in keys] == [2, 2, 2]
        assert all(tier.num_unreported_jobs == 1 for tier in self.tiers)
        self._simulate_on_schedule_end()
        assert [self._ref_cnt(k) for k in keys] == [0, 0, 0]
        assert all(tier.num_unreported_jobs == 0 for tier in self.tiers)
        assert self.manager.num_jobs_in_flight == 0

    def test_failed_store_no_cascade(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store(keys, success=False)
        assert count_hits(self.primary, keys) == 0
        for tier in self.tiers:
            assert tier.calls("submit_store") == []
            assert tier.get_num_blocks() == 0
        assert self.primary.num_free_blocks == NUM_PRIMARY_BLOCKS

    def test_complete_store_forwards_req_context_to_submit_store(self) -> None:
        ctx = ReqContext(req_id="req-a", kv_transfer_params={"x": 1})
        keys = to_keys([7, 8])
        self._store(keys, ctx)
        for tier in self.tiers:
            ((job_keys, job_ctx),) = tier.calls("submit_store")
            assert job_keys == tuple(keys)
            assert job_ctx is ctx

    # -- lookup / promotion -------------------------------------------------------------------

    def test_lookup_from_primary(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store(keys)
        self.log.clear()
        assert count_hits(self.manager, keys) == 3
        assert not any(entry[1] == "lookup" for entry in self.log), "primary hit asked a tier"

    def test_partial_lookup(self) -> None:
        self._store(to_keys([1, 2, 3]))
        assert count_hits(self.manager, to_keys([1, 2, 3, 4, 5])) == 3

    def test_lookup_miss_everywhere(self) -> None:
        (key,) = to_keys([9])
        assert self.manager.lookup(key, _CTX) is False
        # Every tier was asked, in order.
        assert [e[0] for e in self.log if e[1] == "lookup"] == ["tier0", "tier1"]
        self._simulate_on_schedule_end()
        assert all(tier.calls("submit_load") == [] for tier in self.tiers)

    def test_promotion_from_secondary(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store_in_tiers_only(keys)
        assert count_hits(self.primary, keys) == 0

        assert [self.manager.lookup(k, _CTX) for k in keys] == [None, None, None]
        assert self.tiers[0].calls("submit_load") == []  # never from lookup
        # Promotion rows are reserved at once: the primary reports them in flight.
        assert [self.primary.lookup(k, _CTX) for k in keys] == [None, None, None]

        self._simulate_on_schedule_end()  # submits the load
        assert self.tiers[0].calls("submit_load") == [(tuple(keys), _CTX)]
        assert self.tiers[1].calls("submit_load") == []  # the first tier that has it wins
        assert [self.primary.lookup(k, _CTX) for k in keys] == [None, None, None]

        self._simulate_on_schedule_end()  # processes its completion
        assert count_hits(self.primary, keys) == 3
        assert count_hits(self.manager, keys) == 3
        self._assert_rows_hold(keys)

    def test_probe_promotes_nothing_and_a_lookup_in_the_step_promotes_once(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store_in_tiers_only(keys)
        hits_before = list(self.manager.tiering_stats.hits)
        assert [self.manager.probe(k, _CTX) for k in keys] == [None, None, None]
        assert [self.manager.probe(k, _CTX) for k in keys] == [None, None, None]  # no change
        assert count_hits(self.primary, keys) == 0  # no row reserved
        lookups = len(self.tiers[0].calls("lookup"))
        # Only the middle key is looked up: it is promoted from the tier the probe found,
        # which is not asked again (nor counted again).
        assert self.manager.lookup(keys[1], _CTX) is None
        assert len(self.tiers[0].calls("lookup")) == lookups
        assert self.manager.tiering_stats.hits[0] == hits_before[0] + 3
        self._simulate_on_schedule_end()
        assert self.tiers[0].calls("submit_load") == [((keys[1],), _CTX)]
        self._simulate_on_schedule_end()
        assert [self.manager.probe(k, _CTX) for k in keys] == [None, True, None]
        self._assert_rows_hold([keys[1]])

    def test_a_probe_is_forgotten_when_the_step_ends(self) -> None:
        keys = to_keys([1])
        self._store_in_tiers_only(keys)
        assert self.manager.probe(keys[0], _CTX) is None
        self._simulate_on_schedule_end()
        lookups = len(self.tiers[0].calls("lookup"))
        # A later step's lookup asks the tiers afresh.
        assert self.manager.lookup(keys[0], _CTX) is None
        assert len(self.tiers[0].calls("lookup")) == lookups + 1
        self._simulate_on_schedule_end()
        assert self.tiers[0].calls("submit_load") == [(tuple(keys), _CTX)]

    def test_probe_of_an_absent_key_is_false_and_of_a_resident_one_true(self) -> None:
        keys = to_keys([1, 2])
        self._store(keys[:1])
        assert self.manager.probe(keys[0], _CTX) is True
        assert self.manager.probe(keys[1], _CTX) is False
        with pytest.raises(TypeError):
            self.manager.probe("not a key", _CTX)  # type: ignore[arg-type]

    def test_lookup_batches_submit_load_per_request(self) -> None:
        keys = to_keys([1, 2, 3, 4])
        self._store_in_tiers_only(keys)
        ctx_a, ctx_b = ReqContext(req_id="a"), ReqContext(req_id="b")
        assert self.manager.lookup(keys[0], ctx_a) is None
        assert self.manager.lookup(keys[1], ctx_a) is None
        assert self.manager.lookup(keys[2], ctx_b) is None
        assert self.manager.lookup(keys[3], ctx_b) is None
        assert self.tiers[0].calls("submit_load") == []
        self._simulate_on_schedule_end()
        calls = self.tiers[0].calls("submit_load")
        assert len(calls) == 2
        by_ctx = {ctx.req_id: (job_keys, ctx) for job_keys, ctx in calls}
        assert by_ctx["a"] == ((keys[0], keys[1]), ctx_a)
        assert by_ctx["b"] == ((keys[2], keys[3]), ctx_b)
        assert by_ctx["a"][1] is ctx_a and by_ctx["b"][1] is ctx_b
        # Nothing left to submit: the next step end submits nothing more.
        self._simulate_on_schedule_end()
        assert len(self.tiers[0].calls("submit_load")) == 2
        assert count_hits(self.manager, keys, ctx_a) == 4

    def test_lookup_shared_block_no_duplicate_promotion(self) -> None:
        (key,) = to_keys([1])
        self._store_in_tiers_only([key])
        ctx_a, ctx_b = ReqContext(req_id="a"), ReqContext(req_id="b")
        assert self.manager.lookup(key, ctx_a) is None
        assert self.manager.lookup(key, ctx_b) is None
        self._simulate_on_schedule_end()
        calls = self.tiers[0].calls("submit_load")
        assert calls == [((key,), ctx_a)]
        assert calls[0][1] is ctx_a  # the first request that asked owns the job
        assert self.tiers[1].calls("submit_load") == []
        self._simulate_on_schedule_end()
        assert self.manager.lookup(key, ctx_b) is True
        assert len(self.tiers[0].calls("submit_load")) == 1

    def test_promotion_when_primary_full_returns_false(self) -> None:
        promoted = to_keys([100])
        self._store_in_tiers_only(promoted)
        # Fill the primary with blocks pinned by loads: nothing is evictable.
        resident = to_keys(range(NUM_PRIMARY_BLOCKS))
        self._store(resident)
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        self.manager.prepare_load(resident, _CTX)
        assert self.manager.lookup(promoted[0], _CTX) is False
        self._simulate_on_schedule_end()
        assert self.tiers[0].calls("submit_load") == []
        self.manager.complete_load(resident, _CTX)
        # Room again: the promotion starts.
        assert self.manager.lookup(promoted[0], _CTX) is None

    def test_failed_promotion_frees_slot_and_later_lookup_promotes_again(self) -> None:
        keys = to_keys([1, 2])
        self._store_in_tiers_only(keys)
        free_before = self.primary.num_free_blocks
        # Tier 0 loses the block after answering the lookup: its load fails.
        assert self.manager.lookup(keys[0], _CTX) is None
        self.tiers[0].lost.add(keys[0])
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        assert self.primary.policy.get(keys[0]) is None, "failed promotion left its row"
        assert self.primary.num_free_blocks == free_before
        assert self.manager.num_jobs_in_flight == 0
        # A later lookup promotes again, now from tier 1 which still has the block.
        assert self.manager.lookup(keys[0], _CTX) is None
        self._simulate_on_schedule_end()
        assert self.tiers[1].calls("submit_load") == [((keys[0],), _CTX)]
        self._simulate_on_schedule_end()
        assert self.manager.lookup(keys[0], _CTX) is True
        self._assert_rows_hold(keys[:1])

    def test_lookup_prefix_answers_as_lookup_and_submits_one_job(self) -> None:
        promoted = to_keys([1, 2, 3])
        self._store_in_tiers_only(promoted)
        resident, absent = to_keys([10]), to_keys([99, 100])
        self._store(resident)
        self._simulate_on_schedule_end()
        keys = [promoted[0], resident[0], promoted[1], promoted[1], promoted[2], *absent]
        # Up to the first miss (the key after it is not answered); a key twice is promoted once.
        assert self.manager.lookup_prefix(keys, _CTX) == [None, True, None, None, None, False]
        assert [self.primary.lookup(k, _CTX) for k in promoted] == [None, None, None]
        self._simulate_on_schedule_end()
        assert self.tiers[0].calls("submit_load") == [(tuple(promoted), _CTX)]
        self._simulate_on_schedule_end()
        assert self.manager.lookup_prefix(keys[:5], _CTX) == [True] * 5
        self._assert_rows_hold(promoted)

    def test_lookup_prefix_never_evicts_a_block_it_found_readable(self) -> None:
        promoted = to_keys([100, 101])
        self._store_in_tiers_only(promoted)
        resident = to_keys(range(NUM_PRIMARY_BLOCKS))  # fills the primary
        self._store(resident)
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        # A run stored together is evicted tail first: resident[-1] is the least recently used
        # block, resident[-2] the next. One lookup after another, the promotion of promoted[0]
        # would evict resident[-1] although the scan had just found it readable.
        keys = [resident[-1], promoted[0], resident[-2], promoted[1]]
        assert self.manager.lookup_prefix(keys, _CTX) == [True, None, True, None]
        assert self.primary.lookup(resident[-1], _CTX) is True
        assert self.primary.lookup(resident[-2], _CTX) is True
        evicted = [k for k in resident if self.primary.policy.get(k) is None]
        assert evicted == resident[-4:-2]  # the next two in the order

    def test_lookup_prefix_answers_false_where_the_primary_has_no_room(self) -> None:
        promoted = to_keys([100, 101])
        self._store_in_tiers_only(promoted)
        resident = to_keys(range(NUM_PRIMARY_BLOCKS))
        self._store(resident)
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        # All pinned but one: room for the first promotion only.
        self.manager.prepare_load(resident[1:], _CTX)
        keys = [promoted[0], promoted[1], resident[1]]
        assert self.manager.lookup_prefix(keys, _CTX) == [None, False]
        assert self.primary.lookup(promoted[1], _CTX) is False
        self._simulate_on_schedule_end()
        assert self.tiers[0].calls("submit_load") == [((promoted[0],), _CTX)]
        self.manager.complete_load(resident[1:], _CTX)

    def test_lookup_prefix_promotes_from_each_tier_that_holds_a_key(self) -> None:
        first, second = to_keys([1, 2])
        self._store_in_tiers_only([first, second])
        self.tiers[0].lost.add(second)  # only tier 1 still has it

        def tier0_lookup(key: OffloadKey, req_context: ReqContext) -> bool | None:
            return key == first

        self.tiers[0].lookup = tier0_lookup  # type: ignore[method-assign]
        assert self.manager.lookup_prefix([first, second], _CTX) == [None, None]
        self._simulate_on_schedule_end()
        assert self.tiers[0].calls("submit_load") == [((first,), _CTX)]
        assert self.tiers[1].calls("submit_load") == [((second,), _CTX)]
        self._simulate_on_schedule_end()
        self._assert_rows_hold([first, second])

    def test_tier_answering_none_defers_lookup(self) -> None:
        (key,) = to_keys([1])

        def pending_lookup(key: OffloadKey, req_context: ReqContext) -> bool | None:
            return None

        self.tiers[0].lookup = pending_lookup  # type: ignore[method-assign]
        assert self.manager.lookup(key, _CTX) is None  # tier 1 says no, tier 0 cannot tell yet
        # A later tier that has the key still starts the promotion.
        self._store_in_tiers_only([key])
        assert self.manager.lookup(key, _CTX) is None
        self._simulate_on_schedule_end()
        assert self.tiers[1].calls("submit_load") == [((key,), _CTX)]

    # -- eviction / touch ---------------------------------------------------------------------

    def test_eviction_in_primary_tier(self) -> None:
        first = to_keys(range(NUM_PRIMARY_BLOCKS))
        self._store(first)
        self._simulate_on_schedule_end()  # the next prepare_store polls and releases the pins
        output = self.manager.prepare_store(to_keys([10, 11]), _CTX)
        assert output is not None
        assert output.keys_to_store == to_keys([10, 11])
        # The run is evicted tail first: its head stays reachable by prefix lookups.
        assert output.evicted_keys == [first[4], first[3]]
        self.manager.complete_store(output.keys_to_store, _CTX)
        assert count_hits(self.primary, first) == 3
        assert count_hits(self.primary, to_keys([10, 11])) == 2

    def test_cascade_pins_block_eviction(self) -> None:
        first = to_keys(range(NUM_PRIMARY_BLOCKS))
        self._store(first)
        # The cascades are unreported (the gate is set): every row is pinned, nothing evicts.
        assert self.manager.prepare_store(to_keys([10]), _CTX) is None

    def test_touch_propagates_to_all_tiers(self) -> None:
        keys = to_keys(range(NUM_PRIMARY_BLOCKS))
        self._store(keys)
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        touched = keys[:2]
        self.manager.touch(touched, _CTX)
        for tier in self.tiers:
            assert tier.calls("touch") == [(tuple(touched), _CTX)]
            assert tier.keys_lru_order()[-2:] == [keys[1], keys[0]]
        # In the primary the touched keys are now the most recently used: others go first.
        output = self.manager.prepare_store(to_keys([20, 21, 22]), _CTX)
        assert output is not None
        assert output.evicted_keys == [keys[4], keys[3], keys[2]]  # the untouched tail first

    # -- request lifecycle --------------------------------------------------------------------

    def test_on_new_request_lifecycle(self) -> None:
        ctx = ReqContext(req_id="r1")
        assert self.manager.on_new_request(ctx).policy is OffloadPolicy.BLOCK_LEVEL
        assert [e[0] for e in self.log if e[1] == "on_new_request"] == ["tier0", "tier1"]
        self.manager.on_request_finished(ctx)
        assert [e[0] for e in self.log if e[1] == "on_request_finished"] == ["tier0", "tier1"]

        self.tiers[1].request_level = True
        ctx2 = ReqContext(req_id="r2")
        assert self.manager.on_new_request(ctx2).policy is OffloadPolicy.REQUEST_LEVEL
        assert request_level_tiers(self.manager) == {"r2": (1,)}
        self.manager.on_request_finished(ctx2)
        assert request_level_tiers(self.manager) == {}
        assert request_states(self.manager) == {}

    def test_prepare_store_cascades_existing_blocks_to_request_level_tiers(self) -> None:
        existing = to_keys([1, 2])
        self._store(existing)
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        self.log.clear()
        self.tiers[1].request_level = True
        ctx = ReqContext(req_id="rl")
        self.manager.on_new_request(ctx)
        new = to_keys([3])
        output = self.manager.prepare_store([*existing, *new], ctx)
        assert output is not None and output.keys_to_store == new
        # Only the request-level tier gets the existing blocks, at prepare time, pinned once.
        assert self.tiers[0].calls("submit_store") == []
        assert self.tiers[1].calls("submit_store") == [(tuple(existing), ctx)]
        assert [self._ref_cnt(k) for k in existing] == [1, 1]
        self.manager.complete_store(new, ctx)
        assert self.tiers[0].calls("submit_store") == [(tuple(new), ctx)]
        assert self.tiers[1].calls("submit_store") == [(tuple(existing), ctx), (tuple(new), ctx)]
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        assert [self._ref_cnt(k) for k in [*existing, *new]] == [0, 0, 0]

    def test_request_level_membership_survives_reset_cache(self) -> None:
        # Issue #17 part 3: a running request stays request-level across a reset; only
        # finished requests lose their membership.
        self.tiers[1].request_level = True
        ctx = ReqContext(req_id="rl")
        assert self.manager.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
        finished_ctx = ReqContext(req_id="done")
        self.manager.on_new_request(finished_ctx)
        assert self.manager.prepare_store(to_keys([9]), finished_ctx) is not None
        self.manager.on_request_finished(finished_ctx)  # delayed: a store is pending
        self.manager.reset_cache()
        assert request_level_tiers(self.manager) == {"rl": (1,)}

        keys = to_keys([1, 2])
        self._store(keys, ReqContext(req_id="other"))
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        self.log.clear()
        output = self.manager.prepare_store(keys, ctx)
        assert output is not None and output.keys_to_store == []
        assert self.tiers[0].calls("submit_store") == []
        assert self.tiers[1].calls("submit_store") == [(tuple(keys), ctx)]
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        self.manager.on_request_finished(ctx)
        assert request_level_tiers(self.manager) == {}

    def test_on_request_finished_delays_secondary_until_store_submitted(self) -> None:
        ctx = ReqContext(req_id="r")
        self.manager.on_new_request(ctx)
        keys = to_keys([1, 2])
        output = self.manager.prepare_store(keys, ctx)
        assert output is not None
        self.log.clear()
        self.manager.on_request_finished(ctx)
        # The primary knows at once; the tiers not yet: a cascade is still to come.
        assert not any(e[1] == "on_request_finished" for e in self.log)
        self.manager.complete_store(keys, ctx)
        order = [(e[0], e[1]) for e in self.log if e[1] in ("submit_store", "on_request_finished")]
        assert order == [
            ("tier0", "submit_store"),
            ("tier1", "submit_store"),
            ("tier0", "on_request_finished"),
            ("tier1", "on_request_finished"),
        ]
        # Exactly once.
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        assert sum(e[1] == "on_request_finished" for e in self.log) == 2
        assert request_states(self.manager) == {}

    def test_on_request_finished_waits_for_every_pending_store(self) -> None:
        ctx = ReqContext(req_id="r")
        first, second = to_keys([1]), to_keys([2])
        assert self.manager.prepare_store(first, ctx) is not None
        assert self.manager.prepare_store(second, ctx) is not None
        self.manager.on_request_finished(ctx)
        self.manager.complete_store(first, ctx)
        assert not any(e[1] == "on_request_finished" for e in self.log)
        self.manager.complete_store(second, ctx, success=False)  # failures count down too
        assert [e[0] for e in self.log if e[1] == "on_request_finished"] == ["tier0", "tier1"]

    def test_on_request_finished_waits_for_queued_promotions(self) -> None:
        (key,) = to_keys([1])
        self._store_in_tiers_only([key])
        ctx = ReqContext(req_id="r")
        assert self.manager.lookup(key, ctx) is None
        self.manager.on_request_finished(ctx)
        assert not any(e[1] == "on_request_finished" for e in self.log)
        self.manager.on_schedule_end()
        order = [e[:2] for e in self.log if e[1] in ("submit_load", "on_request_finished")]
        assert order == [
            ("tier0", "submit_load"),
            ("tier0", "on_request_finished"),
            ("tier1", "on_request_finished"),
        ]

    # -- step lifecycle -----------------------------------------------------------------------

    def test_on_schedule_end_order(self) -> None:
        """poll -> reset gate -> flush promotions -> tier hooks, each once."""
        (key,) = to_keys([1])
        self._store_in_tiers_only([key])
        assert self.manager.lookup(key, _CTX) is None  # polls: the gate is now set
        self.log.clear()
        self.manager.on_schedule_end()
        assert [e[:2] for e in self.log] == [
            ("tier0", "submit_load"),  # gate was set: no poll, straight to the flush
            ("tier0", "on_schedule_end"),
            ("tier1", "on_schedule_end"),
        ]
        self.log.clear()
        self.manager.on_schedule_end()  # gate reset: poll, then flush (nothing), then hooks
        assert [e[:2] for e in self.log] == [
            ("tier0", "get_finished_jobs"),
            ("tier1", "get_finished_jobs"),
            ("tier0", "on_schedule_end"),
            ("tier1", "on_schedule_end"),
        ]

    def test_a_step_polls_before_flushing_and_the_next_step_polls_again(self) -> None:
        keys = to_keys([1, 2])
        self._store_in_tiers_only(keys)
        self.manager.on_schedule_end()  # a new step, nothing queued
        self.log.clear()
        assert self.manager.lookup(keys[0], _CTX) is None  # polls, then queues a promotion
        self.manager.on_schedule_end()
        assert [e[:2] for e in self.log if e[1] != "lookup"] == [
            ("tier0", "get_finished_jobs"),
            ("tier1", "get_finished_jobs"),
            ("tier0", "submit_load"),
            ("tier0", "on_schedule_end"),
            ("tier1", "on_schedule_end"),
        ]
        # The gate was reset BEFORE the flush and not set again by it: the next step's first
        # lookup polls and sees the synchronous tier's completion at once.
        self.log.clear()
        assert self.manager.lookup(keys[0], _CTX) is True
        assert [e[:2] for e in self.log] == [
            ("tier0", "get_finished_jobs"),
            ("tier1", "get_finished_jobs"),
        ]

    def test_gate_polls_at_most_once_per_step(self) -> None:
        keys = to_keys([1, 2, 3])
        self._store(keys)
        self.manager.on_schedule_end()
        self.log.clear()
        for key in keys:
            self.manager.lookup(key, _CTX)
        self.manager.prepare_load(keys, _CTX)
        self.manager.prepare_store(to_keys([4]), _CTX)
        assert sum(e[1] == "get_finished_jobs" for e in self.log) == 2  # once per tier

    def test_take_events_has_no_side_effects(self) -> None:
        stored = to_keys([1, 2])
        promoted = to_keys([3])
        self._store_in_tiers_only(promoted)
        self._store(stored)  # cascades pending; prepare_store polled this step
        self.manager.on_schedule_end()  # a new step; the cascades are still unreported
        assert self.manager.lookup(promoted[0], _CTX) is None  # polls, then queues a promotion
        assert self.manager.num_jobs_in_flight == 0  # that poll saw the cascades finish
        pinned_before = [self._ref_cnt(k) for k in stored]
        self.log.clear()

        # Mid-step (polled already): take_events does not flush the promotion, and does not
        # reset the gate, or the lookup below would poll again.
        for _ in range(5):
            list(self.manager.take_events())
        assert [e[:2] for e in self.log if e[1] != "take_events"] == []
        assert self.manager.has_pending_work()  # the promotion is still queued
        assert [self._ref_cnt(k) for k in stored] == pinned_before
        assert self.manager.lookup(promoted[0], _CTX) is None
        assert not any(e[1] == "get_finished_jobs" for e in self.log), "take_events reset the gate"

        self.manager.on_schedule_end()  # flushes the promotion, which the tier finishes at once
        assert self.tiers[0].calls("submit_load") == [((promoted[0],), _CTX)]
        self.log.clear()

        # At the start of a step (not polled yet): take_events does not poll, and does not set
        # the gate either, or on_schedule_end would not poll.
        for _ in range(5):
            list(self.manager.take_events())
        assert [e[:2] for e in self.log if e[1] != "take_events"] == []
        block = self.primary.policy.get(promoted[0])
        assert block is not None and not block.is_ready  # its finish is not polled in yet
        self.manager.on_schedule_end()
        assert [e[:2] for e in self.log if e[1] == "get_finished_jobs"] == [
            ("tier0", "get_finished_jobs"),
            ("tier1", "get_finished_jobs"),
        ]
        assert block.is_ready

    def test_take_events_does_not_release_cascade_pins(self) -> None:
        keys = to_keys([1])
        self._store(keys)
        self.manager.on_schedule_end()  # gate reset, no poll (prepare_store polled)
        for _ in range(3):
            list(self.manager.take_events())
        assert self._ref_cnt(keys[0]) == 2
        assert all(tier.num_unreported_jobs == 1 for tier in self.tiers)

    def test_take_events_aggregates_tier_owned_events(self) -> None:
        keys = to_keys([1, 2])
        self._store(keys)
        events = list(self.manager.take_events())
        assert [(e.medium, e.removed, e.keys) for e in events] == [
            ("CPU", False, keys),
            (EXAMPLE_MEDIUM, False, keys),  # tier 0
            (EXAMPLE_MEDIUM, False, keys),  # tier 1
        ]
        # take_events asks the tiers in order, after the primary's events.
        assert [e[0] for e in self.log if e[1] == "take_events"] == ["tier0", "tier1"]
        assert list(self.manager.take_events()) == []

    def test_has_pending_work(self) -> None:
        assert not self.manager.has_pending_work()
        keys = to_keys([1])
        self._store(keys)
        assert self.manager.has_pending_work()  # cascades in flight
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        assert not self.manager.has_pending_work()

    # -- reset / failures / shutdown ----------------------------------------------------------

    def test_reset_cache(self) -> None:
        stored = to_keys([1, 2])
        promoted = to_keys([3])
        self._store_in_tiers_only(promoted)
        self._store(stored)  # cascades in flight
        assert self.manager.lookup(promoted[0], _CTX) is None  # promotion queued, unsubmitted
        finished_ctx = ReqContext(req_id="finished")
        assert self.manager.prepare_store(to_keys([4]), finished_ctx) is not None
        self.manager.on_request_finished(finished_ctx)  # delayed: a store is pending
        self.log.clear()

        self.manager.reset_cache()

        assert [e[:2] for e in self.log if e[1] == "drain_jobs"] == [
            ("tier0", "drain_jobs"),
            ("tier1", "drain_jobs"),
        ]
        assert self.manager.num_jobs_in_flight == 0
        assert all(tier.num_unreported_jobs == 0 for tier in self.tiers)
        assert all(tier.calls("submit_load") == [] for tier in self.tiers)  # dropped
        assert [e[0] for e in self.log if e[1] == "on_request_finished"] == ["tier0", "tier1"]
        assert not self.manager.has_pending_work()
        assert self.primary.num_free_blocks == NUM_PRIMARY_BLOCKS
        assert request_states(self.manager) == {}
        # Secondary data is kept: the blocks can be promoted again.
        for tier in self.tiers:
            assert tier.get_num_blocks() == 3
        self.log.clear()
        assert self.manager.lookup(stored[0], _CTX) is None
        # The reset began a new step: the gate (set by this step's lookup) is clear again.
        assert [e[:2] for e in self.log][:2] == [
            ("tier0", "get_finished_jobs"),
            ("tier1", "get_finished_jobs"),
        ]

    def test_submit_store_raising_is_a_failed_job(self, caplog: pytest.LogCaptureFixture) -> None:
        self.tiers[0].raise_in_submit = True
        keys = to_keys([1, 2])
        self._store(keys)
        assert "injected submit_store failure" in caplog.text
        # Tier 0's pin was released at once, tier 1's is held until it reports.
        assert [self._ref_cnt(k) for k in keys] == [1, 1]
        assert self.manager.num_jobs_in_flight == 1
        assert self.manager.get_stats()["tiering_jobs_failed"] == 1
        self._simulate_on_schedule_end()
        self._simulate_on_schedule_end()
        assert [self._ref_cnt(k) for k in keys] == [0, 0]
        assert not self.manager.has_pending_work()

    def test_submit_load_raising_is_a_failed_job(self) -> None:
        keys = to_keys([1])
        self._store_in_tiers_only(keys)
        free_before = self.primary.num_free_blocks
        self.tiers[0].raise_in_submit = True
        assert self.manager.lookup(keys[0], _CTX) is None
        self._simulate_on_schedule_end()
        assert self.primary.policy.get(keys[0]) is None
        assert self.primary.num_free_blocks == free_before
        assert self.manager.num_jobs_in_flight == 0
        assert not self.manager.has_pending_work()
        self.tiers[0].raise_in_submit = False
        assert self.manager.lookup(keys[0], _CTX) is None  # and it can be promoted again

    def test_unknown_job_report_is_an_error(self) -> None:
        self.tiers[0].extra_reports.append(JobResult(job_id=12345, success=True))
        with pytest.raises(SecondaryTierReportError, match=r"#0 \(example\).*unknown job 12345"):
            self.manager.on_schedule_end()

    def test_shutdown_order(self) -> None:
        # The primary owns its region and lends only the rows (get_kv_memoryview).
        region_path = self.region.path
        assert Path(region_path).exists()
        del self.rows  # the test's own array over the view
        self.manager.shutdown()
        assert [e[:2] for e in self.log if e[1] == "shutdown"] == [
            ("tier0", "shutdown"),
            ("tier1", "shutdown"),
        ]
        assert self.region.closed
        assert not Path(region_path).exists()
        with pytest.raises(RuntimeError):
            self.primary.get_kv_memoryview()
        self.manager.shutdown()  # idempotent
        self.rows = np.zeros(1)

    def test_works_without_secondary_tiers(self, tmp_path: Path) -> None:
        sub = tmp_path / "solo"
        sub.mkdir()
        manager = TieringOffloadingManager(make_primary(sub))
        try:
            keys = to_keys([1, 2, 3])
            assert manager.on_new_request(_CTX).policy is OffloadPolicy.BLOCK_LEVEL
            output = manager.prepare_store(keys, _CTX)
            assert output is not None and output.keys_to_store == keys
            manager.complete_store(keys, _CTX)
            self._simulate_on_schedule_end()
            manager.on_schedule_end()
            assert count_hits(manager, to_keys([1, 2, 3, 4])) == 3
            assert manager.lookup(to_keys([4])[0], _CTX) is False
            manager.touch(keys, _CTX)
            manager.on_request_finished(_CTX)
            assert not manager.has_pending_work()
            manager.reset_cache()
            assert count_hits(manager, keys) == 0
        finally:
            manager.shutdown()


class TestSecondaryTierDefaults:
    """The optional hooks of ``SecondaryTierManager`` are true no-ops."""

    def test_default_hooks_are_no_ops(self, tmp_path: Path) -> None:
        primary = make_primary(tmp_path)
        tier = MinimalTier(make_spec(tmp_path), primary.get_kv_memoryview())
        try:
            before = dict(vars(tier))
            keys = to_keys([1])
            assert tier.touch(keys, _CTX) is None  # type: ignore[func-returns-value]
            assert tier.on_request_finished(_CTX) is None  # type: ignore[func-returns-value]
            assert tier.on_schedule_end() is None  # type: ignore[func-returns-value]
            assert tier.has_pending_work() is False
            assert list(tier.take_events()) == []
            assert tier.shutdown() is None  # type: ignore[func-returns-value]
            assert vars(tier) == before
            assert tier.blocks == set() and tier.finished == []
        finally:
            primary.shutdown()

    def test_minimal_tier_works_behind_the_manager(self, tmp_path: Path) -> None:
        primary = make_primary(tmp_path)
        tier = MinimalTier(make_spec(tmp_path), primary.get_kv_memoryview())
        manager = TieringOffloadingManager(primary, [tier])
        try:
            keys = to_keys([1, 2])
            assert manager.prepare_store(keys, _CTX) is not None
            manager.complete_store(keys, _CTX)
            manager.touch(keys, _CTX)
            manager.on_request_finished(_CTX)
            for _ in range(2):
                manager.on_schedule_end()
                assert list(manager.take_events()) == []
            assert not manager.has_pending_work()
            assert tier.blocks == set(keys)
        finally:
            manager.shutdown()

    def test_unknown_tier_kwargs_raise(self, tmp_path: Path) -> None:
        primary = make_primary(tmp_path)
        try:
            with pytest.raises(ValueError, match=r"'minimal'.*bogus"):
                SecondaryTierManager.__init__(
                    MinimalTier.__new__(MinimalTier),
                    make_spec(tmp_path),
                    primary.get_kv_memoryview(),
                    "minimal",
                    bogus=1,
                )
        finally:
            primary.shutdown()


class TestCPUPrimaryTier:
    def test_aliases_and_view(self, tmp_path: Path) -> None:
        primary = make_primary(tmp_path)
        try:
            view = primary.get_kv_memoryview()
            assert view.format == "B"
            assert view.shape == (NUM_PRIMARY_BLOCKS, SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT)
            keys = to_keys([1, 2])
            assert primary.reserve_rows(keys, _CTX) == [0, 1]
            assert primary.lookup(keys[0], _CTX) is None
            primary.complete_write(keys, _CTX)
            spec = primary.prepare_read(keys, _CTX)
            assert isinstance(spec, CPULoadStoreSpec)
            block = primary.policy.get(keys[0])
            assert block is not None and block.ref_cnt == 1
            primary.complete_read(keys, _CTX)
            assert block.ref_cnt == 0
            failed = to_keys([3])
            assert primary.reserve_rows(failed, _CTX) is not None
            primary.complete_write(failed, _CTX, success=False)
            assert primary.policy.get(failed[0]) is None
        finally:
            primary.shutdown()

    def test_num_blocks_must_match_region(self, tmp_path: Path) -> None:
        region = SharedOffloadRegion("mismatch", 4, WORKER_PAGE_BYTES, directory=tmp_path)
        try:
            with pytest.raises(ValueError, match="num_blocks=3"):
                CPUPrimaryTierOffloadingManager(3, region)
        finally:
            region.cleanup()


# ---------------------------------------------------------------------------------------------
# Stateful test: random lookups, stores, loads, failures and step ends
# ---------------------------------------------------------------------------------------------


class JobRecorder:
    """Shared by the test tiers: tracks every job from submission to its report."""

    def __init__(self) -> None:
        self.in_flight: dict[int, TierJob] = {}
        self.reported: set[int] = set()
        self.finished_calls: dict[tuple[str, str], int] = {}
        # get_finished_jobs calls, over every tier.
        self.polls = 0

    def on_submit(self, job: TierJob) -> None:
        assert job.job_id not in self.in_flight and job.job_id not in self.reported, (
            f"job id {job.job_id} reused"
        )
        if job.is_promotion:
            promoting = self.promoting_keys()
            for key in job.keys:
                assert key not in promoting, f"key {key.hex()} promoted twice at once"
        self.in_flight[job.job_id] = job

    def on_report(self, results: Iterable[JobResult]) -> list[JobResult]:
        """Check and record one tier's ``get_finished_jobs`` answer."""
        self.polls += 1
        results = list(results)
        for result in results:
            assert result.job_id not in self.reported, f"job {result.job_id} reported twice"
            assert result.job_id in self.in_flight, f"job {result.job_id} was never submitted"
            del self.in_flight[result.job_id]
            self.reported.add(result.job_id)
        return results

    def on_request_finished(self, tier_type: str, req_context: ReqContext) -> None:
        """Count one tier's ``on_request_finished`` call for a request."""
        key = (tier_type, req_context.req_id)
        self.finished_calls[key] = self.finished_calls.get(key, 0) + 1

    def promoting_keys(self) -> list[OffloadKey]:
        return [k for job in self.in_flight.values() if job.is_promotion for k in job.keys]


class RecordedExampleTier(WatchedExampleTier):
    """The synchronous example tier, reporting to a ``JobRecorder``."""

    def __init__(self, *args: Any, recorder: JobRecorder, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = recorder

    @override
    def on_submit(self, job: TierJob) -> None:
        self.recorder.on_submit(job)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return self.recorder.on_report(super().get_finished_jobs())

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.recorder.on_request_finished(self.tier_type, req_context)


class AsyncTestTier(SecondaryTierManager):
    """Jobs finish on a later poll (or when the test completes them early); some fail.

    A job submitted before poll ``n`` runs (copies, like a tier's I/O thread would) during poll
    ``n + 1`` and is reported by it. Jobs in ``fail_job_ids`` fail.
    """

    def __init__(
        self, spec: TieringOffloadingSpec, view: memoryview, recorder: JobRecorder
    ) -> None:
        super().__init__(spec, view, "async_test")
        self.recorder = recorder
        self._rows: npt.NDArray[np.uint8] | None = np.asarray(view)
        self.blocks: dict[OffloadKey, bytes] = {}
        self.running: dict[int, TierJob] = {}
        self.polls_seen: dict[int, int] = {}
        self.fail_job_ids: set[int] = set()
        self.done: list[JobResult] = []

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return key in self.blocks

    @override
    def submit_store(self, job: TierJob) -> None:
        self._start(job)

    @override
    def submit_load(self, job: TierJob) -> None:
        self._start(job)

    def _start(self, job: TierJob) -> None:
        """A store or a load alike: it runs when ``complete`` is called for it."""
        self.recorder.on_submit(job)
        self.running[job.job_id] = job
        self.polls_seen[job.job_id] = 0

    def complete(self, job_id: int, success: bool = True) -> None:
        job = self.running.pop(job_id)
        del self.polls_seen[job_id]
        success = success and job_id not in self.fail_job_ids
        assert self._rows is not None
        if success and job.is_promotion:
            success = all(k in self.blocks for k in job.keys)
            if success:
                for key, block_id in zip(job.keys, job.block_ids, strict=True):
                    self._rows[block_id] = np.frombuffer(self.blocks[key], np.uint8)
        elif success:
            for key, block_id in zip(job.keys, job.block_ids, strict=True):
                self.blocks.setdefault(key, self._rows[block_id].tobytes())
        self.done.append(JobResult(job_id, success))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        for job_id in list(self.running):
            if self.polls_seen[job_id] >= 1:
                self.complete(job_id)
            else:
                self.polls_seen[job_id] += 1
        done, self.done = self.done, []
        return self.recorder.on_report(done)

    @override
    def drain_jobs(self) -> None:
        for job_id in list(self.running):
            self.complete(job_id)

    @override
    def has_pending_work(self) -> bool:
        return bool(self.running or self.done)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self.recorder.on_request_finished(self.tier_type, req_context)

    @override
    def shutdown(self) -> None:
        self._rows = None


_NUM_KEYS = 16
_STATEFUL_PRIMARY_BLOCKS = 6
_KEYS = to_keys(range(_NUM_KEYS))


class TieringMachine(RuleBasedStateMachine):
    """One synchronous tier (the example tier, bounded) and one asynchronous test tier."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="tiering-machine-"))
        self.manager: TieringOffloadingManager | None = None
        self.active: list[ReqContext] = []
        self.finished: list[ReqContext] = []
        self.num_requests = 0
        self.num_resets = 0
        self.outstanding_stores: list[tuple[ReqContext, list[OffloadKey]]] = []
        self.outstanding_loads: list[tuple[ReqContext, list[OffloadKey]]] = []
        # The model of the manager's poll gate: whether a call polled the tiers this step.
        self.polled_this_step = False

    @initialize(async_first=st.booleans())
    def setup(self, async_first: bool) -> None:
        self.recorder = JobRecorder()
        spec = make_spec(self.tmp, _STATEFUL_PRIMARY_BLOCKS)
        self.primary = make_primary(self.tmp, _STATEFUL_PRIMARY_BLOCKS)
        view = self.primary.get_kv_memoryview()
        self.rows = np.asarray(view)
        self.sync_tier = RecordedExampleTier(
            spec, view, "example", capacity_blocks=8, recorder=self.recorder
        )
        self.async_tier = AsyncTestTier(spec, view, self.recorder)
        tiers: list[SecondaryTierManager] = [self.sync_tier, self.async_tier]
        if async_first:
            tiers.reverse()
        self.manager = TieringOffloadingManager(self.primary, tiers)
        self.new_request()

    # -- helpers ------------------------------------------------------------------------------

    @property
    def m(self) -> TieringOffloadingManager:
        assert self.manager is not None
        return self.manager

    def _check_polls(self, polls_before: int, what: str) -> None:
        """The tiers were polled (once each) iff nothing polled them yet this step."""
        expected = 0 if self.polled_this_step else len(self.m.secondary_tiers)
        polls = self.recorder.polls - polls_before
        assert polls == expected, f"{what}: {polls} tier polls, expected {expected}"

    def _lookup(self, key: OffloadKey, ctx: ReqContext) -> bool | None:
        polls_before = self.recorder.polls
        result = self.m.lookup(key, ctx)
        self._check_polls(polls_before, "lookup")
        self.polled_this_step = True
        return result

    def _load_pins(self) -> dict[OffloadKey, int]:
        pins: dict[OffloadKey, int] = {}
        for _, keys in self.outstanding_loads:
            for key in keys:
                pins[key] = pins.get(key, 0) + 1
        return pins

    def _queued_promotion_keys(self) -> list[OffloadKey]:
        return queued_promotions(self.m)

    def _ready_keys(self) -> list[OffloadKey]:
        get = self.primary.policy.get
        return [k for k in _KEYS if (b := get(k)) is not None and b.is_ready]

    def _tier_only_keys(self) -> list[OffloadKey]:
        get = self.primary.policy.get
        return [
            k
            for k in _KEYS
            if get(k) is None and (k in self.async_tier.blocks or self.sync_tier.lookup(k, _CTX))
        ]

    # -- rules --------------------------------------------------------------------------------

    @rule()
    def new_request(self) -> None:
        ctx = ReqContext(req_id=f"r{self.num_requests}")
        self.num_requests += 1
        assert self.m.on_new_request(ctx).policy is OffloadPolicy.BLOCK_LEVEL
        self.active.append(ctx)

    @precondition(lambda self: len(self.active) > 1)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(self.active))
        self.active.remove(ctx)
        self.finished.append(ctx)
        self.m.on_request_finished(ctx)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), key_idx=st.integers(0, _NUM_KEYS - 1))
    def lookup(self, data: st.DataObject, key_idx: int) -> None:
        ctx = data.draw(st.sampled_from(self.active))
        key = _KEYS[key_idx]
        self._check_answer(key, self._lookup(key, ctx))

    def _check_answer(self, key: OffloadKey, result: bool | None) -> None:
        """``key``'s lookup answer agrees with the primary after the call."""
        block = self.primary.policy.get(key)
        if result is True:
            assert block is not None and block.is_ready, f"key {key.hex()} hit but not ready"
        elif result is None:
            # Neither test tier defers a lookup: None means a store or promotion is in flight.
            assert block is not None and not block.is_ready, f"key {key.hex()}: None, not in flight"
        else:
            assert block is None, f"key {key.hex()}: False but resident in primary"

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def lookup_prefix(self, data: st.DataObject) -> None:
        """A request's prefix in one call (tier-only keys among them start promotions, whose
        bytes ``load`` checks later): each answer as ``lookup``'s, up to the first False."""
        ctx = data.draw(st.sampled_from(self.active))
        keys = data.draw(st.lists(st.sampled_from(_KEYS), min_size=1, max_size=6))
        polls_before = self.recorder.polls
        results = self.m.lookup_prefix(keys, ctx)
        self._check_polls(polls_before, "lookup_prefix")
        self.polled_this_step = True
        assert 1 <= len(results) <= len(keys) and False not in results[:-1], results
        assert len(results) == len(keys) or results[-1] is False, results
        for key, result in zip(keys, results, strict=False):
            self._check_answer(key, result)

    @precondition(lambda self: self.active and self._tier_only_keys())
    @rule(data=st.data())
    def lookup_tier_only_key(self, data: st.DataObject) -> None:
        """Look up a key only a secondary tier holds: this starts a promotion."""
        ctx = data.draw(st.sampled_from(self.active))
        key = data.draw(st.sampled_from(self._tier_only_keys()))
        result = self._lookup(key, ctx)
        block = self.primary.policy.get(key)
        if result is None:
            assert block is not None and not block.is_ready, f"key {key.hex()}: None, no row"
        else:
            # A finished promotion polled in by this lookup, or no room in the primary.
            assert (result is True and block is not None and block.is_ready) or (
                result is False and block is None
            ), f"key {key.hex()}: {result}, block {block}"
        if data.draw(st.booleans()):
            self.step_end()

    @precondition(lambda self: self.active and self._ready_keys())
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        ctx = data.draw(st.sampled_from(self.active))
        ready = self._ready_keys()
        keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=3, unique=True))
        polls_before = self.recorder.polls
        spec = self.m.prepare_load(keys, ctx)
        self._check_polls(polls_before, "prepare_load")
        self.polled_this_step = True
        assert isinstance(spec, CPULoadStoreSpec)
        for key, block_id in zip(keys, spec.block_ids, strict=True):
            np.testing.assert_array_equal(
                self.rows[block_id], key_content(key, self.rows.shape[1]), err_msg=key.hex()
            )
        if data.draw(st.booleans()):
            self.m.complete_load(keys, ctx)
        else:
            self.outstanding_loads.append((ctx, keys))

    @precondition(lambda self: self.outstanding_loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        idx = data.draw(st.integers(0, len(self.outstanding_loads) - 1))
        ctx, keys = self.outstanding_loads.pop(idx)
        self.m.complete_load(keys, ctx)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), key_idxs=st.lists(st.integers(0, _NUM_KEYS - 1), min_size=1, max_size=4))
    def store(self, data: st.DataObject, key_idxs: list[int]) -> None:
        ctx = data.draw(st.sampled_from(self.active))
        keys = [_KEYS[i] for i in dict.fromkeys(key_idxs)]
        polls_before = self.recorder.polls
        output = self.m.prepare_store(keys, ctx)
        self._check_polls(polls_before, "prepare_store")
        self.polled_this_step = True
        if output is None or not output.keys_to_store:
            return
        assert isinstance(output.store_spec, CPULoadStoreSpec)
        for key, block_id in zip(output.keys_to_store, output.store_spec.block_ids, strict=True):
            self.rows[block_id] = key_content(key, self.rows.shape[1])  # the GPU -> CPU copy
        if data.draw(st.booleans()):
            self.m.complete_store(output.keys_to_store, ctx, True)  # finished within the step
        else:
            self.outstanding_stores.append((ctx, output.keys_to_store))
        if data.draw(st.booleans()):
            self.step_end()  # as build_connector_meta() does after preparing stores

    @precondition(lambda self: self.outstanding_stores)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        idx = data.draw(st.integers(0, len(self.outstanding_stores) - 1))
        ctx, keys = self.outstanding_stores.pop(idx)
        self.m.complete_store(keys, ctx, success)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), key_idxs=st.lists(st.integers(0, _NUM_KEYS - 1), max_size=3))
    def touch(self, data: st.DataObject, key_idxs: list[int]) -> None:
        ctx = data.draw(st.sampled_from(self.active))
        self.m.touch([_KEYS[i] for i in key_idxs], ctx)

    @rule()
    def step_end(self) -> None:
        polls_before = self.recorder.polls
        self.m.on_schedule_end()
        self._check_polls(polls_before, "on_schedule_end")
        self.polled_this_step = False
        list(self.m.take_events())

    @precondition(lambda self: self.async_tier.running)
    @rule(data=st.data())
    def complete_async_jobs_early(self, data: st.DataObject) -> None:
        job_ids = data.draw(st.lists(st.sampled_from(sorted(self.async_tier.running)), unique=True))
        for job_id in job_ids:
            self.async_tier.complete(job_id, success=data.draw(st.booleans()))

    @precondition(lambda self: self.async_tier.running)
    @rule(data=st.data())
    def fail_async_job(self, data: st.DataObject) -> None:
        self.async_tier.fail_job_ids.add(
            data.draw(st.sampled_from(sorted(self.async_tier.running)))
        )

    @rule()
    def take_events_only(self) -> None:
        # No poll here; had take_events set or reset the poll gate, the next gated call's
        # _check_polls would fail.
        before = (
            self.recorder.polls,
            dict(self.recorder.in_flight),
            self._queued_promotion_keys(),
            [(k, b.ref_cnt) for k, b in self.primary.policy.items()],
        )
        for _ in range(2):
            list(self.m.take_events())
        after = (
            self.recorder.polls,
            dict(self.recorder.in_flight),
            self._queued_promotion_keys(),
            [(k, b.ref_cnt) for k, b in self.primary.policy.items()],
        )
        assert before == after, "take_events changed manager state"

    @precondition(lambda self: self.num_resets == 0)
    @rule()
    def reset_cache(self) -> None:
        self.num_resets += 1
        # The connector flushes its jobs and ignores their completions after a reset.
        self.outstanding_loads.clear()
        self.outstanding_stores.clear()
        self.m.reset_cache()
        self.polled_this_step = False  # a reset begins a new step
        assert not self.recorder.in_flight
        assert not self.async_tier.running

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def pins_match_jobs_in_flight(self) -> None:
        if self.manager is None:
            return
        assert set(self.recorder.in_flight) == set(jobs_in_flight(self.m)), (
            "manager and tiers disagree"
        )
        cascade_pins: dict[OffloadKey, int] = {}
        for job in self.recorder.in_flight.values():
            if not job.is_promotion:
                for key in job.keys:
                    cascade_pins[key] = cascade_pins.get(key, 0) + 1
        load_pins = self._load_pins()
        writing = {k for _, keys in self.outstanding_stores for k in keys}
        promoting = self.recorder.promoting_keys()
        queued = self._queued_promotion_keys()
        for key, block in self.primary.policy.items():
            if block.is_ready:
                expected = cascade_pins.get(key, 0) + load_pins.get(key, 0)
                assert block.ref_cnt == expected, (
                    f"key {key.hex()}: ref_cnt {block.ref_cnt}, expected {expected}"
                )
            else:
                assert key in writing or key in promoting or key in queued, (
                    f"key {key.hex()} is being written but no store or promotion owns it"
                )
        for key in cascade_pins:
            block = self.primary.policy.get(key)
            assert block is not None and block.is_ready, f"cascaded key {key.hex()} not ready"

    @invariant()
    def no_key_promoted_twice(self) -> None:
        if self.manager is None:
            return
        keys = self.recorder.promoting_keys() + self._queued_promotion_keys()
        assert len(keys) == len(set(keys)), "a key is promoted twice at once"

    @invariant()
    def pending_work_reflects_jobs(self) -> None:
        if self.manager is None:
            return
        if self.recorder.in_flight or self._queued_promotion_keys():
            assert self.m.has_pending_work()

    def teardown(self) -> None:
        try:
            if self.manager is not None:
                self._drain_and_check()
        finally:
            if self.manager is not None:
                del self.rows
                self.manager.shutdown()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _drain_and_check(self) -> None:
        for ctx, keys in self.outstanding_loads:
            self.m.complete_load(keys, ctx)
        for ctx, keys in self.outstanding_stores:
            self.m.complete_store(keys, ctx, True)
        self.outstanding_loads.clear()
        self.outstanding_stores.clear()
        for ctx in self.active:
            self.m.on_request_finished(ctx)
        self.finished += self.active
        self.active = []
        self.step_end()  # submits the promotions still queued
        self.async_tier.drain_jobs()
        self.step_end()
        self.step_end()
        assert not self.recorder.in_flight
        assert self.m.num_jobs_in_flight == 0
        assert not self.m.has_pending_work()
        for key, block in self.primary.policy.items():
            assert block.ref_cnt == 0, f"key {key.hex()} still has ref_cnt {block.ref_cnt}"
        # Each finished request reached every tier exactly once.
        assert request_states(self.m) == {}
        for ctx in self.finished:
            for tier_type in ("example", "async_test"):
                assert self.recorder.finished_calls.get((tier_type, ctx.req_id)) == 1, (
                    f"{tier_type} got on_request_finished of {ctx.req_id} "
                    f"{self.recorder.finished_calls.get((tier_type, ctx.req_id), 0)} times"
                )


TieringMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTieringStateMachine = TieringMachine.TestCase
