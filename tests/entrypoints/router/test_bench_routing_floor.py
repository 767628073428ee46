# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The routing floor (``benchmarks/kv_offload/bench_routing_floor.py``) is what one engine with an
unbounded prefix cache computes: checked against the command's own baseline run.

The baseline run has no offload tiers; with one client (requests one after another) and a GPU
pool larger than the workload, nothing is ever evicted, so it computes exactly the floor. A
floor that missed a block the engine caches (those a chat's decode steps fill, which its next
turn starts with) would lie above it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[3] / "benchmarks" / "kv_offload"))

from bench_routing_floor import floor_tokens, workload_config

from vllm.entrypoints.cli.main import main


@pytest.mark.parametrize("workload", ["chat", "mix"])
def test_the_floor_is_what_one_engine_with_room_for_everything_computes(
    workload: str, tmp_path: Path
) -> None:
    out = tmp_path / "run.json"
    argv = [
        *("--model", "hash", "--num-layers", "2", "--head-size", "16", "--verify", "none"),
        *("--workload", workload, "--num-clients", "1", "--num-sessions", "8", "--turns", "3"),
        *("--turn-tokens", "24", "--output-tokens", "20", "--document-tokens", "128"),
        *("--system-prompt-tokens", "64", "--think-time", "0", "--gpu-blocks", "4096"),
        *("--no-fs", "--no-progress", "--json", str(out)),
    ]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    baseline = doc["runs"]["baseline"]["prompt_tokens"]
    requests, total, floor = floor_tokens(
        workload_config(doc["settings"]), doc["settings"]["block_size"]
    )
    assert requests == doc["runs"]["baseline"]["requests"]["finished"]
    assert total == baseline["total"]
    assert floor == baseline["computed"]
    assert 0 < floor < total
