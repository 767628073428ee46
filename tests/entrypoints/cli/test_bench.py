# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``vllm-kv-offload bench`` against small stand-in benchmark scripts.

The real benchmarks take minutes; the stand-ins here are real scripts run the same way (a child
process with --quick), so the runner's discovery, JSON collection, line fallback, failure and
missing-benchmark handling are exercised without the cost.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from vllm.entrypoints.cli.main import main

_WITH_JSON = textwrap.dedent(
    """
    import argparse, json
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    print("manager bench quick" if a.quick else "manager bench full")
    if a.json:
        json.dump({"cases": [{"name": "lookup", "ratio": 1.25, "ops": 10}],
                   "store_ratio_vs_baseline": 0.9}, open(a.json, "w"))
    """
)
# No --quick and no --json: quick mode passes the reduced sizes, ratios come from the output.
_LINES_ONLY = textwrap.dedent(
    """
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--job-mib", type=int, default=128)
    a = p.parse_args()
    print(f"reps={a.reps} job_mib={a.job_mib}")
    print("copy 2 MiB: 10.0 GB/s, ratio to torch baseline 0.97")
    print("unrelated line")
    """
)
_FAILING = "import sys\nprint('boom')\nsys.exit(3)\n"


def _bench_dir(tmp_path: Path, scripts: dict[str, str]) -> Path:
    for name, body in scripts.items():
        (tmp_path / f"bench_{name}.py").write_text(body)
    return tmp_path


def test_bench_collects_ratios_and_skips_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _bench_dir(tmp_path, {"manager": _WITH_JSON, "copy": _LINES_ONLY})
    assert main(["bench", "--bench-dir", str(d)]) == 0
    out = capsys.readouterr().out
    assert "manager bench quick" in out
    assert "cases[name=lookup,ops=10].ratio: 1.250" in out
    assert "reps=5 job_mib=32" in out
    assert "store_ratio_vs_baseline: 0.900" in out
    assert "ratio to torch baseline 0.97" in out
    assert "unrelated line" in out.split("=== summary")[0]
    assert "unrelated line" not in out.split("=== summary")[1]
    assert f"fs       skipped ({d / 'bench_fs.py'} not found)" in out


def test_bench_full_and_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _bench_dir(tmp_path, {"manager": _WITH_JSON, "copy": _LINES_ONLY})
    assert main(["bench", "--bench-dir", str(d), "--only", "manager", "--full"]) == 0
    out = capsys.readouterr().out
    assert "manager bench full" in out
    assert "=== bench copy" not in out
    assert main(["bench", "--bench-dir", str(d), "--only", "copy", "--full"]) == 0
    assert "reps=50 job_mib=128" in capsys.readouterr().out


def test_bench_failure_sets_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = _bench_dir(tmp_path, {"manager": _WITH_JSON, "fs": _FAILING})
    assert main(["bench", "--bench-dir", str(d)]) == 1
    out = capsys.readouterr().out
    assert "boom" in out
    assert "fs       failed (exit code 3)" in out


def test_bench_with_no_benchmark_at_all(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--bench-dir", str(tmp_path)]) == 1
    assert "no benchmark found" in capsys.readouterr().err


_COPY_JSON = textwrap.dedent(
    """
    import argparse, json
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    a = p.parse_args()
    rows = [
        {"path": "torch", "direction": "h2d", "block_kib": 64, "ratio": 0.537},
        {"path": "torch", "direction": "h2d", "block_kib": 256, "ratio": 0.912},
        {"path": "torch", "direction": "d2h", "block_kib": 1024, "ratio": 0.61},
    ]
    json.dump(rows, open(a.json, "w"))
    """
)


def test_bench_summary_says_what_each_ratio_means_and_its_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = _bench_dir(tmp_path, {"copy": _COPY_JSON})
    assert main(["bench", "--bench-dir", str(d), "--only", "copy"]) == 0
    summary = capsys.readouterr().out.split("=== summary")[1]
    assert (
        "ratio = GB/s of one job of scattered blocks / GB/s of one contiguous copy of the same "
        "bytes; higher is better; target: >= 0.8 on the torch path for blocks >= 256 KiB"
    ) in summary
    assert "[path=torch,direction=h2d,block_kib=64].ratio: 0.537 (no target for this row)" in (
        summary
    )
    assert "block_kib=256].ratio: 0.912 (meets the target)" in summary
    assert "block_kib=1024].ratio: 0.610 (MISSES the target)" in summary
