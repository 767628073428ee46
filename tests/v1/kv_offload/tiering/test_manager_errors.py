# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``TieringOffloadingManager`` refuses bad calls and bad tier reports, changing nothing, and
accepts every call upstream vLLM's contract accepts (completions naming keys already stored).

Every component is real (a primary over a real shared region, the in-memory example tier);
``GatedTier`` only lets a test decide when the example tier's reports are handed over, and
lets it inject the reports a broken third-party tier would make.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.v1.kv_offload.cpu import manager_state as cpu_state
from tests.v1.kv_offload.tiering.gated_tier import GatedTier
from tests.v1.kv_offload.tiering.manager_state import (
    jobs_in_flight,
    promoting,
    queued_promotions,
    request_states,
)
from tests.v1.kv_offload.tiering.test_manager import make_primary, make_spec, to_keys
from vllm.v1.kv_offload.base import OffloadKey, OffloadKeyStateError, ReqContext
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    SecondaryTierReportError,
    TieringOffloadingManager,
)

A = ReqContext("req-a")
B = ReqContext("req-b")


@pytest.fixture
def setup(
    tmp_path: Path,
) -> Iterator[tuple[TieringOffloadingManager, CPUPrimaryTierOffloadingManager, list[GatedTier]]]:
    spec = make_spec(tmp_path, 8)
    primary = make_primary(tmp_path, 8)
    view = primary.get_kv_memoryview()
    tiers = [GatedTier(spec, view, f"t{i}") for i in range(2)]
    manager = TieringOffloadingManager(primary, tiers)
    for ctx in (A, B):
        manager.on_new_request(ctx)
    yield manager, primary, tiers
    manager.shutdown()


def snapshot(manager: TieringOffloadingManager) -> Any:
    """Everything a refused call must leave unchanged."""
    primary = manager.primary_tier
    owners = {ctx.req_id for ctx in (A, B)} | cpu_state.owners(primary)
    return (
        sorted((k, b.block_id, b.ref_cnt) for k, b in primary.policy.items()),
        {o: cpu_state.load_pins(primary, o) for o in owners},
        {o: cpu_state.pending_stores(primary, o) for o in owners},
        primary.num_free_blocks,
        manager.get_stats(),
        sorted(jobs_in_flight(manager)),
        promoting(manager),
        queued_promotions(manager),
        request_states(manager),
        [len(t.submitted) for t in manager.secondary_tiers if isinstance(t, GatedTier)],
    )


def end_step(manager: TieringOffloadingManager) -> None:
    """End the step and the next one: the second polls even if a call closed the gate."""
    manager.on_schedule_end()
    manager.on_schedule_end()


def deliver(tiers: list[GatedTier], on: bool) -> None:
    """Open (``on``) or close every tier's gate: a closed one keeps its job reports."""
    for tier in tiers:
        tier.deliver = on


def store(manager: TieringOffloadingManager, keys: list[OffloadKey], ctx: ReqContext) -> None:
    output = manager.prepare_store(keys, ctx)
    assert output is not None and output.keys_to_store == keys
    manager.complete_store(keys, ctx)


def promote(
    manager: TieringOffloadingManager, tiers: list[GatedTier], key: OffloadKey, ctx: ReqContext
) -> None:
    """Put ``key`` in the tiers only, then look it up: its row is reserved for a promotion."""
    store(manager, [key], ctx)
    manager.on_schedule_end()  # cascades reported
    manager.reset_cache()  # the primary forgets it, the tiers keep it
    deliver(tiers, False)
    assert manager.lookup(key, ctx) is None
    assert manager.promotion_source(key) == "t0"


