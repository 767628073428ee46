# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run`` end to end on tiny workloads, through the real engine and tiers.

Each run serves a seeded workload twice (baseline, then with the CPU and fs tiers) through the
asyncio front end; the tests cross-check the report's figures against each other, against a
second (warm) run over the same fs root, and against a block deliberately corrupted on disk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.subprocesses import run_python
from vllm.distributed.kv_events import KVEventBatch
from vllm.entrypoints.cli.clients import serve_workload
from vllm.entrypoints.cli.config import RunConfig, build_run_config
from vllm.entrypoints.cli.engine_run import EngineRun
from vllm.entrypoints.cli.main import build_parser, main
from vllm.entrypoints.cli.run import engine_generate
from vllm.entrypoints.cli.workloads import generate_workload
from vllm.v1.core.kv_cache_utils import NONE_HASH, hash_block_tokens

from .workload_args import TINY_WORKLOAD

# One client sends its sessions one after another, so the GPU pool's contents, and thus the
# baseline's figures, are deterministic.
TINY = [
    *TINY_WORKLOAD,
    "--num-clients",
    "1",
    "--num-sessions",
    "10",
    "--think-time",
    "0.001",
    "--block-size",
    "16",
    "--no-progress",
    "--timeout",
    "120",
]
# Concurrent clients and every session kind (used where only the outcome is checked).
TINY_MIX = [
    *TINY,
    "--workload",
    "mix",
    "--num-clients",
    "3",
    "--num-sessions",
    "9",
    "--document-tokens",
    "128",
    "--system-prompt-tokens",
    "64",
]

_NUM = (int, float)


def _flat(text: str) -> str:
    # The report wraps its prose at 80 columns: match sentences across line breaks.
    return " ".join(line.strip() for line in text.splitlines())


