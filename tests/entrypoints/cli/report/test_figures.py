# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the report's data model (report/figures.py: its figures, a fleet's sums) and its JSON
document (json_doc.py)."""

from __future__ import annotations

import json

import pytest

from vllm.entrypoints.cli.report.figures import (
    Direction,
    Distribution,
    Report,
    RunResult,
    StepSample,
    Tier,
    TransferFigures,
    percentile,
)
from vllm.entrypoints.cli.report.json_doc import report_json

from .sample_reports import small_runs
from .test_text import render_text


def test_percentile_and_distribution() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    d = Distribution.of([3.0, 1.0, 2.0])
    assert (d.count, d.median, d.max, d.mean) == (3, 2.0, 3.0, 2.0)


def test_accounting_rates_and_comparison() -> None:
    base, off = small_runs()
    base.check_accounting()
    off.check_accounting()
    assert off.hit_rate(Tier.CPU) == pytest.approx(0.5)
    assert off.hit_rate(Tier.FS) == pytest.approx(0.25)
    assert off.share(None) == pytest.approx(0.3)
    report = Report(settings={"workload": "mix"}, baseline=base, offload=off)
    assert report.prefill_tokens_saved == 500
    doc = report_json(report)
    json.dumps(doc)  # serialisable as is
    assert doc["comparison"]["prefill_tokens_saved_fraction"] == pytest.approx(500 / 800)
    assert doc["comparison"]["outputs_identical"] is True
    assert doc["runs"]["offload"]["transfers"]["cpu_to_gpu"]["throughput_bytes_per_s"] == (
        pytest.approx(25 * 4096 / 0.5)
    )
    assert doc["runs"]["offload"]["fs_tier"]["warm_start"] is True
    assert doc["verdict"]["status"] == "PASS"
    text = render_text(report)
    assert "fs tier started WARM: 3 blocks" in text
    assert "prefill tokens saved vs baseline: 500" in text
    assert "verdict: PASS" in text


def test_broken_accounting_is_caught() -> None:
    _, off = small_runs()
    off.computed_tokens += 1
    with pytest.raises(AssertionError, match="offload run"):
        off.check_accounting()


def test_a_fleets_run_adds_up_its_instances_figures() -> None:
    a_base, a = small_runs()
    _, b = small_runs()
    a.wall_s, b.wall_s = 1.0, 3.0
    a.transfers[Direction.CPU_TO_FS] = TransferFigures(blocks=2, bytes=20, busy_s=None, jobs=1)
    b.transfers[Direction.CPU_TO_FS] = TransferFigures(blocks=3, bytes=30, busy_s=0.5)
    a.lookup_deferred_requests_by_tier, b.lookup_deferred_requests_by_tier = (
        {"fs": 1},
        {
            "fs": 2,
            "redis": 4,
        },
    )
    a.cross_instance_tokens, b.cross_instance_tokens = None, 7
    a.ttft_ms, b.ttft_ms = [1.0], [2.0, 3.0]
    a.samples = [StepSample(t_s=0.5, tokens={"computed": 10}, bytes_moved={})]
    b.samples = [StepSample(t_s=0.2, tokens={"computed": 5}, bytes_moved={"gpu_to_cpu": 1})]
    total = RunResult.sum_of("offload", True, [a, b])
    assert total.wall_s == 3.0  # the longest instance's
    assert total.prompt_tokens == a.prompt_tokens + b.prompt_tokens
    assert total.served[Tier.CPU] == a.served[Tier.CPU] + b.served[Tier.CPU]
    fs = total.transfers[Direction.CPU_TO_FS]
    assert (fs.blocks, fs.bytes, fs.busy_s, fs.jobs) == (5, 50, 0.5, 1)  # None: not known
    assert total.transfers[Direction.REDIS_TO_CPU].busy_s is None  # timed by neither
    assert total.lookup_deferred_requests_by_tier == {"fs": 3, "redis": 4}
    assert total.cross_instance_tokens == 7
    assert total.ttft_ms == [1.0, 2.0, 3.0]
    # One time axis; each merged sample adds every instance's latest cumulative counts.
    assert [(s.t_s, s.tokens["computed"]) for s in total.samples] == [(0.2, 5), (0.5, 15)]
    total.check_accounting()
    assert RunResult.sum_of("baseline", False, [a_base]).computed_tokens == a_base.computed_tokens
