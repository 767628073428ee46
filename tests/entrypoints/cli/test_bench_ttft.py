# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload bench ttft`` on small sizes with the tiny transformer: every hit is a hit
(its tier served the prompt), its TTFT split into parts that add up, the table and the JSON
rows agree, the fs files were dropped from the page cache, and a real redis server serves the
redis rows."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.entrypoints.cli.bench_ttft import parse_sizes
from vllm.entrypoints.cli.main import main

SMALL = ["bench", "ttft", "--sizes", "64,256", "--reps", "2", "--model-preset", "tiny"]


def _bench(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "ttft.json"
    code = main([*SMALL, "--fs-root", str(tmp_path / "fs"), "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def _check_rows(doc: dict[str, Any], modes: set[str]) -> None:
    rows = {(r["tokens"], r["mode"]): r for r in doc["rows"]}
    assert set(rows) == {(n, m) for n in (64, 256) for m in modes}
    for (n, mode), row in rows.items():
        assert row["misses"] == 0, row
        assert len(row["ttft_ms"]) == 2 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        # The hit is a hit: its tier served all but the last block of the prompt (the last
        # token is always computed).
        assert all(n - 16 <= s <= n for s in row["served_tokens"]), row
        for ttft, parts in zip(row["ttft_ms"], row["ttft_parts_ms"], strict=True):
            assert set(parts) == {"slot", "lookup", "loading", "prefill"}
            assert all(v >= 0 for v in parts.values())
            # Measured from add_request by the bench, from the request's creation by the engine.
            assert sum(parts.values()) <= ttft * 1.01 + 0.01
            assert (parts["loading"] > 0) is (mode != "recompute")
        base = rows[(n, "recompute")]["median_ms"]
        assert row["ratio_to_recompute"] == pytest.approx(row["median_ms"] / base)


def test_bench_ttft_measures_recompute_cpu_and_fs_hits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = _bench(tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    _check_rows(doc, {"recompute", "cpu", "fs"})
    assert doc["settings"]["model"] == "transformer" and doc["settings"]["redis"] is False
    assert doc["page_cache"]["files"] > 0 and doc["page_cache"]["failed"] == 0
    assert "files dropped from the page cache" in " ".join(out.split())
    lines = out.splitlines()
    head = lines.index(
        next(line for line in lines if line.split() == ["tokens", "recompute", "cpu", "fs"])
    )
    assert lines[head + 1].split()[0] == "64" and lines[head + 2].split()[0] == "256"
    cpu = next(r for r in doc["rows"] if r["tokens"] == 256 and r["mode"] == "cpu")
    assert f"{cpu['median_ms']:.1f} ms {cpu['ratio_to_recompute']:.2f}x" in lines[head + 2]


def test_bench_ttft_with_redis_measures_redis_hits(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    try:
        code, doc = _bench(tmp_path, "--redis-url", server.url)
    finally:
        server.stop()
    assert code == 0
    _check_rows(doc, {"recompute", "cpu", "fs", "redis"})


def test_bench_ttft_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    plot = tmp_path / "ttft.png"
    code, _ = _bench(tmp_path, "--plot", str(plot))
    assert code == 0 and plot.stat().st_size > 1000


def test_sizes_are_checked() -> None:
    assert parse_sizes("2048,512,512") == (512, 2048)
    for bad in ("", "12", "a,b", "512,-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_sizes(bad)
