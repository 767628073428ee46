# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine core: step loop, verification, accounting, events and ranks."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from tests.v1.kv_connector.unit.offloading_connector.slow_tier import SLOW_TIER
from tests.v1.kv_connector.unit.offloading_connector.utils import make_config
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import IDLE_POLL_S, EngineCore, KVOutputAggregator
from vllm.v1.engine.stats import RequestTimes
from vllm.v1.outputs import KVConnectorOutput

SMALL = dict(num_layers=1, num_kv_heads=2, head_size=8)


def test_verification_catches_a_corrupted_cached_block() -> None:
    # "all" records every block of a finishing request: b's copy of the block differs from what
    # a computed.
    with EngineCore(EngineConfig(verify="all", **SMALL)) as engine:
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


def test_a_request_waiting_on_a_tier_is_polled_not_spun(tmp_path: Path) -> None:
    # While a request waits for its blocks to come from a slow tier, generate() steps the
    # engine without computing: each such step is followed by IDLE_POLL_S of waiting, so that
    # the tiers' threads get the CPU and the GIL (spinning made thousands of steps a second).
    config = make_config(
        tmp_path,
        extra={
            "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": SLOW_TIER, "load_delay_s": 0.2}],
        },
    )
    with EngineCore(config) as engine:
        prompt = list(range(1000, 1128))
        engine.generate({"a": prompt}, 1)
        engine.reset_prefix_cache()  # the CPU tier too: the hit comes from the slow tier
        idle_before = engine.stats.idle_steps
        slept_before = engine.stats.idle_wait_seconds
        start = time.perf_counter()
        engine.generate({"b": prompt}, 1)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        assert engine.stats.tokens_from_secondary > 0
        idle = engine.stats.idle_steps - idle_before
        assert elapsed_ms >= 200  # the load waited out its delay
        assert 0 < idle <= elapsed_ms / (IDLE_POLL_S * 1e3)
        # Each idle step's wait is counted as the engine's sleep between steps.
        slept_ms = (engine.stats.idle_wait_seconds - slept_before) * 1e3
        assert idle * IDLE_POLL_S * 1e3 <= slept_ms <= elapsed_ms


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


def _offload_config(tmp_path: Path, async_scheduling: bool, **kw: object) -> EngineConfig:
    extra = {"cpu_bytes_to_use": 1 << 22, "shared_region_dir": str(tmp_path)}
    settings: dict = dict(SMALL, max_num_seqs=4, max_num_batched_tokens=64)
    settings.update(kw)
    return EngineConfig(
        kv_connector_extra_config=extra, async_scheduling=async_scheduling, **settings
    )


def test_async_scheduling_applies_each_step_after_the_next_is_scheduled(tmp_path: Path) -> None:
    with EngineCore(_offload_config(tmp_path, True)) as engine:
        assert engine.connector is not None
        sched = engine.connector.connector_scheduler
        calls: list[str] = []
        build, update = sched.build_connector_meta, sched.update_connector_output
        sched.build_connector_meta = lambda so: (calls.append("b"), build(so))[1]  # type: ignore[method-assign]
        sched.update_connector_output = lambda o: (calls.append("u"), update(o))[1]  # type: ignore[method-assign]
        engine.add_request("a", list(range(40)), 3)
        assert engine.step() == [] and calls == ["b"]  # step 0 in flight, nothing applied
        engine.step()
        assert calls == ["b", "b", "u"]  # step 1 scheduled before step 0's output was applied
        outputs = engine.run_until_done()
        assert calls[-1] == "u" and calls.count("b") == calls.count("u") == engine.stats.steps
        assert engine.connector_stats()["schedule_ends"] == engine.stats.steps
        assert len(outputs["a"]) == 2  # the first token came with step 1's call
        assert not engine.has_pending_work()


def test_async_scheduling_serves_what_sync_does_through_preemptions_and_aborts(
    tmp_path: Path,
) -> None:
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(500) for _ in range(40 + 7 * i)] for i in range(6)}
    results = {}
    for mode in (False, True):
        with EngineCore(_offload_config(tmp_path, mode, num_gpu_blocks=12)) as e:
            out = e.generate(prompts, 30)
            assert e.stats.preemptions > 0
            # Requests finishing (aborted) while a step of theirs is in flight.
            for req_id, prompt in prompts.items():
                e.add_request(f"{req_id}-again", prompt, 20)
            generated: dict[str, list[int]] = {}
            for _ in range(6):
                for o in e.step():
                    generated.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert e.abort_request("r0-again") and e.abort_request("r5-again")
            for req_id, tokens in e.run_until_done().items():
                generated.setdefault(req_id, []).extend(tokens)
            assert e.stats.verification_failures == 0 and e.stats.blocks_loaded_verified > 0
            assert e.connector_stats()["schedule_ends"] == e.stats.steps
            assert e.connector_stats()["jobs_in_flight"] == 0
            assert not any(e.connector.connector_scheduler.tracks_request(r) for r in generated)  # type: ignore[union-attr]
            del generated["r0-again"], generated["r5-again"]
            results[mode] = (out, generated)
    assert results[True] == results[False]


def test_ttft_parts_add_up_and_show_a_load(tmp_path: Path) -> None:
    # A first request computes its prompt; after the GPU prefix cache is dropped, a second one
    # with the same prompt loads it from the CPU tier: its TTFT has a loading part.
    extra = {"cpu_bytes_to_use": 1 << 20, "shared_region_dir": str(tmp_path)}
    with EngineCore(EngineConfig(kv_connector_extra_config=extra, **SMALL)) as engine:
        prompt = list(range(64))
        engine.generate({"a": prompt}, 2)
        engine.kv_cache_manager.reset_prefix_cache()
        engine.generate({"b": prompt}, 2)
        assert engine.stats.tokens_from_cpu > 0
        (_, lookup_a, loading_a, prefill_a), (_, _, loading_b, prefill_b) = engine.stats.ttft_parts
        assert lookup_a == loading_a == 0.0 and prefill_a > 0
        assert loading_b > 0 and prefill_b > 0
        assert all(part >= 0 for parts in engine.stats.ttft_parts for part in parts)


def test_request_times_split_ttft_into_parts_that_add_up() -> None:
    # Arrived at 1.0, deferred by a lookup at 1.5 until 2.0, placed at 2.25, loaded at 3.0,
    # first token at 4.0.
    times = RequestTimes(arrival=1.0, deferred=1.5, answered=2.0, placed=2.25, loaded=3.0)
    assert times.parts(4.0) == (0.75, 0.5, 0.75, 1.0)
    # Never deferred, no load: waiting for a slot, then prefill.
    assert RequestTimes(arrival=1.0, placed=1.5).parts(2.0) == (0.5, 0.0, 0.0, 0.5)