def run_tiny(tmp_path: Path, name: str, *extra: str) -> tuple[int, dict[str, Any]]:
    """Run TINY over ``tmp_path/fs``; the exit code and the JSON report."""
    out = tmp_path / f"{name}.json"
    code = main([*TINY, "--fs-root", str(tmp_path / "fs"), "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def _check_dist(d: dict[str, Any]) -> None:
    assert set(d) == {"count", "median", "p99", "mean", "max"}
    assert all(isinstance(v, _NUM) for v in d.values())
    assert d["median"] <= d["p99"] <= d["max"]


def _check_run_schema(run: dict[str, Any], offload: bool) -> None:
    assert set(run) == {
        "label",
        "offload",
        "wall_s",
        "verify_s",
        "engine_thread_cpu_s",
        "engine_thread_idle_s",
        "engine_thread_runqueue_wait_s",
        "engine_thread_blocked_s",
        "cpu_s_by_component",
        "verify_cpu_s",
        "requests_per_s",
        "prompt_tokens_per_s",
        "outputs_digest",
        "requests",
        "prompt_tokens",
        "hit_rate",
        "share",
        "output_tokens",
        "steps",
        "preemptions",
        "overhead_us_per_step",
        "worker_overhead_us_per_step",
        "ttft_ms",
        "ttft_parts_ms",
        "latency_ms",
        "transfers",
        "verification",
        "fs_tier",
        "redis_url",
        "redis_down",
        "cross_instance_tokens",
        "load_guard",
        "samples",
    } | (
        {
            "connector_thread_cpu_us",
            "worker_connector_thread_cpu_us",
            "lookup_deferred_requests",
            "lookup_deferred_requests_by_tier",
            "transfer_wait_requests",
        }
        if offload
        else set()
    )
    assert run["offload"] is offload
    assert run["load_guard"] is None  # never on for the hash model nor without offloading
    assert run["engine_thread_cpu_s"] > 0 and run["verify_s"] >= 0
    # The engine thread's window in parts: on a core, idle, waiting for a core, blocked. The
    # window opens before the first request and closes after the last output, so it holds the
    # clients' wall time.
    parts = [run["engine_thread_cpu_s"], run["engine_thread_idle_s"]]
    if sys.platform == "linux":
        parts += [run["engine_thread_runqueue_wait_s"], run["engine_thread_blocked_s"]]
        assert sum(parts) >= run["wall_s"] * 0.99
    assert all(isinstance(p, _NUM) and p >= 0 for p in parts)
    assert len(run["outputs_digest"]) == 64 and run["verification"]["mode"] == "loaded"
    tiers = {"gpu_prefix_cache", "cpu_tier", "fs_tier", "redis_tier"}
    assert set(run["prompt_tokens"]) == {"total", "computed"} | tiers
    assert set(run["hit_rate"]) == tiers
    assert set(run["share"]) == {"computed"} | tiers
    assert all(0.0 <= v <= 1.0 for v in run["hit_rate"].values())
    for name in ("overhead_us_per_step", "worker_overhead_us_per_step", "ttft_ms", "latency_ms"):
        _check_dist(run[name])
    # TTFT in parts: one sample per request that got a first token, each part >= 0, and the
    # engine-measured sum within the clients' TTFT (which adds the front end's hand-offs).
    parts = run["ttft_parts_ms"]
    assert set(parts) == {"slot", "lookup", "loading", "prefill"}
    for d in parts.values():
        _check_dist(d)
        assert d["count"] == run["requests"]["finished"] and d["mean"] >= 0
    assert 0 < sum(d["mean"] for d in parts.values()) <= run["ttft_ms"]["mean"] * 1.01
    if not offload:
        assert parts["lookup"]["max"] == parts["loading"]["max"] == 0.0
    # Throughput over the timed window; CPU per component, the engine thread's among them.
    assert run["requests_per_s"] == pytest.approx(run["requests"]["finished"] / run["wall_s"])
    assert run["prompt_tokens_per_s"] == pytest.approx(
        run["prompt_tokens"]["total"] / run["wall_s"]
    )
    assert run["cpu_s_by_component"]["engine thread"] > 0
    assert (
        run["cpu_s_by_component"].get("fs tier threads", 0) > 0
    ) is offload  # the baseline has no tier
    assert run["verify_cpu_s"] >= 0
    assert set(run["transfers"]) == {
        "gpu_to_cpu",
        "cpu_to_gpu",
        "cpu_to_fs",
        "fs_to_cpu",
        "cpu_to_redis",
        "redis_to_cpu",
    }
    for t in run["transfers"].values():
        assert set(t) == {
            "blocks",
            "bytes",
            "busy_s",
            "failed_blocks",
            "skipped_blocks",
            "jobs",
            "failed_jobs",
            "served_bytes",
            "throughput_bytes_per_s",
            "average_bytes_per_s",
        }
    assert set(run["verification"]) == {
        "mode",
        "blocks_checked",
        "blocks_verified",
        "blocks_mismatched",
        "corrupt_blocks_detected",
        "failed_loads",
        "blocks_verified_from_redis",
    }
    for s in run["samples"]:
        assert set(s) == {"t_s", "tokens", "bytes_moved"}
    times = [s["t_s"] for s in run["samples"]]
    assert times == sorted(times)
    # Token accounting: every placed token is computed or served by exactly one tier.
    p = run["prompt_tokens"]
    assert p["computed"] + sum(p[t] for t in tiers) == p["total"] > 0


def test_run_end_to_end_report_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    plot = tmp_path / "run.png"
    code, doc = run_tiny(tmp_path, "r1", "--plot", str(plot))
    text = capsys.readouterr()
    assert code == 0, text.out + text.err
    assert "[baseline]" not in text.err and "[offload]" not in text.err  # no bar off a terminal
    for line in (
        "baseline (no offload)",
        "offload/base",
        "throughput, requests/s",
        "waiting on the tiers",
        "loading into the GPU",
        "CPU seconds (timed window)",
        "KV-cache groups: standard (one full-attention group); scheduling: synchronous",
        "load average",
        "served from CPU tier",
        "served from fs tier",
        "prefill tokens saved vs baseline",
        "fs tier started cold",
        "served from fs tier",
        "CPU -> GPU (load)",
        "verdict: PASS",
    ):
        assert line in text.out

    assert doc["schema_version"] == 1
    assert set(doc) == {
        "schema_version",
        "settings",
        "machine",
        "runs",
        "comparison",
        "verdict",
        "fleet",
        "kv_events",
    }
    assert doc["fleet"] is None  # one engine, in this process
    assert doc["kv_events"] is None  # no --kv-events-endpoint
    base, off = doc["runs"]["baseline"], doc["runs"]["offload"]
    _check_run_schema(base, offload=False)
    _check_run_schema(off, offload=True)
    assert doc["settings"]["workload"] == "documents" and doc["settings"]["gpu_blocks"] == 24

    # Both runs served the same requests and produced the same outputs.
    workload = generate_workload(build_run_config(_parsed(tmp_path)).workload)
    assert base["requests"]["submitted"] == workload.num_requests == 20
    assert base["requests"] == off["requests"]
    assert base["requests"]["finished"] == base["requests"]["submitted"]
    assert base["output_tokens"] == off["output_tokens"] == 3 * off["requests"]["finished"]
    assert doc["comparison"]["outputs_identical"] is True
    cmp = doc["comparison"]
    assert cmp["wall_time_ratio"] == pytest.approx(off["wall_s"] / base["wall_s"])
    assert cmp["ttft_median_ratio"] == pytest.approx(
        off["ttft_ms"]["median"] / base["ttft_ms"]["median"]
    )
    assert cmp["ttft_p99_ratio"] == pytest.approx(off["ttft_ms"]["p99"] / base["ttft_ms"]["p99"])
    assert cmp["throughput_ratio"] == pytest.approx(off["requests_per_s"] / base["requests_per_s"])
    # Told in words exactly when the run was no faster (the hash model: usually).
    no_faster = cmp["ttft_median_ratio"] >= 1 or cmp["wall_time_ratio"] >= 1
    assert (cmp["no_benefit_reason"] is not None) is no_faster
    assert doc["machine"]["cpus"] == os.cpu_count()
    assert doc["machine"]["load_average_start"] >= 0 and doc["machine"]["load_average_end"] >= 0

    # The baseline has no offload tiers; the offloaded run used both.
    assert base["prompt_tokens"]["cpu_tier"] == base["prompt_tokens"]["fs_tier"] == 0
    assert base["fs_tier"] is None and base["transfers"]["gpu_to_cpu"]["blocks"] == 0
    assert off["prompt_tokens"]["cpu_tier"] > 0
    assert off["prompt_tokens"]["fs_tier"] > 0
    assert off["transfers"]["fs_to_cpu"]["blocks"] > 0
    assert off["transfers"]["gpu_to_cpu"]["blocks"] > 0
    assert off["transfers"]["cpu_to_gpu"]["blocks"] > 0
    # Every block stored in the CPU tier was written through to disk (or was there already, when
    # it had been evicted from the CPU tier and stored again).
    fs_store = off["transfers"]["cpu_to_fs"]
    assert fs_store["blocks"] > 0 and fs_store["failed_blocks"] == 0
    # The fs tier counts its jobs (what the verdict reads to tell a tier that failed them all).
    assert fs_store["jobs"] > 0 and fs_store["failed_jobs"] == 0
    assert off["transfers"]["fs_to_cpu"]["jobs"] > 0
    assert base["transfers"]["cpu_to_fs"]["jobs"] is None
    assert (
        fs_store["blocks"] + fs_store["skipped_blocks"] == off["transfers"]["gpu_to_cpu"]["blocks"]
    )
    # The fs tier's busy time: wall time with its I/O threads at work. Promotions serve requests,
    # so they end within the run; write-through stores may go on after the last output.
    for name in ("cpu_to_fs", "fs_to_cpu"):
        t = off["transfers"][name]
        assert t["busy_s"] > 0, (name, t)
        assert t["throughput_bytes_per_s"] == pytest.approx(t["bytes"] / t["busy_s"])
    assert off["transfers"]["fs_to_cpu"]["busy_s"] < off["wall_s"]
    assert off["fs_tier"]["warm_start"] is False
    assert off["fs_tier"]["files_at_end"] == off["transfers"]["cpu_to_fs"]["blocks"]
    assert off["transfers"]["cpu_to_fs"]["bytes"] == off["fs_tier"]["bytes_at_end"]
    # Loaded blocks were all verified bit-exact.
    v = off["verification"]
    assert v["blocks_verified"] == off["transfers"]["cpu_to_gpu"]["blocks"] > 0
    assert v["blocks_mismatched"] == v["corrupt_blocks_detected"] == 0
    # Tokens served by a tier never exceed what was moved: loads are whole blocks.
    block = doc["settings"]["block_size"]
    served = off["prompt_tokens"]["cpu_tier"] + off["prompt_tokens"]["fs_tier"]
    assert served <= off["transfers"]["cpu_to_gpu"]["blocks"] * block
    saved = doc["comparison"]["prefill_tokens_saved"]
    assert saved == base["prompt_tokens"]["computed"] - off["prompt_tokens"]["computed"]
    assert saved > 0
    assert off["overhead_us_per_step"]["count"] > 0
    # The per-step samples (GPU <-> CPU from the workers, CPU <-> fs from the connector's stats
    # of each step) add up to the run's totals.
    for direction in ("gpu_to_cpu", "cpu_to_gpu", "cpu_to_fs", "fs_to_cpu"):
        moved = sum(s["bytes_moved"][direction] for s in off["samples"])
        assert moved == off["transfers"][direction]["bytes"], direction
    for key in ("connector_thread_cpu_us", "worker_connector_thread_cpu_us"):
        assert set(off[key]) == {"median", "p99"} and 0 < off[key]["median"] <= off[key]["p99"]
    # Thread CPU is part of the wall time it was measured in.
    assert off["connector_thread_cpu_us"]["median"] <= off["overhead_us_per_step"]["median"] * 1.01
    # Requests a lookup deferred: the connector's count includes every one a tier deferred.
    by_tier = off["lookup_deferred_requests_by_tier"]
    assert set(by_tier) == {"fs"}
    assert by_tier["fs"] <= off["lookup_deferred_requests"] <= off["requests"]["submitted"]
    assert 0 <= off["transfer_wait_requests"] <= off["requests"]["submitted"]
    assert doc["verdict"] == {
        "status": "PASS",
        "verified": True,
        "served_correctly": True,
        "storage_intact": True,
        "tiers_working": True,
        "reasons": [],
    }
    # The last sample holds the run's cumulative token figures.
    last = off["samples"][-1]["tokens"]
    assert last["computed"] == off["prompt_tokens"]["computed"]
    assert last["cpu_tier"] == off["prompt_tokens"]["cpu_tier"]
    data = plot.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 10_000


def _parsed(tmp_path: Path) -> argparse.Namespace:
    return build_parser().parse_args(["run", *TINY, "--fs-root", str(tmp_path / "fs")])


def test_second_run_over_the_same_fs_root_starts_warm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code1, first = run_tiny(tmp_path, "r1")
    code2, second = run_tiny(tmp_path, "r2")
    out = capsys.readouterr().out
    assert (code1, code2) == (0, 0)
    f1, f2 = first["runs"]["offload"], second["runs"]["offload"]
    assert f2["fs_tier"]["warm_start"] is True
    assert f2["fs_tier"]["files_at_start"] == f1["fs_tier"]["files_at_end"] > 0
    assert f2["fs_tier"]["bytes_at_start"] == f1["fs_tier"]["bytes_at_end"]
    assert f"fs tier started WARM: {f1['fs_tier']['files_at_end']:,} blocks" in out
    # Cold CPU tier, warm disk: the fs tier serves, and less is computed than the first time.
    assert f2["prompt_tokens"]["fs_tier"] > 0
    assert f2["transfers"]["fs_to_cpu"]["blocks"] > 0
    assert f2["prompt_tokens"]["computed"] < f1["prompt_tokens"]["computed"]
    # Blocks stored to the CPU tier again mostly were on disk already; the few written now (ones
    # the first run did not get to store) are exactly what the tier holds in addition.
    s1, s2 = f1["transfers"]["cpu_to_fs"], f2["transfers"]["cpu_to_fs"]
    assert s2["blocks"] + s2["skipped_blocks"] == f2["transfers"]["gpu_to_cpu"]["blocks"]
    assert s2["blocks"] < s1["blocks"]
    assert f2["fs_tier"]["files_at_end"] == f2["fs_tier"]["files_at_start"] + s2["blocks"]
    # Same seed, same outputs, in both invocations and both runs.
    assert second["comparison"]["outputs_identical"] is True
    assert second["verdict"]["status"] == "PASS"


def test_a_block_corrupted_on_disk_is_detected_reported_and_recomputed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code1, _ = run_tiny(tmp_path, "r1")
    assert code1 == 0
    # The first block of the first session's prompt: every run needs it, and the second run's
    # cold GPU pool and CPU tier make it ask the fs tier for it.
    workload = generate_workload(build_run_config(_parsed(tmp_path)).workload)
    session = workload.sessions[0]
    prompt = session.prompt(0, list(session.prefix))
    block_hash = hash_block_tokens(NONE_HASH, prompt[:16])
    (path,) = (tmp_path / "fs").rglob(f"{block_hash.hex()}.bin")
    data = bytearray(path.read_bytes())
    offset = 4096 + 100  # inside the payload (after the 4 KiB header)
    original = data[offset]
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))

    code2, second = run_tiny(tmp_path, "r2")
    out = _flat(capsys.readouterr().out)
    assert code2 == 1  # the verdict fails
    off = second["runs"]["offload"]
    assert off["verification"]["corrupt_blocks_detected"] >= 1
    assert off["transfers"]["fs_to_cpu"]["failed_blocks"] >= 1
    assert second["verdict"]["status"] == "FAIL"
    assert second["verdict"]["storage_intact"] is False
    # Nothing corrupt was served: the block was recomputed, outputs match the baseline and the
    # first invocation, and every loaded block verified.
    assert second["verdict"]["served_correctly"] is True
    assert off["verification"]["blocks_mismatched"] == 0
    assert second["comparison"]["outputs_identical"] is True
    assert "corrupt block(s) detected on disk (discarded and recomputed, never served)" in out
    assert "storage integrity: FAIL" in out
    assert "verdict: FAIL" in out
    # The corrupt file was removed; if the block was stored again it is intact now.
    if path.exists():
        assert path.read_bytes()[offset] == original


