# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine serving the transformer (smallest preset): its outputs and the bytes of every block
it computes are the same whatever the batching settings and intra-op threads, and with offloading
(prefixes loaded from the CPU tier or a fresh engine's fs tier) they equal the baseline's, every
loaded block checked bit-exact by the oracle."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.v1.kv_connector.unit.offloading_connector.utils import (
    make_config,
    random_tokens,
    run_multi_turn,
)
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.model import KVLayout
from vllm.v1.engine.model_runner import ModelKind


def _workload(engine: EngineCore) -> dict[str, list[int]]:
    return run_multi_turn(engine, seed=4, num_sessions=4, turns=3, first_prompt=50, max_tokens=5)


def _unchecked_workload(engine: EngineCore) -> dict[str, list[int]]:
    """``_workload`` stepped by hand: unlike ``generate``, nothing checks what the oracle records
    (the caller does, with a reference)."""
    rng = random.Random(4)
    history = {s: random_tokens(rng, 50 + 7 * s) for s in range(4)}
    outputs: dict[str, list[int]] = {}
    for turn in range(3):
        for s, prompt in history.items():
            engine.add_request(f"s{s}-t{turn}", prompt, 5)
        while engine.has_pending_work():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        for s in history:
            history[s] += outputs[f"s{s}-t{turn}"] + random_tokens(rng, 24)
    return outputs


def _serve(config: EngineConfig) -> tuple[dict[str, list[int]], dict[Any, bytes], EngineCore]:
    with EngineCore(config) as engine:
        outputs = _workload(engine)
        return outputs, engine.computed_block_digests(), engine


def _config(tmp_path: Path, cpu_blocks: int | None = None, **kw: Any) -> EngineConfig:
    kw.setdefault("num_gpu_blocks", 40)
    # Every hit loaded: these tests are about what loads bring (the tiny preset's prefill is
    # so cheap that the load guard would compute most hits; its own tests are elsewhere).
    return make_config(
        tmp_path, cpu_blocks=cpu_blocks, model="transformer", extra={"load_guard": False}, **kw
    )


@pytest.fixture(autouse=True)
def restore_threads() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_seqs=1, max_num_batched_tokens=512),
        dict(max_num_seqs=3, max_num_batched_tokens=37),
        dict(max_num_seqs=16, max_num_batched_tokens=16, async_scheduling=True),
        dict(max_num_seqs=4, max_num_batched_tokens=100, intra_op_threads=2),
        dict(max_num_seqs=4, max_num_batched_tokens=100, enable_prefix_caching=False),
    ],
    ids=["one-seq", "chunks-of-37", "chunks-of-16-async", "two-threads", "no-prefix-cache"],
)
def test_outputs_and_kv_bytes_do_not_depend_on_batching(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    reference, digests, _ = _serve(_config(tmp_path, max_num_seqs=4, max_num_batched_tokens=64))
    outputs, other, engine = _serve(_config(tmp_path, **settings))
    assert outputs == reference
    shared = digests.keys() & other.keys()
    assert len(shared) > 20
    assert all(digests[k] == other[k] for k in shared)
    assert torch.get_num_threads() == engine.config.intra_op_threads


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("hybrid", [False, True], ids=["standard", "hybrid"])
def test_offloaded_prefixes_give_the_baselines_outputs_and_bytes(
    tmp_path: Path, layout: KVLayout, hybrid: bool
) -> None:
    kw: dict[str, Any] = dict(kv_layout=layout, num_gpu_blocks=24)
    if hybrid:
        kw.update(gpu_block_sizes=(16, 16), sliding_windows=(None, 32))
    expected, reference, _ = _serve(_config(tmp_path, **kw))
    with EngineCore(_config(tmp_path, cpu_blocks=128, verify="all", **kw)) as engine:
        assert engine.config.model is ModelKind.TRANSFORMER
        outputs = _unchecked_workload(engine)
        assert engine.stats.blocks_verified == 0  # nothing is checked while serving
        result = engine.verify_kv(reference)
        assert engine.stats.tokens_from_cpu > 0
    assert outputs == expected
    assert result.loaded_checked > 0 and result.computed_checked > 0
    assert result.mismatched == 0 and result.recomputed == 0
    assert result.blocks_checked > result.loaded_checked  # finished requests' blocks too


def test_a_fresh_engine_checks_blocks_from_disk_by_recomputing_them(tmp_path: Path) -> None:
    kw: dict[str, Any] = dict(num_gpu_blocks=24)
    with EngineCore(_config(tmp_path, cpu_blocks=16, fs=True, **kw)) as first:
        expected = _workload(first)
    # A new engine over the same fs root: it computed none of the blocks it loads.
    with EngineCore(_config(tmp_path, cpu_blocks=16, fs=True, **kw)) as second:
        assert second.wait_for_tiers_ready(30)
        assert _workload(second) == expected
        stats = second.stats
        assert stats.tokens_from_secondary > 0 and stats.blocks_loaded_verified > 0
        assert stats.blocks_recomputed_for_check > 0 and stats.verification_failures == 0


def test_the_transformer_config_names_its_geometry_and_model() -> None:
    config = EngineConfig.for_transformer("tiny")
    assert config.model is ModelKind.TRANSFORMER
    assert (config.num_layers, config.num_kv_heads, config.head_size) == (2, 2, 16)
    assert config.model_name == "kv-offload-llama-tiny-seed0"
    assert EngineConfig().model_name == "kv-offload-stand-in"
    with pytest.raises(ValueError, match="preset 'small' has 8 layers per group"):
        EngineConfig(model="transformer", model_preset="small")
    with pytest.raises(ValueError, match="one worker rank"):
        EngineConfig.for_transformer("tiny", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="unknown model preset"):
        EngineConfig.for_transformer("huge")
