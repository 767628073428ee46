# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What share of the default ``run``'s baseline is prefill: the model's steps replayed in parts.

It runs ``vllm-kv-offload run`` (the options after ``--`` are passed on; default: the default
workload and model) in this process, and records every step the baseline's model runner executed
(its sequences: rows, positions, block tables). After the command ends it replays those steps
on the same runner three times: whole, with only each step's **prefill** rows (the chunks of a
prompt, up to and including the chunk that samples its first token; also a preempted request's
recomputation), and with only its **decode** rows (one token each, after the first). A step's
fixed costs (its weights streamed once, the LM head's table) are paid by each part's replay of
the step, so the two parts add up to more than the whole: prefill's share of the baseline's
timed window lies between ``(whole - decode only) / window`` (prefill's own cost, every shared
cost given to decode) and ``prefill only / window`` (every shared cost given to prefill). The
replays read whatever the cache holds then (attention's cost does not depend on the values).

It also prints the estimate ``run``'s two runs give by themselves (the engine-thread CPU the
offloaded run saved, per prompt token it did not compute, times the tokens the baseline
computed): a lower bound, since the offloaded run's own connector costs are in its CPU.

Usage::

    PYTHONPATH=. python benchmarks/kv_offload/bench_prefill_share.py [-- --fs-root DIR ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vllm.entrypoints.cli.main import main as cli_main
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.model_runner import ScheduledSeq, TransformerModelRunner

Step = list[ScheduledSeq]


class Recorder:
    """Records the steps of every ``TransformerModelRunner`` of the process, per runner."""

    def __init__(self) -> None:
        self.steps: dict[TransformerModelRunner, list[Step]] = {}
        self.order: list[TransformerModelRunner] = []
        self._execute = TransformerModelRunner.execute

    def install(self) -> None:
        recorder = self

        def execute(runner: TransformerModelRunner, seqs: Sequence[ScheduledSeq]) -> Any:
            if runner not in recorder.steps:
                recorder.steps[runner] = []
                recorder.order.append(runner)
            # Copies of the mutable parts: the engine appends to token lists and block tables.
            recorder.steps[runner].append(
                [
                    replace(
                        s,
                        token_ids=list(s.token_ids[: s.end]),
                        block_ids=[list(b) for b in s.block_ids],
                    )
                    for s in seqs
                ]
            )
            return recorder._execute(runner, seqs)

        TransformerModelRunner.execute = execute  # type: ignore[method-assign]

    def uninstall(self) -> None:
        TransformerModelRunner.execute = self._execute  # type: ignore[method-assign]


def split(steps: list[Step]) -> tuple[list[Step], list[Step]]:
    """Each step's prefill rows and its decode rows (see the module docstring)."""
    first_sample: dict[str, int] = {}  # request -> end of the chunk that sampled its first token
    prefill: list[Step] = []
    decode: list[Step] = []
    for step in steps:
        p, d = [], []
        for s in step:
            done = first_sample.get(s.req_id)
            if done is None or s.end <= done or s.end - s.start > 1:
                p.append(s)
                if s.sample and done is None:
                    first_sample[s.req_id] = s.end
            else:
                d.append(s)
        if p:
            prefill.append(p)
        if d:
            decode.append(d)
    return prefill, decode


def replay(runner: TransformerModelRunner, steps: list[Step]) -> tuple[float, float]:
    """Wall and thread-CPU seconds of executing ``steps`` on ``runner``."""
    w0, c0 = time.perf_counter(), time.thread_time()
    for step in steps:
        runner.execute(step)
    return time.perf_counter() - w0, time.thread_time() - c0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_args", nargs="*", help="options for `vllm-kv-offload run`")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="prefill_share_"))
    run_args = list(args.run_args)
    if "--fs-root" not in run_args:
        run_args += ["--fs-root", str(out / "fs")]
    recorder = Recorder()
    recorder.install()
    try:
        code = cli_main(["run", "--no-progress", "--json", str(out / "run.json"), *run_args])
    finally:
        recorder.uninstall()
    if code != 0:
        sys.exit(f"the run failed (exit code {code})")
    doc = json.loads((out / "run.json").read_text())
    base, off = doc["runs"]["baseline"], doc["runs"]["offload"]
    runner = recorder.order[0]  # the baseline's engine was built first
    steps = recorder.steps[runner]
    prefill, decode = split(steps)
    # The engine's intra-op threads (it set them process-wide; 0 would leave torch's own).
    threads = EngineConfig().intra_op_threads
    if threads:
        torch.set_num_threads(threads)
    f_wall, f_cpu = replay(runner, steps)
    p_wall, p_cpu = replay(runner, prefill)
    d_wall, d_cpu = replay(runner, decode)
    wall = base["wall_s"]
    rows_f = sum(s.end - s.start for step in steps for s in step)
    rows_p = sum(s.end - s.start for step in prefill for s in step)
    rows_d = sum(s.end - s.start for step in decode for s in step)
    computed_b, computed_o = base["prompt_tokens"]["computed"], off["prompt_tokens"]["computed"]
    saved_cpu = base["engine_thread_cpu_s"] - off["engine_thread_cpu_s"]
    estimate = saved_cpu / (computed_b - computed_o) * computed_b
    machine = doc["machine"]
    print(
        f"baseline: {len(steps):,} steps, timed window {wall:.1f} s, engine thread CPU "
        f"{base['engine_thread_cpu_s']:.1f} s; load average {machine['load_average_start']:.2f} "
        f"at start, {machine['load_average_end']:.2f} at end"
    )
    print(
        "| part | steps | rows | replay wall s | replay thread CPU s "
        "| share of the baseline's timed wall |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, part, rows, w, c in (
        ("whole steps", steps, rows_f, f_wall, f_cpu),
        ("prefill only", prefill, rows_p, p_wall, p_cpu),
        ("decode only", decode, rows_d, d_wall, d_cpu),
    ):
        print(f"| {name} | {len(part):,} | {rows:,} | {w:.1f} | {c:.1f} | {w / wall:.0%} |")
    print(
        f"prefill's share of the baseline's timed window: {(f_wall - d_wall) / wall:.0%} "
        f"(its own cost) to {p_wall / wall:.0%} (with every cost a step shares); the model's "
        f"steps {f_wall / wall:.0%}, the rest (scheduler, sampling, front end) the remainder"
    )
    print(
        f"estimate from the two runs alone (lower bound): {estimate:.1f} s = {estimate / wall:.0%}"
    )
    print(
        f"total wall of the command's runs: baseline {wall:.1f} s + offload {off['wall_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