# -- completions naming keys that are not pending (upstream: ignored) --------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("success", [True, False])
def test_already_stored_key_completed_with_the_new_keys(
    tmp_path: Path, policy: str, success: bool
) -> None:
    """Upstream vLLM's scenario through the tiering manager: 2 is stored (and cascaded), then
    filtered out of ``prepare_store([2, 3, 4, 5])`` and completed with the new keys."""
    region = SharedOffloadRegion(
        f"tiering-errors-{tmp_path.name}", 4, 64, directory=tmp_path, prefault=False
    )
    primary = CPUPrimaryTierOffloadingManager(4, region, cache_policy=policy)
    tiers = [GatedTier(make_spec(tmp_path, 4), primary.get_kv_memoryview(), "t0")]
    manager = TieringOffloadingManager(primary, tiers)
    try:
        k1, k2, k3, k4, k5 = to_keys([1, 2, 3, 4, 5])
        store(manager, [k1, k2], A)
        end_step(manager)  # the cascade of 1 and 2 is reported
        output = manager.prepare_store([k2, k3, k4, k5], A)
        assert output is not None and output.keys_to_store == [k3, k4, k5]
        manager.complete_store([k2, k3, k4, k5], A, success=success)
        if success:
            assert [manager.lookup(k, A) for k in (k2, k3, k4, k5)] == [True] * 4
            assert [tuple(j.keys) for j in tiers[0].submitted] == [(k1, k2), (k3, k4, k5)]
        else:
            assert [manager.lookup(k, A) for k in (k2, k3, k4, k5)] == [True, False, False, False]
            assert primary.num_free_blocks == 3, "the new blocks' rows are free again"
            assert len(tiers[0].submitted) == 1
        end_step(manager)
        assert not manager.has_pending_work()
        assert cpu_state.pending_stores(primary, "req-a") == []
        cpu_state.check_invariants(primary)
    finally:
        manager.shutdown()


@pytest.mark.parametrize("success", [True, False])
def test_complete_store_ignores_a_key_being_promoted(setup: Any, success: bool) -> None:
    """A key being promoted was stored before: for the caller it is already stored, so
    ``complete_store`` ignores it (upstream's contract) and its row stays the promotion's."""
    manager, primary, tiers = setup
    k6, k0 = to_keys([6, 0])
    promote(manager, tiers, k0, A)
    output = manager.prepare_store([k6, k0], A)
    assert output is not None and output.keys_to_store == [k6]
    manager.complete_store([k6, k0], A, success=success)
    assert manager.lookup(k0, A) is None  # still unreadable until its load is reported
    assert manager.lookup(k6, A) is success
    assert cpu_state.pending_stores(primary, "req-a") == []
    # The promotion finishes when the tier reports.
    deliver(tiers, True)
    manager.on_schedule_end()  # submits the load
    manager.on_schedule_end()  # polls its report
    assert manager.lookup(k0, A) is True
    # Only the key this call made readable was cascaded.
    cascaded = [tuple(j.keys) for t in tiers for j in t.submitted if not j.is_promotion]
    assert cascaded.count((k6,)) == (2 if success else 0)
    cpu_state.check_invariants(primary)


@pytest.mark.parametrize("success", [True, False])
def test_complete_store_ignores_never_prepared_keys(setup: Any, success: bool) -> None:
    manager, _, tiers = setup
    (k1, k2) = to_keys([1, 2])
    before = snapshot(manager)
    for ctx in (A, B, ReqContext("never-seen")):
        manager.complete_store([k1, k2], ctx, success=success)
        assert snapshot(manager) == before
    assert not any(tier.submitted for tier in tiers)


def test_complete_store_of_another_requests_pending_key_is_refused(setup: Any) -> None:
    manager, _, tiers = setup
    (k1, k2) = to_keys([1, 2])
    manager.prepare_store([k1], A)
    manager.prepare_store([k2], B)
    before = snapshot(manager)
    for ctx, keys in ((B, [k2, k1]), (ReqContext("never-seen"), [k1])):
        with pytest.raises(
            OffloadKeyStateError, match=rf"complete_store: key {k1.hex()} .*pending for.*'req-a'"
        ):
            manager.complete_store(keys, ctx)
        assert snapshot(manager) == before
    assert not any(tier.submitted for tier in tiers)


@pytest.mark.parametrize("success", [True, False])
def test_complete_store_twice_is_ignored(setup: Any, success: bool) -> None:
    """Also while the first completion's cascades still pin the block."""
    manager, primary, tiers = setup
    (k1,) = to_keys([1])
    deliver(tiers, False)
    store(manager, [k1], A)
    assert primary.policy.get(k1).ref_cnt == 2  # the two cascades' pins
    before = snapshot(manager)
    manager.complete_store([k1], A, success=success)
    assert snapshot(manager) == before
    assert [len(t.submitted) for t in tiers] == [1, 1]
    deliver(tiers, True)
    end_step(manager)
    assert primary.policy.get(k1).ref_cnt == 0
    manager.complete_store([k1], A, success=success)  # and after they were reported
    assert manager.lookup(k1, B) is True
    assert [len(t.submitted) for t in tiers] == [1, 1]


