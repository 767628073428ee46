# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the report's judgement (report/verdict.py): the verdict and why nothing was saved."""

from __future__ import annotations

from vllm.entrypoints.cli.report.figures import Direction, Report, Tier, TransferFigures
from vllm.entrypoints.cli.report.json_doc import report_json
from vllm.entrypoints.cli.report.verdict import (
    benefit_ratios,
    judge,
    judge_report,
    no_benefit_reason,
    no_savings_reason,
)

from .sample_reports import small_runs
from .test_text import render_text


def test_verdict_fails_on_mismatch_differing_outputs_and_corruption() -> None:
    base, off = small_runs()
    assert judge(base, off).passed
    off.corrupt_blocks_detected = 1
    v = judge(base, off)
    assert (v.passed, v.served_correctly, v.storage_intact) == (False, True, False)
    assert "corrupt" in v.reasons[0]
    off.corrupt_blocks_detected = 0
    off.outputs = {"a": (1, 9), "b": (3,)}
    v = judge(base, off)
    assert (v.passed, v.served_correctly) == (False, False)
    assert "a" in v.reasons[0]
    off.outputs = {"a": (1, 2)}
    assert not judge(base, off).served_correctly
    off.outputs = dict(base.outputs)
    off.blocks_mismatched = 2
    assert "2 loaded block(s)" in judge(base, off).reasons[0]


def test_a_run_that_saved_nothing_says_why() -> None:
    base, off = small_runs()
    settings = {"gpu_blocks": 256, "min_gpu_blocks": 20, "num_clients": 12}
    # Blocks were offloaded but never asked for again: the GPU pool held the working set.
    off.served.update({Tier.GPU: 200, Tier.CPU: 0, Tier.FS: 0})
    off.computed_tokens = base.computed_tokens
    off.transfers[Direction.GPU_TO_CPU] = TransferFigures(blocks=10, bytes=10)
    report = Report(settings=settings, baseline=base, offload=off)
    assert report.prefill_tokens_saved == 0
    reason = no_savings_reason(report)
    assert reason is not None
    assert "the GPU prefix cache held the whole working set" in reason
    assert reason.endswith("try --gpu-blocks 64")
    assert report_json(report)["comparison"]["no_savings_reason"] == reason
    flat = " ".join(line.strip() for line in render_text(report).splitlines())
    assert f"why: {reason}" in flat
    # A pool already at the smallest the workload allows: more clients instead.
    settings["gpu_blocks"] = 20
    assert str(no_savings_reason(report)).endswith("try --num-clients 24")
    settings["gpu_blocks"] = 40
    assert str(no_savings_reason(report)).endswith("try --gpu-blocks 20")
    # Nothing offloaded at all.
    off.transfers[Direction.GPU_TO_CPU] = TransferFigures()
    assert str(no_savings_reason(report)).startswith("nothing was offloaded")
    # The tiers served, but the baseline's GPU cache served more.
    off.transfers[Direction.GPU_TO_CPU] = TransferFigures(blocks=10, bytes=10)
    off.served.update({Tier.GPU: 100, Tier.CPU: 50, Tier.FS: 50})
    assert str(no_savings_reason(report)).startswith("the CPU and fs tiers served 100 tokens")
    # Savings: no reason, no line.
    off.computed_tokens -= 1
    off.served[Tier.CPU] += 1
    assert no_savings_reason(report) is None
    assert "why:" not in render_text(report)
    assert report_json(report)["comparison"]["no_savings_reason"] is None


def test_a_secondary_tier_that_failed_everything_fails_the_verdict() -> None:
    base, off = small_runs()
    report = Report(settings={}, baseline=base, offload=off)
    assert judge_report(report).tiers_working
    # Every store to the fs tier failed (e.g. its slot directory was broken): never a PASS.
    off.transfers[Direction.CPU_TO_FS] = TransferFigures(blocks=0, failed_blocks=591)
    v = judge_report(report)
    assert (v.passed, v.tiers_working, v.served_correctly, v.storage_intact) == (
        False,
        False,
        True,
        True,
    )
    assert v.reasons == (
        "the fs tier failed every store of the run (591 block(s), none stored): see its "
        "WARNING lines (-v for more)",
    )
    assert report_json(report)["verdict"]["tiers_working"] is False
    flat = " ".join(line.strip() for line in render_text(report).splitlines())
    assert "secondary tiers: FAIL" in flat and "verdict: FAIL" in flat
    # Some failures among successes are a tier at work (a corrupt file, a full disk for a while).
    off.transfers[Direction.CPU_TO_FS] = TransferFigures(blocks=1, failed_blocks=591)
    assert judge_report(report).passed
    # Where the tier counts its jobs (the fs tier), every job failed is the rule.
    off.transfers[Direction.CPU_TO_FS] = TransferFigures(
        blocks=0, failed_blocks=0, jobs=7, failed_jobs=7
    )
    assert judge_report(report).reasons == (
        "the fs tier failed every store of the run (7 job(s), none stored): see its WARNING "
        "lines (-v for more)",
    )
    off.transfers[Direction.CPU_TO_FS] = TransferFigures(blocks=5, jobs=7, failed_jobs=6)
    assert judge_report(report).passed
    # Every load from the redis tier failed.
    off.transfers[Direction.REDIS_TO_CPU] = TransferFigures(blocks=0, failed_blocks=3)
    assert judge_report(report).reasons[0].startswith("the redis tier failed every load")