def test_run_without_fs_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "nofs.json"
    assert main([*TINY, "--no-fs", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    off = doc["runs"]["offload"]
    assert off["fs_tier"] is None
    assert off["prompt_tokens"]["fs_tier"] == 0
    assert off["transfers"]["cpu_to_fs"]["blocks"] == 0
    assert "  fs tier:  none" in capsys.readouterr().out


def test_a_run_that_exceeds_its_timeout_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a if a != "120" else "0.05" for a in TINY]
    assert main([*argv, "--fs-root", str(tmp_path / "fs")]) == 1
    err = capsys.readouterr().err
    assert "vllm-kv-offload: error: baseline run:" in err
    assert "requests finished within the --timeout of 0.05 s" in err


def test_module_runs_as_a_script(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = run_python("-m", "vllm.entrypoints.cli.main", *TINY_MIX, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "verdict: PASS" in proc.stdout
    # The default fs root is under the user's cache dir.
    assert str(tmp_path / "cache" / "vllm-kv-offload") in proc.stdout
    assert list((tmp_path / "cache" / "vllm-kv-offload").rglob("*.bin"))


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["chat", "system-prompt", "documents", "mix"])
def test_every_workload_exercises_offloading_with_its_defaults(
    workload: str, tmp_path: Path
) -> None:
    # The documented examples (`vllm-kv-offload run --workload chat`, ...) with no other flag:
    # the GPU pool must be smaller than the working set, so the tiers serve and prefill is saved.
    # What the tiers serve does not depend on the model: the hash stand-in keeps this quick.
    out = tmp_path / "r.json"
    argv = ["--workload", workload, "--fs-root", str(tmp_path / "fs"), "--no-progress"]
    argv += ["--model", "hash"]
    assert main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    off = doc["runs"]["offload"]
    assert off["prompt_tokens"]["cpu_tier"] + off["prompt_tokens"]["fs_tier"] > 0
    assert doc["comparison"]["prefill_tokens_saved_fraction"] > 0.1
    assert doc["comparison"]["no_savings_reason"] is None


def test_async_scheduling_passes_with_the_outputs_of_sync_scheduling(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm.entrypoints.cli.run import serve

    out = tmp_path / "async.json"
    argv = [*TINY_MIX, "--fs-root", str(tmp_path / "fs")]
    assert main([*argv, "--async-scheduling", "--json", str(out)]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["settings"]["async_scheduling"] is True
    assert doc["runs"]["offload"]["verification"]["blocks_mismatched"] == 0
    # The asynchronously scheduled offloaded run produced exactly the synchronous baseline's
    # tokens (the verdict above compared it with an asynchronous baseline only).
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    sync_opts = build_run_config(args)
    workload = generate_workload(sync_opts.workload)
    sync_baseline, _ = asyncio.run(serve(sync_opts, workload, offload=False))
    async_args = parser.parse_args(["run", *argv, "--async-scheduling"])
    async_opts = build_run_config(async_args)
    assert async_opts.engine.async_scheduling and not sync_opts.engine.async_scheduling
    async_offload, _ = asyncio.run(serve(async_opts, workload, offload=True))
    assert len(sync_baseline.outputs) == workload.num_requests
    assert async_offload.outputs == sync_baseline.outputs
    # One digest over every output, whatever the scheduling: the JSON's outputs_digest.
    assert async_offload.outputs_digest == sync_baseline.outputs_digest
    assert doc["runs"]["offload"]["outputs_digest"] == sync_baseline.outputs_digest


def _transformer_argv() -> list[str]:
    # TINY with the smallest transformer: its preset's KV geometry is TINY's (2 layers, 2 KV
    # heads of 16), so the tiers' sizes mean the same.
    drop = {"--model": 2, "--num-layers": 2, "--head-size": 2}
    argv, i = [], 0
    while i < len(TINY):
        step = drop.get(TINY[i], 0)
        if step:
            i += step
            continue
        argv.append(TINY[i])
        i += 1
    return [*argv, "--model", "transformer", "--model-preset", "tiny"]


def test_the_transformer_serves_offloaded_prefixes_checked_after_the_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "transformer.json"
    argv = [*_transformer_argv(), "--fs-root", str(tmp_path / "fs"), "--json", str(out)]
    code = main(argv)
    text = capsys.readouterr().out
    assert code == 0, text
    assert (
        "model: transformer tiny (2 layers, d_model 64, 4/2 heads, 2,122,048 parameters, 256 KV "
        "bytes per token)" in _flat(text)
    )
    assert "verdict: PASS" in text
    doc = json.loads(out.read_text())
    base, off = doc["runs"]["baseline"], doc["runs"]["offload"]
    assert doc["settings"]["model"] == "transformer"
    assert doc["settings"]["model_name"] == "kv-offload-llama-tiny-seed0"
    assert off["prompt_tokens"]["cpu_tier"] + off["prompt_tokens"]["fs_tier"] > 0
    assert off["verification"]["blocks_verified"] == off["transfers"]["cpu_to_gpu"]["blocks"] > 0
    assert off["verification"]["blocks_mismatched"] == 0
    assert base["outputs_digest"] == off["outputs_digest"]
    assert base["verify_s"] >= 0 and off["engine_thread_cpu_s"] > 0
    # The load guard is on with the transformer: its decisions and estimates per tier.
    assert doc["settings"]["load_guard"] is True and base["load_guard"] is None
    guard = off["load_guard"]
    assert guard["enabled"] is True and guard["compute_s_per_token"] > 0
    assert set(guard["tiers"]) <= {"cpu_tier", "fs_tier", "redis_tier"} and guard["tiers"]
    for tier in guard["tiers"].values():
        assert 0 <= tier["guard_skipped_hits"] <= tier["guard_decisions"]
        assert tier["guard_skipped_tokens"] >= tier["guard_skipped_hits"]
    assert "load guard: prefill" in text


def test_no_load_guard_loads_every_hit(tmp_path: Path) -> None:
    out = tmp_path / "unguarded.json"
    argv = [*_transformer_argv(), "--fs-root", str(tmp_path / "fs"), "--json", str(out)]
    assert main([*argv, "--no-load-guard"]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["load_guard"] is False
    assert doc["runs"]["offload"]["load_guard"] is None


def test_verify_none_checks_nothing_and_never_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, doc = run_tiny(tmp_path, "none", "--verify", "none")
    text = capsys.readouterr().out
    assert code == 0  # nothing failed
    assert "correctness: NOT VERIFIED" in text and "verdict: UNVERIFIED" in text
    assert "verdict: PASS" not in text
    assert doc["verdict"]["status"] == "UNVERIFIED" and doc["verdict"]["verified"] is False
    assert doc["runs"]["offload"]["verification"]["blocks_verified"] == 0
    assert doc["runs"]["offload"]["verification"]["mode"] == "none"


@pytest.mark.parametrize("mode", [[], ["--async-scheduling"]], ids=["sync", "async"])
def test_hybrid_model_stand_in_verifies_loaded_blocks_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str]
) -> None:
    out = tmp_path / "hybrid.json"
    argv = [*TINY, "--fs-root", str(tmp_path / "fs"), "--json", str(out)]
    # Rows are sized per group (a key is one group's block), so TINY's CPU tier holds as many
    # rows as with one group, and the CPU / fs split is TINY's.
    argv += ["--model-stand-in", "hybrid", "--sliding-window", "24"]
    assert main([*argv, *mode]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["settings"]["model_stand_in"] == "hybrid"
    assert doc["settings"]["sliding_window"] == 24
    off = doc["runs"]["offload"]
    assert off["verification"]["blocks_verified"] > 0
    assert off["verification"]["blocks_mismatched"] == 0
    assert off["prompt_tokens"]["cpu_tier"] + off["prompt_tokens"]["fs_tier"] > 0
    assert doc["comparison"]["outputs_identical"] is True
    promoted = off["transfers"]["fs_to_cpu"]
    assert (promoted["served_bytes"] > 0) == (off["prompt_tokens"]["fs_tier"] > 0)
    assert off["transfers"]["gpu_to_cpu"]["served_bytes"] is None


def test_hybrid_promotions_read_little_more_than_the_loads_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A row holds one group's block (per-group rows): what the fs tier reads into the CPU tier
    # is what loads then use of it, plus each block file's 4 KiB header (rows spanning both
    # groups would read twice the bytes). Head size 64 makes TINY's rows 16 KiB (the header a
    # quarter of one: 1.25x); 1 MiB gives the CPU tier 64 rows. With 32 (512 KiB) a promoted
    # row was now and then evicted before its load used it and promoted again (1.25-2.1x over
    # runs). That only the keys a hit loads are promoted is test_hybrid.py's (promoting_hit_end).
    # The second run, over the first one's files, is measured: in a cold run what the fs tier
    # serves depends on how fast its writes land (a disk slow to fsync left the CPU tier's rows
    # pinned by their pending writes and the fs tier serving nothing); a warm one finds every
    # file there from the start, and promotes from it whatever its cold CPU tier misses.
    argv = [*TINY, "--head-size", "64", "--cpu-bytes", "1MiB", "--sliding-window", "32"]
    argv += ["--model-stand-in", "hybrid", "--fs-root", str(tmp_path / "fs")]
    for name in ("cold", "warm"):
        out = tmp_path / f"{name}.json"
        assert main([*argv, "--json", str(out)]) == 0
        assert "verdict: PASS" in capsys.readouterr().out
    off = json.loads(out.read_text())["runs"]["offload"]
    assert off["fs_tier"]["warm_start"] is True
    promoted = off["transfers"]["fs_to_cpu"]
    assert off["prompt_tokens"]["fs_tier"] > 0 and promoted["served_bytes"] > 0
    assert promoted["bytes"] <= 1.5 * promoted["served_bytes"]


async def _events_of_one_run(
    config: RunConfig, sink: Callable[[KVEventBatch], None] | None
) -> tuple[bool, int]:
    """Serve the workload once with offloading; whether the engine collected KV events, and
    how many batches it handed on."""
    workload = generate_workload(config.workload)
    async with EngineRun(config, offload=True, event_sink=sink) as run:
        await run.start_window()
        await serve_workload(
            engine_generate(run.llm), workload, run.label, 120, False, dict, lambda t0: None
        )
        await run.finish()
        return await run.llm.call(lambda e: (e.config.enable_kv_events, e.stats.events_published))


def test_kv_events_are_collected_only_when_a_publisher_receives_them(tmp_path: Path) -> None:
    """vLLM collects KV events only when ``kv_events_config`` enables them: a run without a
    publisher records none (neither the GPU cache's nor the tiers'); with one, both media."""
    args = build_parser().parse_args(["run", *TINY, "--fs-root", str(tmp_path / "fs")])
    config = build_run_config(args)
    assert asyncio.run(_events_of_one_run(config, None)) == (False, 0)
    batches: list[KVEventBatch] = []
    enabled, published = asyncio.run(_events_of_one_run(config, batches.append))
    assert enabled and published == len(batches) > 0
    media = {getattr(e, "medium", None) for b in batches for e in b.events}
    assert {"GPU", "CPU"} <= media