def test_complete_load_cannot_release_a_cascade_pin(setup: Any) -> None:
    """Reader A's duplicate complete_load would have released A's own cascade's pin."""
    manager, primary, tiers = setup
    (k1,) = to_keys([1])
    deliver(tiers, False)
    store(manager, [k1], A)  # two cascades in flight pin k1 twice
    assert primary.policy.get(k1).ref_cnt == 2
    manager.prepare_load([k1], A)
    manager.prepare_load([k1], B)
    manager.complete_load([k1], A)
    before = snapshot(manager)
    with pytest.raises(OffloadKeyStateError, match=rf"complete_load: key {k1.hex()}.*'req-a'"):
        manager.complete_load([k1], A)
    assert snapshot(manager) == before
    assert primary.policy.get(k1).ref_cnt == 3  # B's pin and the two cascades'
    manager.complete_load([k1], B)
    deliver(tiers, True)
    end_step(manager)
    assert primary.policy.get(k1).ref_cnt == 0
    cpu_state.check_invariants(primary)


def test_partial_completions_of_one_store(setup: Any) -> None:
    """The engine may complete one prepare_store in parts; tiers hear of the finish last."""
    manager, primary, tiers = setup
    k1, k2, k3 = to_keys([1, 2, 3])
    output = manager.prepare_store([k1, k2, k3], A)
    assert output is not None
    manager.complete_store([k2], A)
    manager.on_request_finished(A)
    assert all("req-a" not in tier.finished_requests for tier in tiers)
    manager.complete_store([k3, k1], A)
    assert all(tier.finished_requests == ["req-a"] for tier in tiers)
    assert [[tuple(j.keys) for j in t.submitted] for t in tiers] == [[(k2,), (k3, k1)]] * 2
    manager.on_schedule_end()
    assert [manager.lookup(k, B) for k in (k1, k2, k3)] == [True] * 3
    assert request_states(manager) == {}
    cpu_state.check_invariants(primary)


def test_duplicate_keys_in_complete_store_cascade_once(setup: Any) -> None:
    manager, primary, tiers = setup
    k1, k2 = to_keys([1, 2])
    manager.prepare_store([k1, k2], A)
    deliver(tiers, False)
    manager.complete_store([k1, k1, k2], A)
    assert [tuple(t.submitted[0].keys) for t in tiers] == [(k1, k2)] * 2
    assert primary.policy.get(k1).ref_cnt == 2


# -- values that are not keys, calls after shutdown --------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.prepare_store(["abc"], A),
        lambda m: m.prepare_store([1, 2], A),
        lambda m: m.prepare_store(to_keys([1])[0], A),
        lambda m: m.prepare_load([1], A),
        lambda m: m.lookup(12345, A),
        lambda m: m.lookup_prefix([*to_keys([1, 2]), 3], A),
        lambda m: m.lookup_prefix(to_keys([1])[0], A),
    ],
)
def test_not_keys_raise_type_error_before_polling(setup: Any, call: Any) -> None:
    manager, _, tiers = setup
    (k1,) = to_keys([1])
    deliver(tiers, False)
    store(manager, [k1], A)
    manager.on_schedule_end()  # the next gated call polls
    deliver(tiers, True)
    polls = [tier.polls for tier in tiers]
    before = snapshot(manager)
    with pytest.raises(TypeError, match=r"OffloadKey.*req-a"):
        call(manager)
    assert [tier.polls for tier in tiers] == polls
    assert snapshot(manager) == before


