# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the report's data model (report/figures.py) and its JSON document (json_doc.py)."""

from __future__ import annotations

import json

import pytest

from vllm.entrypoints.cli.report.figures import Distribution, Report, Tier, percentile
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
