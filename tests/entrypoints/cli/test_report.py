"""Tests of the report model and its rendering in vllm/entrypoints/cli/report.py."""

from __future__ import annotations

import json

import pytest

from vllm.entrypoints.cli.report import (
    Direction,
    Distribution,
    FsTierState,
    Report,
    RunResult,
    Tier,
    TransferFigures,
    format_bytes,
    judge,
    percentile,
)


def _runs() -> tuple[RunResult, RunResult]:
    base = RunResult(label="baseline", offload=False, wall_s=2.0, num_requests=2, num_finished=2)
    base.prompt_tokens = 1000
    base.computed_tokens = 800
    base.served[Tier.GPU] = 200
    base.lookup_tokens[Tier.GPU] = 1000
    base.outputs = {"a": (1, 2), "b": (3,)}
    off = RunResult(label="offload", offload=True, wall_s=1.0, num_requests=2, num_finished=2)
    off.prompt_tokens = 1000
    off.computed_tokens = 300
    off.served.update({Tier.GPU: 200, Tier.CPU: 400, Tier.FS: 100})
    off.lookup_tokens.update({Tier.GPU: 1000, Tier.CPU: 800, Tier.FS: 400})
    off.transfers[Direction.CPU_TO_GPU] = TransferFigures(blocks=25, bytes=25 * 4096, busy_s=0.5)
    off.blocks_verified = 25
    off.outputs = {"a": (1, 2), "b": (3,)}
    off.fs = FsTierState(root_dir="/tmp/x", max_bytes=2**30, files_at_start=3, bytes_at_start=99)
    return base, off


def test_percentile_and_distribution() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    d = Distribution.of([3.0, 1.0, 2.0])
    assert (d.count, d.median, d.max, d.mean) == (3, 2.0, 3.0, 2.0)


def test_accounting_rates_and_comparison() -> None:
    base, off = _runs()
    base.check_accounting()
    off.check_accounting()
    assert off.hit_rate(Tier.CPU) == pytest.approx(0.5)
    assert off.hit_rate(Tier.FS) == pytest.approx(0.25)
    assert off.share(None) == pytest.approx(0.3)
    report = Report(settings={"workload": "mix"}, baseline=base, offload=off)
    assert report.prefill_tokens_saved == 500
    doc = report.to_json()
    json.dumps(doc)  # serialisable as is
    assert doc["comparison"]["prefill_tokens_saved_fraction"] == pytest.approx(500 / 800)
    assert doc["comparison"]["outputs_identical"] is True
    assert doc["runs"]["offload"]["transfers"]["cpu_to_gpu"]["throughput_bytes_per_s"] == (
        pytest.approx(25 * 4096 / 0.5)
    )
    assert doc["runs"]["offload"]["fs_tier"]["warm_start"] is True
    assert doc["verdict"]["status"] == "PASS"
    text = report.render()
    assert "fs tier started WARM: 3 blocks" in text
    assert "prefill tokens saved vs baseline: 500" in text
    assert "verdict: PASS" in text


def test_broken_accounting_is_caught() -> None:
    _, off = _runs()
    off.computed_tokens += 1
    with pytest.raises(AssertionError, match="offload run"):
        off.check_accounting()


def test_verdict_fails_on_mismatch_differing_outputs_and_corruption() -> None:
    base, off = _runs()
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


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
