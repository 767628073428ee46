# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine's scheduler without a connector: batching, chunked prefill, preemption, abort."""

from __future__ import annotations

import random

import pytest

from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore

SMALL = dict(num_layers=1, num_kv_heads=1, head_size=8)


def _prompts(n: int, length: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(1000) for _ in range(length + i)] for i in range(n)}


def test_chunked_prefill_respects_the_token_budget_and_seat_limit() -> None:
    config = EngineConfig(max_num_batched_tokens=50, max_num_seqs=2, **SMALL)
    with EngineCore(config) as engine:
        for req_id, prompt in _prompts(3, 70).items():
            engine.add_request(req_id, prompt, 3)
        engine.step()
        record = engine.stats.step_records[-1]
        assert record.num_scheduled_tokens == 50 and record.num_running == 1
        engine.step()
        assert engine.stats.step_records[-1].num_scheduled_tokens == 50
        assert len(engine.scheduler.running) == 2  # the seat limit holds the third back
        engine.run_until_done()
        assert engine.stats.requests_finished == 3 and engine.stats.output_tokens == 9
        assert engine.stats.tokens_computed == sum(70 + i + 2 for i in range(3))


def test_preemption_recomputes_and_outputs_do_not_change() -> None:
    prompts = _prompts(4, 60, seed=1)
    with EngineCore(EngineConfig(num_gpu_blocks=256, **SMALL)) as roomy:
        expected = roomy.generate(prompts, 40)
        assert roomy.stats.preemptions == 0
    with EngineCore(EngineConfig(num_gpu_blocks=14, **SMALL)) as tight:
        assert tight.generate(prompts, 40) == expected
        assert tight.stats.preemptions > 0
        assert tight.stats.verification_failures == 0
        assert tight.kv_cache_manager.pools[0].num_free_blocks == 14


def test_abort_frees_blocks_and_reports_the_request_finished() -> None:
    with EngineCore(EngineConfig(max_num_seqs=1, **SMALL)) as engine:
        engine.add_request("running", list(range(40)), 50)
        engine.add_request("waiting", list(range(100, 140)), 50)
        engine.step()
        assert engine.abort_request("running") and engine.abort_request("waiting")
        assert not engine.abort_request("waiting")  # already finished
        assert not engine.abort_request("unknown")
        outputs = {o.request_id: o for o in engine.step()}
        assert {k: (o.finished, o.finish_reason) for k, o in outputs.items()} == {
            "running": (True, "abort"),
            "waiting": (True, "abort"),
        }
        assert engine.kv_cache_manager.pools[0].num_free_blocks == 256
        assert engine.stats.requests_aborted == 2 and not engine.has_pending_work()


def test_requests_stop_at_max_model_len() -> None:
    with EngineCore(EngineConfig(num_gpu_blocks=8, **SMALL)) as engine:  # 128 tokens
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request("huge", list(range(128)), 1)
        out = engine.generate({"r": list(range(100))}, max_tokens=1000)
        assert len(out["r"]) == 28
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=1)
