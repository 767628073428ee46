# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The ``OffloadingConnector`` facade, and the whole stack end to end.

End to end: a multi-turn workload through the real engine core, connector, CPU tier and fs tier.
Every block loaded into the GPU pool is checked bit-exact against what recomputation writes, and
the outputs must equal those of a run without offloading, including under preemption, failed
transfers, randomly delayed transfers and block files that vanish from disk.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.offloading_connector.utils import (
    Chaos,
    ChaosHandler,
    EventCollector,
    HandlerWrapper,
    baseline,
    chaos_factory,
    cpu_ref_counts,
    iter_events,
    keys_in_cpu,
    make_config,
    random_tokens,
    run_multi_turn,
    with_handlers,
)
from vllm.distributed.kv_events import BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.model import KVLayout
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec
from vllm.v1.kv_offload.spec import WorkerHandlers


def _assert_clean_end(engine: EngineCore) -> None:
    """Nothing in flight, nothing pinned, every check passed."""
    assert not engine.has_pending_work()
    sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
    # A job leaves the fence index and the keys-being-loaded index when it is reported
    # (test_transfer_jobs.py): none left, none indexed.
    assert sched.get_stats()["jobs_in_flight"] == 0
    assert all(ref == 0 for ref in cpu_ref_counts(engine).values())
    assert engine.stats.verification_failures == 0
    stats = engine.stats
    assert stats.prompt_tokens == (
        stats.tokens_from_gpu_cache
        + stats.tokens_from_cpu
        + stats.tokens_from_secondary
        + stats.prompt_tokens_computed
    )


def test_facade_selects_its_half_by_role(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with EngineCore(config) as engine:
        scheduler_side = engine.connector
        assert scheduler_side is not None and scheduler_side.role is KVConnectorRole.SCHEDULER
        with pytest.raises(RuntimeError, match="worker-side call on a scheduler connector"):
            scheduler_side.start_load_kv()
        worker_side = engine.workers[0].connector
        assert worker_side is not None and worker_side.role is KVConnectorRole.WORKER
        with pytest.raises(RuntimeError, match="scheduler-side call on a worker connector"):
            worker_side.build_connector_meta(None)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="no connector metadata is bound"):
            worker_side.start_load_kv()
        with pytest.raises(TypeError, match=r"bind_connector_metadata: metadata is object"):
            worker_side.bind_connector_metadata(object())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"handle_preemptions: metadata is NoneType"):
            worker_side.handle_preemptions(None)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="no connector metadata is bound"):
            worker_side.start_load_kv()  # the refused binding bound nothing
        worker_side.bind_connector_metadata(OffloadingConnectorMetadata())
        worker_side.wait_for_layer_load("model.layers.g0.0.attn")
        worker_side.save_kv_layer("model.layers.g0.0.attn")
        worker_side.clear_connector_metadata()
        assert scheduler_side.request_finished(_request("never-seen")) == (False, None)


def _request(req_id: str) -> Any:
    from vllm.v1.request import Request

    return Request(req_id, [1, 2, 3], 1)


def test_create_spec_rejects_a_bad_extra_config(tmp_path: Path) -> None:
    with EngineCore(make_config(tmp_path)) as engine:
        run = engine.run_info()
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        OffloadingConnector.create_spec({}, run)
    with pytest.raises(ValueError, match="unknown key"):
        OffloadingConnector.create_spec({"cpu_bytes_to_use": 1 << 20, "cpu_byte": 1}, run)


def _workload(seed: int, turns: int = 3, sessions: int = 6) -> Any:
    def run(engine: EngineCore) -> dict[str, list[int]]:
        return run_multi_turn(engine, seed=seed, num_sessions=sessions, turns=turns)

    return run