def _timed_runs(base_ttft: float, off_ttft: float) -> Report:
    base, off = small_runs()
    base.ttft_ms, off.ttft_ms = [base_ttft] * 3, [off_ttft] * 3
    base.ttft_parts_ms = {"slot": [1.0], "lookup": [0.0], "loading": [0.0], "prefill": [9.0]}
    off.ttft_parts_ms = {"slot": [1.0], "lookup": [12.0], "loading": [2.0], "prefill": [3.0]}
    return Report(settings={"model": "transformer"}, baseline=base, offload=off)


def test_ratios_and_no_benefit_reason_name_the_part_that_grew() -> None:
    # The offloaded run is faster (wall 1.0 s vs 2.0 s) and its TTFT lower: no reason given.
    report = _timed_runs(10.0, 5.0)
    ratios = benefit_ratios(report)
    assert ratios["wall_time_ratio"] == 0.5 and ratios["ttft_median_ratio"] == 0.5
    assert ratios["ttft_p99_ratio"] == 0.5 and ratios["throughput_ratio"] == 2.0
    assert no_benefit_reason(report) is None
    # Slower TTFT: the lookups grew most (12 ms against 0), more than the 6 ms prefill saved.
    report = _timed_runs(10.0, 18.0)
    reason = no_benefit_reason(report)
    assert reason is not None
    assert reason.startswith(
        "TTFT median 1.80x the baseline's: waiting on the tiers (lookups, promotions"
    )
    assert "more than the 6.0 ms of prefill per request that the tiers saved" in reason
    doc = report_json(report)["comparison"]
    assert doc["no_benefit_reason"] == reason and doc["ttft_median_ratio"] == 1.8
    flat = " ".join(line.strip() for line in render_text(report).splitlines())
    assert f"offloading did not help: {reason}" in flat
    # A busy machine is named; a run that saved no prefill says so instead of a part.
    report.load_average = (9.0, 99.0)
    assert "the machine was busy (load average up to 99.00" in (no_benefit_reason(report) or "")
    report.offload.computed_tokens = report.baseline.computed_tokens
    assert "computed no fewer prompt tokens" in (no_benefit_reason(report) or "")


def test_no_benefit_reason_names_the_engine_threads_waits_that_grew() -> None:
    # Slower TTFT; the offload run's engine thread was blocked inside its steps 0.5 s (the
    # baseline's 0.1 s) and waited 0.3 s for a core (0.2 s): 5% of the baseline's 2 s wall is
    # 0.1 s, so only the first is named.
    report = _timed_runs(10.0, 18.0)
    base, off = report.baseline, report.offload
    base.engine_thread_blocked_s, off.engine_thread_blocked_s = 0.1, 0.5
    base.engine_thread_runqueue_wait_s, off.engine_thread_runqueue_wait_s = 0.2, 0.3
    reason = no_benefit_reason(report)
    assert reason is not None
    assert (
        "the offload run's engine thread was blocked inside its steps for 0.50 s against the "
        "baseline's 0.10 s (on the GIL while another thread held it, a lock or I/O)"
    ) in reason
    assert "for a core" not in reason
    off.engine_thread_runqueue_wait_s = 0.9
    reason = no_benefit_reason(report)
    assert reason is not None
    assert (
        "(on the GIL while another thread held it, a lock or I/O) and waited 0.90 s for a "
        "core against the baseline's 0.20 s" in reason
    )
    lines = render_text(report).splitlines()
    blocked = next(line for line in lines if "blocked in its steps" in line)
    assert blocked.split()[-4:] == ["0.10", "s", "0.50", "s"]
    # Where the kernel does not say (None), nothing is named.
    off.engine_thread_runqueue_wait_s = off.engine_thread_blocked_s = None
    reason = no_benefit_reason(report)
    assert reason is not None and "engine thread" not in reason
    text = render_text(report)
    assert "waiting for a core" not in text  # the section needs both runs' figures
