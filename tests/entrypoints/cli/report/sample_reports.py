# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Reports for the report's tests: a small passing pair of runs, and one with the widest figures."""

from __future__ import annotations

from vllm.entrypoints.cli.report.figures import (
    Direction,
    FsTierState,
    Report,
    RunResult,
    Tier,
    TransferFigures,
)


def small_runs() -> tuple[RunResult, RunResult]:
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


def huge_report() -> Report:
    # The widest figures a run can produce: 10-digit counts, TiB, long request ids and reasons.
    base, off = small_runs()
    for run in (base, off):
        run.prompt_tokens = 9_876_543_210
        run.computed_tokens = 1_234_567_890
        run.output_tokens = run.steps = run.preemptions = 9_999_999_999
        run.ttft_ms = [123456.0, 999999.0]
        run.overhead_us = run.worker_overhead_us = [9_999_999.0]
        run.ttft_parts_ms = {n: [99_999_999.0] for n in ("slot", "lookup", "loading", "prefill")}
        run.engine_thread_cpu_s = run.verify_cpu_s = run.engine_thread_idle_s = 99999.99
        run.engine_thread_runqueue_wait_s = run.engine_thread_blocked_s = 99999.99
        run.cpu_s_by_component = {"fs tier threads": 99999.99, "native threads (torch ...)": 1.0}
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
    return Report(settings=settings, baseline=base, offload=off, load_average=(999.99, 999.99))