@pytest.mark.parametrize(
    "overrides",
    [
        dict(kv_layout=KVLayout.PER_LAYER),
        dict(kv_layout=KVLayout.PER_LAYER_BLOCKS_FIRST, tensor_parallel_size=2),
        dict(kv_layout=KVLayout.CROSS_LAYER),
        dict(gpu_block_sizes=(8, 16)),
        dict(gpu_block_sizes=(8, 16), block_size=32),
    ],
    ids=["per_layer", "blocks_first_tp2", "cross_layer", "two_groups", "two_groups_factor"],
)
def test_multi_turn_through_the_cpu_tier_is_bit_exact(
    tmp_path: Path, overrides: dict[str, Any]
) -> None:
    extra = {"block_size": overrides.pop("block_size")} if "block_size" in overrides else None
    geometry = dict(num_gpu_blocks=40, **overrides)
    expected = baseline(tmp_path, _workload(13), **geometry)
    collector = EventCollector()
    config = make_config(tmp_path, cpu_blocks=48, extra=extra, **geometry)
    with EngineCore(config, event_sink=collector) as engine:
        assert _workload(13)(engine) == expected
        stats = engine.stats
        assert stats.tokens_from_cpu > 0 and stats.blocks_loaded_verified > 0
        _assert_clean_end(engine)
        groups = {
            e.group_idx
            for e in iter_events(collector)
            if isinstance(e, BlockStored) and e.medium == "CPU"
        }
        assert groups == set(range(len(config.gpu_block_sizes)))


@pytest.mark.parametrize("prompt_only", [False, True])
def test_offload_prompt_only_stores_no_block_of_generated_tokens(
    tmp_path: Path, prompt_only: bool
) -> None:
    # 16-token blocks: a 32-token prompt fills 2 blocks; 40 generated tokens fill 2 more (the
    # last token of a request is never computed, so 71 of its 72 tokens have KV).
    extra = {"offload_prompt_only": prompt_only}
    prompt = random_tokens(random.Random(5), 32)
    with EngineCore(make_config(tmp_path, cpu_blocks=16, extra=extra)) as engine:
        engine.generate({"r": prompt}, max_tokens=40)
        assert engine.connector is not None
        assert engine.connector.connector_scheduler.offload_prompt_only is prompt_only
        assert len(keys_in_cpu(engine)) == (2 if prompt_only else 4)
        _assert_clean_end(engine)


def _every(n: int) -> Callable[[int], bool]:
    """A ``fail_job`` rule failing the 1st, (n+1)th, (2n+1)th ... job submitted to a handler."""
    count = itertools.count()
    return lambda job_id: next(count) % n == 0


def _chaos_with_failures(seed: int) -> HandlerWrapper:
    """Delays of up to 3 polls, 5 % random failures per rank, plus, whatever the timing, every
    3rd load failing on rank 0 only and every 4th store failing on rank 1 only."""

    def wrap(real: WorkerHandlers, rank: int) -> WorkerHandlers:
        rng = random.Random(seed * 10 + rank)
        wrapped = []
        for src, dst, handler in real.registrations:
            is_load = src is CPULoadStoreSpec
            rule = _every(3) if (is_load and rank == 0) else None
            if not is_load and rank == 1:
                rule = _every(4)
            chaos = Chaos(max_delay_polls=3, failure_rate=0.05, fail_job=rule)
            wrapped.append((src, dst, ChaosHandler(handler, rng, rank, chaos)))
        real.registrations = wrapped
        return real

    return wrap


def _settle_secondary_tiers_after_every_step(engine: EngineCore) -> None:
    """Make each step end with the fs tier's lookups resolved and its I/O finished.

    Which step sees a tier's answer would otherwise depend on its threads' timing, and with it
    the schedule (and whether this workload preempts). The transfers themselves still run on
    the tier's threads, and GPU <-> CPU copies keep their seeded random delays.
    """
    tiers = engine.connector.connector_scheduler.manager.secondary_tiers  # type: ignore[union-attr]
    step = engine.step

    def settled_step() -> list[Any]:
        outputs = step()
        for tier in tiers:
            assert tier.wait_lookups_idle(30), "fs tier lookups did not finish"
            tier.drain_jobs()
        return outputs

    engine.step = settled_step  # type: ignore[method-assign]


