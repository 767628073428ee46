# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The prefill tokens no routing policy can go below, for a workload of ``vllm-kv-offload run``.

A fleet computes every block of the workload's prefix tree at least once, wherever requests go:
the fewest prompt tokens it can compute are those one engine with an unbounded prefix cache
would compute (each request computes its prompt beyond the longest prefix of whole blocks that
an earlier request wrote KV for: its prompt, and the blocks its decode steps filled). This
script counts that floor for the workload the command would serve (the same
``WorkloadConfig``, so the same token ids) and, given the JSON of a ``run --engines N
--compare-routing`` (whose ``settings`` name the workload), sets it beside what each policy
computed: a target ratio to round-robin below ``floor / round-robin`` is out of any router's
reach on that workload.

A chat turn's prompt holds the model's earlier answers; the script stands in a fixed token for
each (the floor counts tokens, and an answer's token ids change no count: the chained hashes
that follow it are the session's own either way). Usage::

    python benchmarks/kv_offload/bench_routing_floor.py [--workload mix] [--num-sessions 160]
        [--block-size 16] [--compare-json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vllm.entrypoints.cli.workloads import (
    WORKLOAD_DEFAULTS,
    WorkloadConfig,
    WorkloadKind,
    generate_workload,
)
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

ANSWER_TOKEN = 1
"""The token standing in for each of the model's answer tokens (see the module docstring)."""


def floor_tokens(config: WorkloadConfig, block_size: int) -> tuple[int, int, int]:
    """The workload's requests, prompt tokens, and prompt tokens an unbounded cache computes."""
    hasher = get_request_block_hasher(block_size)
    seen: set[bytes] = set()
    requests = total = computed = 0
    for session in generate_workload(config).sessions:
        history = list(session.prefix)
        for t, turn in enumerate(session.turns):
            prompt = session.prompt(t, history)
            hashes = hasher(Request("floor", prompt, 1))
            cached = 0
            while cached < len(hashes) and hashes[cached] in seen:
                cached += 1
            requests += 1
            total += len(prompt)
            computed += len(prompt) - cached * block_size
            history = [*prompt, *[ANSWER_TOKEN] * turn.max_tokens]
            # The engine caches every full block it wrote KV for: the prompt's, and those its
            # decode steps filled, up to the last answer token (sampled, never fed back).
            written = history[: len(history) - 1]
            seen.update(hasher(Request("floor", written, 1)))
    return requests, total, computed


def workload_config(settings: dict[str, Any]) -> WorkloadConfig:
    """The workload a run served, from its JSON report's ``settings`` (a report written before
    they named ``num_system_prompts`` is read with the workload's default)."""
    kind = WorkloadKind(settings["workload"])
    default_prompts = WORKLOAD_DEFAULTS.get(kind, {}).get(
        "num_system_prompts", WorkloadConfig.num_system_prompts
    )
    return WorkloadConfig(
        kind=kind,
        seed=settings["seed"],
        num_clients=settings["num_clients"],
        num_sessions=settings["num_sessions"],
        turns_per_session=settings["turns"],
        turn_tokens=settings["turn_tokens"],
        output_tokens=settings["output_tokens"],
        system_prompt_tokens=settings["system_prompt_tokens"],
        num_system_prompts=settings.get("num_system_prompts", default_prompts),
        document_tokens=settings["document_tokens"],
        num_documents=settings["num_documents"],
        think_time_s=settings["think_time_s"],
        arrival_interval_s=settings["think_time_s"],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="mix", choices=[k.value for k in WorkloadKind])
    parser.add_argument("--num-sessions", type=int, default=WorkloadConfig.num_sessions)
    parser.add_argument("--turns", type=int, default=WorkloadConfig.turns_per_session)
    parser.add_argument("--seed", type=int, default=WorkloadConfig.seed)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--compare-json",
        type=Path,
        help="the JSON of a run --engines N --compare-routing: its workload and block size "
        "replace the options above",
    )
    args = parser.parse_args()
    doc = None if args.compare_json is None else json.loads(args.compare_json.read_text())
    if doc is not None:
        config = workload_config(doc["settings"])
        block_size = doc["settings"]["block_size"]
    else:
        kind = WorkloadKind(args.workload)
        config = WorkloadConfig(
            kind=kind,
            seed=args.seed,
            num_sessions=args.num_sessions,
            turns_per_session=args.turns,
            **WORKLOAD_DEFAULTS.get(kind, {}),
        )
        block_size = args.block_size
    requests, total, floor = floor_tokens(config, block_size)
    print(f"{config.kind.value}: {requests} requests, {total:,} prompt tokens")
    print(f"  floor (one engine, unbounded prefix cache): {floor:,} computed")
    if doc is None:
        return
    runs = {r["routing"]["policy"]: r for r in doc["fleet"]["routing_comparison"]}
    rr = runs["round-robin"]["run"]["prompt_tokens"]["computed"]
    print(f"  floor / round-robin: {floor / rr:.2f}")
    for policy, r in runs.items():
        computed = r["run"]["prompt_tokens"]["computed"]
        print(f"  {policy:>12}: {computed:,} computed, {computed / rr:.2f}x round-robin")


if __name__ == "__main__":
    main()
