# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the report model (report.py) and its text (report_text.py)."""

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
    judge,
    percentile,
)
from vllm.entrypoints.cli.report_text import WIDTH, format_bytes, show_path


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


def _huge_report() -> Report:
    # The widest figures a run can produce: 10-digit counts, TiB, long request ids and reasons.
    base, off = _runs()
    for run in (base, off):
        run.prompt_tokens = 9_876_543_210
        run.computed_tokens = 1_234_567_890
        run.output_tokens = run.steps = run.preemptions = 9_999_999_999
        run.ttft_ms = [123456.0, 999999.0]
        run.overhead_us = run.worker_overhead_us = [9_999_999.0]
        run.wall_s = 99999.9
    for d in Direction:
        off.transfers[d] = TransferFigures(
            blocks=999_999_999,
            bytes=1023 * 2**40,
            busy_s=99999.99,
            failed_blocks=9_999_999,
            skipped_blocks=9_999_999,
        )
    off.blocks_mismatched = off.blocks_verified = 999_999_999
    off.corrupt_blocks_detected = 9_999_999
    off.outputs = {f"s{i:04d}-system-prompt-t{i}": (i,) for i in range(10)}
    off.fs = FsTierState(
        root_dir="/home/someone/.cache/vllm-kv-offload",
        max_bytes=1023 * 2**40,
        files_at_start=9_999_999_999,
        bytes_at_start=1023 * 2**40,
        files_at_end=9_999_999_999,
        bytes_at_end=1023 * 2**40,
    )
    settings = {
        "workload": "system-prompt",
        "seed": 2**31,
        "num_clients": 100_000,
        "device": "cuda",
        "num_layers": 128,
        "num_kv_heads": 128,
        "head_size": 256,
        "dtype": "bfloat16",
        "gpu_blocks": 10_000_000,
        "block_size": 256,
        "block_bytes": 2**33,
        "cpu_bytes": 1023 * 2**40,
        "eviction_policy": "arc",
        "fs_root": "/home/someone/.cache/vllm-kv-offload",
        "fs_max_bytes": 1023 * 2**40,
    }
    return Report(settings=settings, baseline=base, offload=off)


def test_every_line_fits_80_columns() -> None:
    report = _huge_report()
    text = report.render(home="/home/someone")
    assert WIDTH == 80
    for line in text.splitlines():
        assert len(line) <= WIDTH, line
    assert "fs tier:  up to 1023.0 TiB in ~/.cache/vllm-kv-offload" in text
    assert "GPU -> CPU (store)" in text and "9,999,999 failed, 9,999,999 already there" in text
    # Nothing was cut: every reason is there in full, wrapped.
    flat = " ".join(line.strip() for line in text.splitlines())
    for reason in report.verdict.reasons:
        assert reason in flat


def test_a_path_longer_than_a_line_gets_a_line_of_its_own() -> None:
    report = _huge_report()
    long_root = "/mnt/" + "x" * 90
    report.settings["fs_root"] = long_root
    lines = report.render().splitlines()
    assert f"    {long_root}" in lines
    assert all(len(line) <= WIDTH for line in lines if long_root not in line)


def test_show_path_abbreviates_home_only() -> None:
    assert show_path("/home/u/.cache/x", home="/home/u") == "~/.cache/x"
    assert show_path("/home/u", home="/home/u/") == "~"
    assert show_path("/home/user2/x", home="/home/u") == "/home/user2/x"
    assert show_path("/tmp/x", home="/") == "/tmp/x"


def test_disk_line_says_where_how_big_and_how_to_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
    report = _huge_report()
    assert report.offload.fs is not None
    report.offload.fs.root_dir = "/home/u/.cache/vllm-kv-offload"
    report.offload.fs.bytes_at_end, report.offload.fs.files_at_end = 3 * 2**20, 48
    report.offload.fs.max_bytes = 2**30
    flat = " ".join(line.strip() for line in report.render(home="/home/u").splitlines())
    assert (
        "on disk: 3.0 MiB in 48 block files (up to 1.0 GiB) in ~/.cache/vllm-kv-offload; the "
        "next run starts warm from them. To delete them: vllm-kv-offload run --fs-clear"
    ) in flat
    report.offload.fs.root_dir = "/data/kv"
    flat = " ".join(line.strip() for line in report.render(home="/home/u").splitlines())
    assert "To delete them: vllm-kv-offload run --fs-root /data/kv --fs-clear" in flat


def test_a_run_that_saved_nothing_says_why() -> None:
    base, off = _runs()
    settings = {"gpu_blocks": 256, "min_gpu_blocks": 20, "num_clients": 12}
    # Blocks were offloaded but never asked for again: the GPU pool held the working set.
    off.served.update({Tier.GPU: 200, Tier.CPU: 0, Tier.FS: 0})
    off.computed_tokens = base.computed_tokens
    off.transfers[Direction.GPU_TO_CPU] = TransferFigures(blocks=10, bytes=10)
    report = Report(settings=settings, baseline=base, offload=off)
    assert report.prefill_tokens_saved == 0
    reason = report.no_savings_reason
    assert reason is not None
    assert "the GPU prefix cache held the whole working set" in reason
    assert reason.endswith("try --gpu-blocks 64")
    assert report.to_json()["comparison"]["no_savings_reason"] == reason
    flat = " ".join(line.strip() for line in report.render().splitlines())
    assert f"why: {reason}" in flat
    # A pool already at the smallest the workload allows: more clients instead.
    settings["gpu_blocks"] = 20
    assert str(report.no_savings_reason).endswith("try --num-clients 24")
    settings["gpu_blocks"] = 40
    assert str(report.no_savings_reason).endswith("try --gpu-blocks 20")
    # Nothing offloaded at all.
    off.transfers[Direction.GPU_TO_CPU] = TransferFigures()
    assert str(report.no_savings_reason).startswith("nothing was offloaded")
    # The tiers served, but the baseline's GPU cache served more.
    off.transfers[Direction.GPU_TO_CPU] = TransferFigures(blocks=10, bytes=10)
    off.served.update({Tier.GPU: 100, Tier.CPU: 50, Tier.FS: 50})
    assert str(report.no_savings_reason).startswith("the CPU and fs tiers served 100 tokens")
    # Savings: no reason, no line.
    off.computed_tokens -= 1
    off.served[Tier.CPU] += 1
    assert report.no_savings_reason is None
    assert "why:" not in report.render()
    assert report.to_json()["comparison"]["no_savings_reason"] is None