@pytest.mark.slow
def test_multi_turn_through_cpu_and_fs_tiers_under_chaos(tmp_path: Path) -> None:
    """Preemption, failed transfers, delays of up to 3 steps, 2 ranks, vanishing block files."""
    geometry: dict[str, Any] = dict(num_gpu_blocks=24, tensor_parallel_size=2)
    rng = random.Random(14)

    def delete_some_files(engine: EngineCore, turn: int) -> None:
        files = sorted((tmp_path / "fs").rglob("*.bin"))
        for path in rng.sample(files, len(files) // 4):
            path.unlink()

    def workload(engine: EngineCore, between: Any = None) -> dict[str, list[int]]:
        return run_multi_turn(
            engine, seed=14, num_sessions=6, turns=4, max_tokens=16, between_turns=between
        )

    expected = baseline(tmp_path, workload, **geometry)
    config = make_config(tmp_path, cpu_blocks=20, fs=True, **geometry)
    with EngineCore(with_handlers(config, _chaos_with_failures(14))) as engine:
        _settle_secondary_tiers_after_every_step(engine)
        assert workload(engine, delete_some_files) == expected
        stats = engine.stats
        connector = engine.connector_stats()
        assert stats.preemptions > 0
        # How many loaded tokens were promoted first depends on the fs tier's I/O timing.
        assert stats.tokens_from_cpu + stats.tokens_from_secondary > 0
        assert stats.blocks_loaded_verified > 0
        assert connector["failed_load_jobs"] > 0 and connector["failed_store_jobs"] > 0
        assert stats.tokens_load_failed > 0
        assert connector["manager.tiering_promotions_submitted"] > 0
        _assert_clean_end(engine)


def test_a_load_failed_on_one_rank_only_is_recomputed(tmp_path: Path) -> None:
    """Rank 0 fails the load at once; rank 1 succeeds two steps later: the failure is kept
    until the load is finished on both ranks, then the blocks are recomputed."""

    def wrap(real: WorkerHandlers, rank: int) -> WorkerHandlers:
        wrapped = []
        for src, dst, handler in real.registrations:
            if src is CPULoadStoreSpec:  # loads only
                handler = ChaosHandler(
                    handler,
                    random.Random(rank),
                    rank,
                    Chaos(
                        fail_job=(lambda job_id: True) if rank == 0 else None,
                        min_delay_polls=0 if rank == 0 else 2,
                    ),
                )
            wrapped.append((src, dst, handler))
        real.registrations = wrapped
        return real

    prompt = [random.Random(15).randrange(1000) for _ in range(80)]
    config = make_config(tmp_path, tensor_parallel_size=2)
    with EngineCore(with_handlers(config, wrap)) as engine:
        expected = engine.generate({"warm": prompt}, 3)["warm"]
        engine.kv_cache_manager.reset_prefix_cache()
        assert engine.generate({"again": prompt}, 3)["again"] == expected
        stats = engine.stats
        assert engine.connector_stats()["failed_load_jobs"] == 1
        assert stats.tokens_load_failed == 80 and stats.tokens_from_cpu == 0
        assert stats.blocks_loaded_verified == 0
        _assert_clean_end(engine)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_random_configurations_under_chaos(tmp_path: Path, seed: int) -> None:
    """Random geometry, batching, tiers, delays and failure rates; resets and vanishing files
    between turns. Outputs must match the baseline and every loaded block must verify."""
    rng = random.Random(seed)
    geometry: dict[str, Any] = dict(
        num_gpu_blocks=rng.choice([20, 24, 30, 40]),
        tensor_parallel_size=rng.choice([1, 2]),
        max_num_seqs=rng.choice([2, 4, 6]),
        max_num_batched_tokens=rng.choice([64, 128, 512]),
        gpu_block_sizes=rng.choice([(16,), (8, 16)]),
    )
    # A sliding window for the second group, from its own generator so that the other draws
    # (and thus the configurations of the seeds) stay what they were without it.
    if len(geometry["gpu_block_sizes"]) == 2:
        geometry["sliding_windows"] = random.Random(seed + 205).choice([(), (None, 24), (None, 40)])
    fs = rng.random() < 0.5
    extra = {"block_size": 32} if rng.random() < 0.3 else None
    events = random.Random(seed + 100)

    def between(engine: EngineCore, turn: int) -> None:
        if fs and events.random() < 0.5:
            files = sorted((tmp_path / "fs").rglob("*.bin"))
            for path in events.sample(files, len(files) // 3):
                path.unlink()
        if events.random() < 0.2:
            engine.reset_prefix_cache()

    def workload(engine: EngineCore, hook: Any = None) -> dict[str, list[int]]:
        return run_multi_turn(
            engine, seed=seed, num_sessions=5, turns=3, max_tokens=12, between_turns=hook
        )

    expected = baseline(tmp_path, workload, **geometry)
    config = make_config(
        tmp_path, cpu_blocks=rng.choice([8, 16, 32, 64]), fs=fs, extra=extra, **geometry
    )
    factory = chaos_factory(
        Chaos(max_delay_polls=rng.choice([0, 2, 5]), failure_rate=rng.choice([0.0, 0.05, 0.2])),
        seed=seed,
    )
    with EngineCore(with_handlers(config, factory)) as engine:
        assert workload(engine, between) == expected
        _assert_clean_end(engine)