@pytest.mark.parametrize(
    "method, args",
    [
        ("lookup", (to_keys([1])[0], A)),
        ("lookup_prefix", (to_keys([1]), A)),
        ("prepare_store", (to_keys([1]), A)),
        ("prepare_load", (to_keys([1]), A)),
        ("complete_store", (to_keys([1]), A)),
        ("complete_load", (to_keys([1]), A)),
        ("touch", (to_keys([1]), A)),
        ("on_new_request", (A,)),
        ("on_request_finished", (A,)),
        ("on_schedule_end", ()),
        ("reset_cache", ()),
    ],
)
def test_calls_after_shutdown_raise(setup: Any, method: str, args: tuple[Any, ...]) -> None:
    manager, _, tiers = setup
    manager.shutdown()
    polls = [tier.polls for tier in tiers]
    with pytest.raises(RuntimeError, match=rf"TieringOffloadingManager\.{method}: .*shut down"):
        getattr(manager, method)(*args)
    assert [tier.polls for tier in tiers] == polls
    assert not manager.has_pending_work()
    list(manager.take_events())
    manager.get_stats()


# -- tiers that break the job contract ----------------------------------------------------------


def test_bad_reports_are_errors_and_valid_ones_are_applied(setup: Any) -> None:
    manager, primary, tiers = setup
    k1, k2 = to_keys([1, 2])
    deliver(tiers, False)
    store(manager, [k1, k2], A)
    job0, job1 = tiers[0].submitted[0], tiers[1].submitted[0]
    tiers[0].extra = [
        JobResult(9999, True),  # never submitted
        JobResult(job1.job_id, True),  # tier 1's job
        JobResult(job0.job_id, True),  # reported twice in this poll (once by the example tier)
    ]
    tiers[0].deliver = True
    manager.on_schedule_end()  # prepare_store polled this step already
    with pytest.raises(SecondaryTierReportError) as info:
        manager.on_schedule_end()
    problems = info.value.problems
    assert len(problems) == 3
    assert "tier #0 (t0) reported unknown job 9999" in problems[0]
    assert f"reported job {job1.job_id} (cascade of keys {k1.hex()}, {k2.hex()}" in problems[1]
    assert "submitted to tier #1 (t1)" in problems[1]
    assert f"unknown job {job0.job_id}" in problems[2]
    # Tier 0's real report was applied; tier 1's job stays in flight, its pin held.
    assert sorted(jobs_in_flight(manager)) == [job1.job_id]
    assert primary.policy.get(k1).ref_cnt == 1
    tiers[1].deliver = True
    manager.on_schedule_end()
    assert primary.policy.get(k1).ref_cnt == 0 and not manager.has_pending_work()
    cpu_state.check_invariants(primary)


def test_a_bad_report_does_not_stop_the_step(setup: Any) -> None:
    """on_schedule_end still ends the step (tier hooks); a lookup's poll raises from lookup."""
    manager, primary, tiers = setup
    (k0,) = to_keys([0])
    ends = [0, 0]
    for i, tier in enumerate(tiers):
        tier.on_schedule_end = lambda i=i: ends.__setitem__(i, ends[i] + 1)  # type: ignore[method-assign]
    tiers[0].extra = [JobResult(4242, False)]
    with pytest.raises(SecondaryTierReportError, match="unknown job 4242"):
        manager.on_schedule_end()
    assert ends == [1, 1]
    tiers[1].extra = [JobResult(4343, True)]
    with pytest.raises(SecondaryTierReportError, match=r"tier #1 \(t1\) reported unknown job 4343"):
        manager.lookup(k0, A)
    assert manager.lookup(k0, A) is False  # polled once this step: the error is not repeated
    manager.on_schedule_end()
    assert ends == [2, 2]
    cpu_state.check_invariants(primary)


def test_reset_cache_with_an_unreported_job_resets_nothing(setup: Any) -> None:
    manager, primary, tiers = setup
    (k1,) = to_keys([1])
    tiers[1].deliver = False  # a tier whose drain_jobs() returns with a job unreported
    store(manager, [k1], A)
    end_step(manager)
    before = snapshot(manager)
    with pytest.raises(SecondaryTierReportError, match=r"job \d+ on tier #1 \(t1\), key"):
        manager.reset_cache()
    assert snapshot(manager) == before
    assert primary.policy.get(k1).ref_cnt == 1  # the tier may still read the row


def test_rows_named_in_snapshot_are_real(setup: Any) -> None:
    """The snapshot sees pins and reservations (a guard against a vacuous comparison)."""
    manager, primary, _ = setup
    (k1,) = to_keys([1])
    before = snapshot(manager)
    manager.prepare_store([k1], A)
    assert snapshot(manager) != before
    assert np.asarray(primary.get_kv_memoryview()).shape[0] == 8
