"""The engine core: step loop, verification, accounting, events and ranks."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore, KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput

SMALL = dict(num_layers=1, num_kv_heads=2, head_size=8)


def test_verification_catches_a_corrupted_cached_block() -> None:
    with EngineCore(EngineConfig(**SMALL)) as engine:
        prompt = list(range(64))
        engine.generate({"a": prompt}, 1)
        (block,) = [b for b in engine.kv_cache_manager.pools[0].blocks if b.block_hash][:1]
        engine.workers[0].kv_caches[0].tensors[0][0, block.block_id, 3] += 1.0
        engine.generate({"b": [*prompt, 5]}, 1)  # hits the corrupted block
        assert engine.stats.tokens_from_gpu_cache == 64
        assert engine.stats.verification_failures == 1


def test_idle_steps_do_nothing_but_drain_events(tmp_path: Path) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "shared_region_dir": str(tmp_path)}
    with EngineCore(EngineConfig(kv_connector_extra_config=extra, **SMALL)) as engine:
        assert engine.step() == [] and engine.stats.steps == 0
        engine.generate({"a": list(range(50))}, 2)
        steps = engine.stats.steps
        ends = engine.connector_stats()["schedule_ends"]
        for _ in range(3):
            assert engine.step() == []
        assert engine.stats.steps == steps and engine.connector_stats()["schedule_ends"] == ends


def test_ranks_hold_different_bytes_and_agree_on_outputs(tmp_path: Path) -> None:
    prompts = {f"r{i}": [random.Random(i).randrange(500) for _ in range(70)] for i in range(3)}
    with EngineCore(EngineConfig(**SMALL)) as one:
        expected = one.generate(prompts, 5)
    with EngineCore(EngineConfig(tensor_parallel_size=2, **SMALL)) as two:
        assert two.generate(prompts, 5) == expected
        a, b = (w.kv_caches[0].tensors[0] for w in two.workers)
        assert not torch.equal(a, b)
        assert two.stats.verification_failures == 0


def test_token_accounting_balances() -> None:
    with EngineCore(EngineConfig(num_gpu_blocks=32, **SMALL)) as engine:
        shared = list(range(48))
        engine.generate({"a": [*shared, 1, 2, 3]}, 4)
        engine.generate({"b": [*shared, 7, 8]}, 4)
        stats = engine.stats
        assert stats.tokens_from_gpu_cache == 48
        assert stats.prompt_tokens == 51 + 50
        assert stats.prompt_tokens_computed == 51 + 2
        assert stats.tokens_computed == stats.prompt_tokens_computed + 2 * 3


def test_aggregator_finishes_a_load_once_every_rank_reported_it() -> None:
    aggregator = KVOutputAggregator(world_size=2)
    first = aggregator.aggregate(
        [KVConnectorOutput(finished_recving={"a", "b"}, invalid_block_ids={0: {3}}), None]
    )
    assert first.finished_recving == set() and first.invalid_block_ids == {0: {3}}
    second = aggregator.aggregate(
        [KVConnectorOutput(), KVConnectorOutput(finished_recving={"a", "b"})]
    )
    assert second.finished_recving == {"a", "b"}
