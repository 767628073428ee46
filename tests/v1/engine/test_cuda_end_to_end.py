# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine and ``vllm-kv-offload run`` with the KV cache on a GPU (skipped without one).

Offloaded blocks come back through the CUDA copy library into torch CUDA tensors; the engine
verifies every loaded block bit-exact against recomputation, and the outputs must equal those of
a run without offloading on the CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cuda_helpers import torch_cuda_problem
from tests.entrypoints.cli.test_run import TINY
from tests.v1.kv_connector.unit.offloading_connector.utils import (
    baseline,
    make_config,
    run_multi_turn,
)
from vllm.entrypoints.cli.main import main
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.model import KVLayout

PROBLEM = torch_cuda_problem()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(bool(PROBLEM), reason=PROBLEM or "runs")]


def _workload(engine: EngineCore) -> dict[str, list[int]]:
    return run_multi_turn(engine, seed=13, num_sessions=6, turns=3)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_layout=KVLayout.PER_LAYER),
        dict(kv_layout=KVLayout.PER_LAYER_BLOCKS_FIRST, tensor_parallel_size=2),
        dict(kv_layout=KVLayout.CROSS_LAYER, gpu_block_sizes=(8, 16)),
    ],
    ids=["per_layer", "blocks_first_tp2", "cross_layer_two_groups"],
)
def test_engine_on_cuda_loads_bit_exact_and_matches_the_cpu_baseline(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    geometry = dict(num_gpu_blocks=40, **overrides)
    expected = baseline(tmp_path, _workload, device="cpu", **geometry)
    config = make_config(tmp_path, cpu_blocks=48, device="cuda", **geometry)
    with EngineCore(config) as engine:
        for worker in engine.workers:
            assert all(t.is_cuda for g in worker.kv_caches for t in g.tensors)
        assert _workload(engine) == expected
        stats = engine.stats
        assert stats.tokens_from_cpu > 0 and stats.blocks_loaded_verified > 0
        assert stats.verification_failures == 0 and stats.tokens_load_failed == 0


def test_cli_run_on_cuda_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vllm-kv-offload run --device cuda`` on a tiny workload: outputs identical to the
    baseline, blocks served from the CPU tier, verified bit-exact (the run that failed on an H200
    with "Expected all tensors to be on the same device")."""
    out = tmp_path / "run.json"
    code = main([*TINY, "--device", "cuda", "--fs-root", str(tmp_path / "fs"), "--json", str(out)])
    text = capsys.readouterr()
    assert code == 0, text.out + text.err
    doc = json.loads(out.read_text())
    assert doc["settings"]["device"] == "cuda"
    assert doc["comparison"]["outputs_identical"] is True
    off = doc["runs"]["offload"]
    assert off["prompt_tokens"]["cpu_tier"] > 0
    assert off["transfers"]["cpu_to_gpu"]["blocks"] > 0
    assert off["verification"]["blocks_verified"] > 0
    assert off["verification"]["blocks_mismatched"] == 0
    assert "verdict: PASS" in text.out


@pytest.mark.parametrize("layout", [KVLayout.PER_LAYER, KVLayout.CROSS_LAYER])
def test_transformer_on_cuda_is_batch_invariant_and_loads_bit_exact(
    tmp_path: Path, layout: KVLayout
) -> None:
    """The transformer (smallest preset) on a GPU: the same outputs and block bytes one request
    at a time as in batches of prefill chunks with offloading, every loaded block checked."""
    kw: dict[str, Any] = dict(model="transformer", num_gpu_blocks=40, kv_layout=layout)
    alone = make_config(tmp_path, cpu_blocks=None, device="cuda", max_num_seqs=1, **kw)
    with EngineCore(alone) as engine:
        expected = _workload(engine)
        reference = engine.computed_block_digests()
    batched = make_config(
        tmp_path,
        cpu_blocks=48,
        device="cuda",
        max_num_seqs=4,
        max_num_batched_tokens=37,
        extra={"load_guard": False},  # every hit loaded and checked, however cheap its prefill
        **kw,
    )
    with EngineCore(batched) as engine:
        assert _workload(engine) == expected
        digests = engine.computed_block_digests()
        stats = engine.stats
        assert stats.tokens_from_cpu > 0 and stats.blocks_loaded_verified > 0
        assert stats.verification_failures == 0
    shared = reference.keys() & digests.keys()
    assert shared and all(reference[k] == digests[k] for k in shared)
