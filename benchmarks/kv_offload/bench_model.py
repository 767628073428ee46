# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What the transformer's presets cost per token, and what torch's intra-op threads do to it.

For each preset, on one engine-shaped worker (paged KV cache of 16-token blocks, float16 KV), it
times in the same process:

* ``prefill``: one sequence of ``--prompt`` tokens computed in chunks of ``--chunk`` tokens (the
  engine's ``max_num_batched_tokens``), as tokens per second of wall time and of thread CPU;
* ``decode``: ``--batch`` sequences of ``--prompt`` tokens each decoding one token per step, as
  milliseconds per step;

at 1 and at 2 intra-op threads (``torch.set_num_threads``), alternating the two settings
``--reps`` times and keeping each one's median, so that a noisy machine (other processes on the
same cores) affects both alike. The hash stand-in's cost for the same work is the baseline row.

Usage::

    PYTHONPATH=. python benchmarks/kv_offload/bench_model.py            # ~1 min on 2 cores
    PYTHONPATH=. python benchmarks/kv_offload/bench_model.py --presets small medium
    PYTHONPATH=. python benchmarks/kv_offload/bench_model.py --presets small \
        --mixed-lengths 300 2600
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from vllm.model_executor.models.llama import PRESETS, get_preset
from vllm.v1.engine.model import KVLayout, allocate_group_kv_cache
from vllm.v1.engine.model_runner import (
    HashModelRunner,
    ModelRunner,
    ScheduledSeq,
    TransformerModelRunner,
)

BLOCK_SIZE = 16
VOCAB = 32000


def _runner(preset: str | None, num_blocks: int) -> ModelRunner:
    p = get_preset(preset or "small")
    caches = [
        allocate_group_kv_cache(
            0,
            BLOCK_SIZE,
            num_blocks,
            p.num_layers,
            p.num_kv_heads,
            p.head_dim,
            torch.float16,
            KVLayout.PER_LAYER,
        )
    ]
    if preset is None:
        return HashModelRunner(caches, 0, VOCAB)
    return TransformerModelRunner(caches, preset, VOCAB, seed=0)


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def _prefill(runner: ModelRunner, tokens: list[int], chunk: int) -> Callable[[], None]:
    table = [list(range(-(-len(tokens) // BLOCK_SIZE)))]

    def run() -> None:
        for lo in range(0, len(tokens), chunk):
            hi = min(lo + chunk, len(tokens))
            runner.execute([ScheduledSeq("p", tokens, lo, hi, table, hi == len(tokens))])

    return run


def _decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> Callable[[], None]:
    per = -(-(max(len(p) for p in prompts) + steps) // BLOCK_SIZE)
    tables = [[list(range(i * per, (i + 1) * per))] for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    for i, p in enumerate(seqs):  # the prompts' KV, outside the timing
        runner.execute([ScheduledSeq(f"d{i}", p, 0, len(p), tables[i], False)])

    def run() -> None:
        for s in range(steps):
            batch = [
                ScheduledSeq(
                    f"d{i}", p + [1] * (s + 1), len(p) + s, len(p) + s + 1, tables[i], True
                )
                for i, p in enumerate(seqs)
            ]
            runner.execute(batch)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=[p for p in PRESETS if p != "tiny"])
    parser.add_argument("--prompt", type=int, default=1024, help="tokens per prompt")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prefill step")
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed")
    parser.add_argument(
        "--mixed-lengths",
        type=int,
        nargs=2,
        metavar=("LO", "HI"),
        default=None,
        help="decode sequences of seeded lengths in [LO, HI] instead of --prompt each (the "
        "default workload's contexts run from a few hundred to about 2,600 tokens)",
    )
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(1, VOCAB) for _ in range(args.prompt)]
    lengths = [
        args.prompt if args.mixed_lengths is None else rng.randint(*args.mixed_lengths)
        for _ in range(args.batch)
    ]
    prompts = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in lengths]
    longest = max(args.prompt, *lengths)
    num_blocks = (args.batch + 1) * -(-(longest + args.steps) // BLOCK_SIZE)
    before = torch.get_num_threads()
    print(
        f"prefill: {args.prompt} tokens in chunks of {args.chunk}; decode: {args.batch} "
        f"sequences at {lengths} tokens, {args.steps} steps; medians of {args.reps}\n"
    )
    print(
        "| model | threads | prefill tok/s (wall) | prefill tok/s (thread CPU) "
        "| decode ms/step | 2 vs 1 thread (prefill wall) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    try:
        for preset in [None, *args.presets]:
            runner = _runner(preset, num_blocks)
            results: dict[int, list[tuple[float, float, float]]] = {1: [], 2: []}
            for _ in range(args.reps):
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    wall, cpu = _timed(_prefill(runner, tokens, args.chunk))
                    dwall, _ = _timed(_decode(runner, prompts, args.steps))
                    results[threads].append((wall, cpu, dwall))
            med = {
                t: [statistics.median(r[i] for r in rs) for i in range(3)]
                for t, rs in results.items()
            }
            for threads in (1, 2):
                wall, cpu, dwall = med[threads]
                ratio = f"{med[2][0] / med[1][0]:.2f}x" if threads == 2 else ""
                print(
                    f"| {preset or 'hash'} | {threads} | {args.prompt / wall:,.0f} "
                    f"| {args.prompt / cpu:,.0f} | {dwall / args.steps * 1e3:.1f} | {ratio} |"
                )
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
