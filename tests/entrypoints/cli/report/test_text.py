# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the report's text (report/text.py): 80 columns, paths, the disk line."""

from __future__ import annotations

import pytest

from vllm.entrypoints.cli.report.figures import (
    Direction,
    InstanceResult,
    Report,
    Tier,
    TransferFigures,
)
from vllm.entrypoints.cli.report.text import (
    WIDTH,
    format_bytes,
    render_header,
    render_report,
    show_path,
)
from vllm.entrypoints.cli.report.verdict import judge_report

from .sample_reports import huge_report, small_runs


def render_text(report: Report, home: str | None = None) -> str:
    """The whole text report as the command prints it at the end of a run."""
    return "\n".join(render_report(report, home))


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


def test_every_line_fits_80_columns() -> None:
    report = huge_report()
    text = render_text(report, home="/home/someone")
    assert WIDTH == 80
    for line in text.splitlines():
        assert len(line) <= WIDTH, line
    assert "fs tier:  up to 1023.0 TiB in ~/.cache/vllm-kv-offload" in text
    assert "GPU -> CPU (store)" in text and "9,999,999 failed, 9,999,999 already there" in text
    # Nothing was cut: every reason is there in full, wrapped.
    flat = " ".join(line.strip() for line in text.splitlines())
    for reason in judge_report(report).reasons:
        assert reason in flat


def test_a_path_longer_than_a_line_gets_a_line_of_its_own() -> None:
    report = huge_report()
    long_root = "/mnt/" + "x" * 90
    report.settings["fs_root"] = long_root
    lines = render_text(report).splitlines()
    assert f"    {long_root}" in lines
    assert all(len(line) <= WIDTH for line in lines if long_root not in line)


def test_show_path_abbreviates_home_only() -> None:
    assert show_path("/home/u/.cache/x", home="/home/u") == "~/.cache/x"
    assert show_path("/home/u", home="/home/u/") == "~"
    assert show_path("/home/user2/x", home="/home/u") == "/home/user2/x"
    assert show_path("/tmp/x", home="/") == "/tmp/x"


def test_disk_line_says_where_how_big_and_how_to_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
    report = huge_report()
    assert report.offload.fs is not None
    report.offload.fs.root_dir = "/home/u/.cache/vllm-kv-offload"
    report.offload.fs.bytes_at_end, report.offload.fs.files_at_end = 3 * 2**20, 48
    report.offload.fs.max_bytes = 2**30
    flat = " ".join(line.strip() for line in render_text(report, home="/home/u").splitlines())
    assert (
        "on disk: 3.0 MiB in 48 block files (up to 1.0 GiB) in ~/.cache/vllm-kv-offload; the "
        "next run starts warm from them. To delete them: vllm-kv-offload run --fs-clear"
    ) in flat
    report.offload.fs.root_dir = "/data/kv"
    flat = " ".join(line.strip() for line in render_text(report, home="/home/u").splitlines())
    assert "To delete them: vllm-kv-offload run --fs-root /data/kv --fs-clear" in flat


def test_each_instance_row_keeps_its_columns_apart_whatever_the_verdict() -> None:
    instances = []
    for index, verify_mode in enumerate(("loaded", "none")):  # PASS, then UNVERIFIED
        base, off = small_runs()
        off.verify_mode = verify_mode
        off.redis_url = "redis://127.0.0.1:6379"
        off.num_requests = off.num_finished = 9_999
        off.prompt_tokens = 9_876_543_210
        off.computed_tokens = off.served[Tier.REDIS] = 999_999_999
        off.cross_instance_tokens = 99_999_999
        instances.append(InstanceResult(index, base, off))
    base, off = small_runs()
    text = render_text(Report(settings={}, baseline=base, offload=off, instances=instances))
    lines = text.splitlines()
    start = lines.index("  per engine instance (offload run; verdict: its own checks and outputs)")
    header, *rows = lines[start + 1 : start + 4]
    assert header.split() == [
        "engine", "requests", "prompt", "tokens", "computed", "redis", "tier", "another's",
        "verdict",
    ]  # fmt: skip
    for row, verdict in zip(rows, ("PASS", "UNVERIFIED"), strict=True):
        assert len(row) <= WIDTH, row
        assert row.split()[-2:] == ["99,999,999", verdict], row


def test_a_fleet_without_redis_says_its_instances_share_nothing() -> None:
    settings = {"engines": 2, "fs_root": None, "redis_url": None, "cpu_bytes": 1, "block_bytes": 1}
    shared_nothing = "  shared tier: none (no --redis-url): instances reuse only their own KV"
    assert shared_nothing in render_header(settings, 10)
    with_redis = render_header({**settings, "redis_url": "redis://127.0.0.1:6379"}, 10)
    assert shared_nothing not in with_redis
    assert shared_nothing not in render_header({**settings, "engines": 1}, 10)


@pytest.mark.parametrize(
    ("served", "note"),
    [
        (
            3 * 2**20,
            "(fs -> CPU (promote): 3.0 MiB of it read by loads, 1.33x promoted per byte used)",
        ),
        (0, "(fs -> CPU (promote): none of it read by loads)"),
    ],
)
def test_promotions_say_how_much_of_them_loads_read(served: int, note: str) -> None:
    base, off = small_runs()
    off.transfers[Direction.FS_TO_CPU] = TransferFigures(
        blocks=4, bytes=4 * 2**20, busy_s=0.1, served_bytes=served
    )
    text = render_text(Report(settings={"workload": "mix"}, baseline=base, offload=off))
    assert note in " ".join(line.strip() for line in text.splitlines())
