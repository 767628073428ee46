# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The scheduler side of the offloading connector, driven by whole engine steps.

Every test runs the real engine core (scheduler, GPU block pool, model stand-in, worker ranks)
with the real connector and a real manager; transfer handlers are the real CPU ones, wrapped in
``ChaosHandler`` where a test needs late or failing transfers.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from tests.v1.kv_connector.unit.offloading_connector.scheduler_harness import (
    ScriptedSpec,
    make_request,
    request_states,
)
from tests.v1.kv_connector.unit.offloading_connector.utils import (
    Chaos,
    TransferLog,
    capture_metadata,
    chaos_factory,
    cpu_ref_counts,
    keys_in_cpu,
    make_config,
    mark_forward,
    random_tokens,
    run_multi_turn,
    spy_on_manager,
    with_handlers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus


def _keys_of_tokens(tokens: list[int], engine: EngineCore) -> list[OffloadKey]:
    """Group-0 offload keys of the full 16-token blocks of ``tokens``."""
    from vllm.v1.core.kv_cache_utils import NONE_HASH, hash_block_tokens

    keys = []
    parent = NONE_HASH
    for start in range(0, len(tokens) - 15, 16):
        parent = hash_block_tokens(parent, tokens[start : start + 16])
        keys.append(make_offload_key(parent, 0))
    return keys


def _capture_reports(engine: EngineCore) -> list[int]:
    """Record the ids of the jobs the workers report (done or failed), as the connector sees
    them, in order."""
    sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
    reported: list[int] = []
    original = sched.update_connector_output

    def tap(output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, OffloadingWorkerMetadata):
            reported.extend(sorted(meta.completed_jobs.keys() | meta.failed_jobs.keys()))
        original(output)

    sched.update_connector_output = tap  # type: ignore[method-assign]
    return reported


def _capture_allocations(engine: EngineCore) -> list[set[int]]:
    """Per ``build_connector_meta`` call, the group-0 GPU block ids the step's scheduler output
    gives to requests (all blocks of newly scheduled requests, new blocks of running ones)."""
    sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
    allocated: list[set[int]] = []
    original = sched.build_connector_meta

    def tap(scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        blocks = {b for r in scheduler_output.scheduled_new_reqs for b in r.block_ids[0]}
        for new_ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if new_ids is not None:
                blocks.update(new_ids[0])
        allocated.append(blocks)
        return original(scheduler_output)

    sched.build_connector_meta = tap  # type: ignore[method-assign]
    return allocated


# ---------------------------------------------------------------------------------------------
# Stores
# ---------------------------------------------------------------------------------------------


class SelectiveManager(CPUOffloadingManager):
    """A real CPU manager that stores only keys with an even first byte, and refuses (None) the
    first ``refuse`` calls; records every call's keys."""

    def __init__(self, num_blocks: int, refuse: int = 0) -> None:
        super().__init__(num_blocks)
        self.offered: list[list[OffloadKey]] = []
        self.selected: list[list[OffloadKey]] = []
        self.refuse = refuse

    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self.offered.append(list(keys))
        if self.refuse:
            self.refuse -= 1
            return None
        output = super().prepare_store([k for k in keys if k[0] % 2 == 0], req_context)
        assert output is not None
        self.selected.append(list(output.keys_to_store))
        return output


def test_only_blocks_prepare_store_selects_are_stored(tmp_path: Path) -> None:
    with EngineCore(make_config(tmp_path)) as engine:
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        manager = SelectiveManager(sched.manager.num_blocks, refuse=1)  # type: ignore[attr-defined]
        sched.manager = manager
        metas = capture_metadata(engine)
        prompt = random_tokens(random.Random(1), 160)
        engine.generate({"a": prompt}, max_tokens=4)

        keys = _keys_of_tokens(prompt, engine)
        assert len(keys) == 10
        # The first offer was refused (None): the same blocks were offered again next step.
        assert manager.offered[0] == manager.offered[1] == keys
        wanted = [k for k in keys if k[0] % 2 == 0]
        assert manager.selected[0] == wanted
        stored = set(keys_in_cpu(engine))
        assert stored == set(wanted)
        # One job, moving exactly the selected blocks (GPU ids of their positions).
        store_jobs = [job for m in metas for job in m.store_jobs.values()]
        assert len(store_jobs) == (1 if wanted else 0)
        gpu_spec, cpu_spec = store_jobs[0].transfer_spec
        assert len(gpu_spec.block_ids) == len(cpu_spec.block_ids) == len(wanted)  # type: ignore[attr-defined]
        # Later offers with nothing new to store create no job.
        assert all(not m.store_jobs for m in metas[2:])
        assert engine.stats.verification_failures == 0
        assert engine.connector_stats()["deferred_stores"] == 1


def test_store_jobs_cover_newly_full_blocks_once(tmp_path: Path) -> None:
    """Chunked prefill and decode: every full block is offered exactly once, when it fills."""
    with EngineCore(make_config(tmp_path, max_num_batched_tokens=40)) as engine:
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        calls: list[list[OffloadKey]] = []
        original = sched.manager.prepare_store

        def prepare_store(keys: Collection[OffloadKey], ctx: ReqContext) -> Any:
            calls.append(list(keys))
            return original(keys, ctx)

        sched.manager.prepare_store = prepare_store  # type: ignore[method-assign]
        prompt = random_tokens(random.Random(2), 100)
        out = engine.generate({"a": prompt}, max_tokens=30)
        tokens = prompt + out["a"]
        keys = _keys_of_tokens(tokens[: len(tokens) - 1], engine)
        offered = [k for call in calls for k in call]
        assert offered == keys  # in order, no repeats, each once its block is computed
        # 40-token chunks: blocks become full at tokens 40 (2), 80 (5), 100 (6), then decode.
        assert [len(c) for c in calls[:3]] == [2, 3, 1]


# ---------------------------------------------------------------------------------------------
# Loads and their ordering
# ---------------------------------------------------------------------------------------------


def test_load_runs_before_forward_after_deferred_stores(tmp_path: Path) -> None:
    log = TransferLog()
    config = make_config(tmp_path)
    with EngineCore(with_handlers(config, chaos_factory(log=log))) as engine:
        mark_forward(engine, log)
        metas = capture_metadata(engine)
        rng = random.Random(3)
        prompt = random_tokens(rng, 64)
        engine.generate({"a": prompt}, max_tokens=2)
        engine.kv_cache_manager.reset_prefix_cache()  # GPU only: the CPU tier keeps the blocks
        engine.add_request("b", prompt + random_tokens(rng, 20), 3)
        engine.add_request("c", random_tokens(rng, 40), 20)
        engine.run_until_done()

        stats = engine.stats
        assert stats.tokens_from_cpu == 64 and stats.blocks_loaded_verified == 4
        assert stats.verification_failures == 0

        # Map each job to the step whose metadata created it.
        created = {}
        for step, meta in enumerate(metas):
            for job_id in (*meta.load_jobs, *meta.store_jobs):
                created[job_id] = step
        position = {}
        forward_at = {}
        for i, (event, _, _, job) in enumerate(log.entries):
            if event == "forward":
                forward_at[job] = i
            elif event == "submit":
                position[job] = i
        loads = [j for m in metas for j in m.load_jobs]
        stores = [j for m in metas for j in m.store_jobs]
        assert len(loads) == 1
        for job in loads:  # submitted in its own step, before that step's forward
            assert position[job] < forward_at[created[job]]
            assert created[job] == 0 or position[job] > forward_at[created[job] - 1]
        for job in stores:  # deferred: submitted at the start of the next step
            assert forward_at[created[job]] < position[job] < forward_at[created[job] + 1]
        # In a step, the previous step's stores are submitted before this step's loads.
        for load in loads:
            for store in stores:
                if created[store] == created[load] - 1:
                    assert position[store] < position[load]


@contextlib.contextmanager
def _cpu_only_prompt(
    tmp_path: Path, delay_polls: int, seed: int, num_tokens: int
) -> Iterator[tuple[EngineCore, list[int]]]:
    """An engine whose transfers each take ``delay_polls`` polls, and a prompt of
    ``num_tokens`` random tokens (from ``seed``) whose blocks only the CPU tier holds: computed
    once, then dropped from the GPU prefix cache."""
    factory = chaos_factory(Chaos(min_delay_polls=delay_polls, max_delay_polls=delay_polls))
    with EngineCore(with_handlers(make_config(tmp_path), factory)) as engine:
        prompt = random_tokens(random.Random(seed), num_tokens)
        engine.generate({"warm": prompt}, max_tokens=1)
        engine.kv_cache_manager.reset_prefix_cache()
        yield engine, prompt


def test_concurrent_lookups_of_the_same_prefix(tmp_path: Path) -> None:
    with _cpu_only_prompt(tmp_path, delay_polls=3, seed=4, num_tokens=96) as (engine, prompt):
        engine.add_request("a", [*prompt, 1, 2, 3], 2)
        engine.add_request("b", [*prompt, 4, 5, 6], 2)
        engine.step()
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        requests = {r.request_id: r for r in engine.iter_requests()}
        assert requests["a"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert requests["b"].status is RequestStatus.WAITING  # its hits are being loaded
        assert sched.get_stats()["deferred_lookups"] >= 1
        engine.run_until_done()
        stats = engine.stats
        assert sched.get_stats()["load_jobs"] == 1
        # b's lookup was deferred every step a's load ran (3 polls): one request, counted once,
        # as waiting for a transfer (its blocks were found; they were being moved), not as a
        # lookup no tier could answer.
        assert sched.get_stats()["deferred_lookups"] >= 2
        assert sched.get_stats()["transfer_wait_requests"] == 1
        assert sched.get_stats()["deferred_lookup_requests"] == 0
        assert stats.tokens_from_cpu == 96
        assert stats.tokens_from_gpu_cache == 96  # b reused a's loaded blocks
        assert stats.verification_failures == 0


def test_abort_while_loading_keeps_blocks_until_the_load_is_reported(tmp_path: Path) -> None:
    with _cpu_only_prompt(tmp_path, delay_polls=4, seed=5, num_tokens=80) as (engine, prompt):
        pool = engine.kv_cache_manager.pools[0]
        free_before = pool.num_free_blocks
        metas = capture_metadata(engine)
        engine.add_request("a", [*prompt, 7], 2)
        engine.step()
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        assert sched.get_stats()["jobs_in_flight"] == 1
        (load_job,) = metas[-1].load_jobs
        keys = _keys_of_tokens(prompt, engine)
        assert all(cpu_ref_counts(engine)[k] == 1 for k in keys)  # pinned by the load
        outputs = engine.step() if engine.abort_request("a") else []
        # Aborted, but the load still writes its GPU blocks: they stay allocated.
        assert any(o.request_id == "a" and o.finish_reason == "abort" for o in outputs)
        assert pool.num_free_blocks == free_before - 5  # 80 tokens to load, nothing else yet
        engine.run_until_done()
        # Loads are never fenced: no worker was told to wait for the load of the aborted request.
        assert not any(load_job in m.jobs_to_flush for m in metas)
        assert pool.num_free_blocks == free_before
        assert all(cpu_ref_counts(engine)[k] == 0 for k in keys)
        assert not sched.tracks_request("a")
        # The blocks are intact: a new request loads and verifies them.
        out = engine.generate({"b": [*prompt, 8]}, max_tokens=2)
        assert len(out["b"]) == 2
        assert engine.stats.blocks_loaded_verified >= 5
        assert engine.stats.verification_failures == 0


# ---------------------------------------------------------------------------------------------
# Preemption and fencing
# ---------------------------------------------------------------------------------------------


def _preempting_workload(engine: EngineCore) -> dict[str, list[int]]:
    return run_multi_turn(
        engine, seed=6, num_sessions=4, turns=3, first_prompt=90, user_tokens=30, max_tokens=20
    )


@pytest.mark.parametrize("flush", [True, False], ids=["flush", "no_flush_control"])
def test_preemption_flushes_pending_stores(
    tmp_path: Path, flush: bool, scheduling_mode: str
) -> None:
    log = TransferLog()
    # Under async scheduling fewer preempted requests have a store pending (a request's blocks
    # fill a step later): a smaller pool and later stores make the negative control bite.
    delay, gpu_blocks = (8, 20) if scheduling_mode == "async" else (2, 24)
    factory = chaos_factory(Chaos(min_delay_polls=delay, max_delay_polls=delay), log=log)
    config = make_config(tmp_path, num_gpu_blocks=gpu_blocks, cpu_blocks=256)
    with EngineCore(with_handlers(config, factory)) as engine:
        metas = capture_metadata(engine)
        mark_forward(engine, log)
        if not flush:
            # Negative control: without the flush, a store reads blocks already overwritten.
            for worker in engine.workers:
                worker.connector.connector_worker.handle_preemptions = lambda meta: None  # type: ignore[union-attr,method-assign]
        _preempting_workload(engine)
        stats = engine.stats
        assert stats.preemptions > 0
        flushed = {j for m in metas for j in m.jobs_to_flush}
        assert flushed
        if flush:
            assert stats.verification_failures == 0
            assert stats.blocks_loaded_verified > 0
            # A flushed job still pending is waited for right before the forward of the step
            # that flushes it (the first forward after the wait is that step's).
            waits = 0
            for i, (event, _, _, job) in enumerate(log.entries):
                if event == "wait":
                    waits += 1
                    step = next(e[3] for e in log.entries[i:] if e[0] == "forward")
                    assert job in metas[step].jobs_to_flush
            assert waits > 0
        else:
            assert stats.verification_failures > 0


def test_fence_flushes_a_finished_requests_store_when_its_block_is_reused(
    tmp_path: Path,
) -> None:
    log = TransferLog()
    factory = chaos_factory(Chaos(min_delay_polls=1000, max_delay_polls=1000), log=log)
    config = make_config(tmp_path, num_gpu_blocks=9, max_num_seqs=2)
    with EngineCore(with_handlers(config, factory)) as engine:
        metas = capture_metadata(engine)
        allocated = _capture_allocations(engine)
        mark_forward(engine, log)
        rng = random.Random(7)
        a_prompt = random_tokens(rng, 100)  # 7 blocks: 6 full + 4 tokens
        engine.add_request("b", random_tokens(rng, 31), 40)  # 2 blocks, grows to 5
        engine.add_request("a", a_prompt, 1)
        engine.step()  # both prefill; a finishes; its store job stays pending
        a_job = next(j for j, job in metas[0].store_jobs.items() if job.req_id == "a")
        gpu_spec = metas[0].store_jobs[a_job].transfer_spec[0]
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        a_blocks = set(gpu_spec.block_ids.tolist())
        assert len(a_blocks) == 6
        engine.run_until_done()
        # b's new blocks came from a's freed ones (last block first): the first block the job
        # reads that was reallocated triggered the flush, in that very step, and no other did.
        reuse_steps = [i for i, blocks in enumerate(allocated) if i > 0 and blocks & a_blocks]
        flush_steps = [i for i, m in enumerate(metas) if a_job in m.jobs_to_flush]
        assert reuse_steps and flush_steps == reuse_steps[:1]
        waits = [i for i, e in enumerate(log.entries) if e == ("wait", 0, "GPU_to_CPU", a_job)]
        forwards = [
            i for i, e in enumerate(log.entries) if e[0] == "forward" and e[3] == flush_steps[0]
        ]
        assert waits and forwards and waits[0] < forwards[0]
        # a's offloaded blocks hold a's bytes: reload them and verify.
        engine.kv_cache_manager.reset_prefix_cache()
        engine.generate({"a2": [*a_prompt[:96], 1]}, max_tokens=1)
        assert engine.stats.blocks_loaded_verified == 6
        assert engine.stats.verification_failures == 0


def test_fence_at_update_state_after_alloc(tmp_path: Path) -> None:
    factory = chaos_factory(Chaos(min_delay_polls=1000, max_delay_polls=1000))
    config = make_config(tmp_path, num_gpu_blocks=8, max_num_seqs=1)
    with EngineCore(with_handlers(config, factory)) as engine:
        metas = capture_metadata(engine)
        rng = random.Random(8)
        engine.add_request("a", random_tokens(rng, 64), 1)  # 5 blocks, 4 stored
        while engine.has_unfinished_requests():
            engine.step()
        a_jobs = {j for m in metas for j in m.store_jobs}
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        assert a_jobs and sched.get_stats()["jobs_in_flight"] == len(a_jobs)  # all pending
        assert not any(m.jobs_to_flush for m in metas)
        # b needs 7 of the 8 blocks: it is allocated some of a's, when it is placed.
        engine.add_request("b", random_tokens(rng, 100), 1)
        engine.step()
        assert a_jobs <= metas[-1].jobs_to_flush
        assert "b" in metas[-1].store_jobs[max(metas[-1].store_jobs)].req_id
        engine.run_until_done()
        assert engine.stats.verification_failures == 0


# ---------------------------------------------------------------------------------------------
# Lifecycle: on_schedule_end, events, reset, pending work
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", ["cpu", "fs"])
def test_on_schedule_end_once_per_build_connector_meta(tmp_path: Path, tiers: str) -> None:
    config = make_config(tmp_path, num_gpu_blocks=32, cpu_blocks=24, fs=tiers == "fs")
    with EngineCore(with_handlers(config, chaos_factory(Chaos(max_delay_polls=2)))) as engine:
        log = spy_on_manager(engine)
        run_multi_turn(engine, seed=9, num_sessions=4, turns=3)
        for _ in range(3):  # idle steps drain events only
            assert engine.step() == []
        builds = 0
        span: list[str] | None = None
        kind = ""
        for entry in log:
            if entry.startswith("<"):
                assert span is None, "connector calls do not nest"
                span, kind = [], entry[1:]
            elif entry.endswith(">"):
                assert span is not None
                if kind == "build_connector_meta":
                    builds += 1
                    assert span.count("on_schedule_end") == 1
                    assert span[-1] == "on_schedule_end", span
                else:
                    assert span == ["take_events"], span
                span = None
            else:
                assert entry != "on_schedule_end" or (span is not None and kind != "take_events")
                if span is not None:
                    span.append(entry)
        assert builds == engine.stats.steps == log.count("on_schedule_end")
        assert log.count("<take_events") >= 2 * engine.stats.steps + 3
        assert engine.stats.verification_failures == 0


def test_reset_cache_flushes_in_flight_jobs_and_ignores_their_completions(
    tmp_path: Path,
) -> None:
    factory = chaos_factory(Chaos(min_delay_polls=3, max_delay_polls=3))
    with EngineCore(with_handlers(make_config(tmp_path), factory)) as engine:
        metas = capture_metadata(engine)
        reported = _capture_reports(engine)
        rng = random.Random(10)
        prompt = random_tokens(rng, 96)
        engine.add_request("a", prompt, 12)
        while not metas or not any(m.store_jobs for m in metas):
            engine.step()
        engine.step()
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        created = {j for m in metas for j in (*m.load_jobs, *m.store_jobs)}
        in_flight = created - set(reported)
        assert in_flight and len(in_flight) == sched.get_stats()["jobs_in_flight"]
        assert keys_in_cpu(engine)
        engine.reset_prefix_cache()
        assert not keys_in_cpu(engine)
        engine.step()
        assert in_flight <= metas[-1].jobs_to_flush
        # "a" offers every block again, from its first one, in the step after the reset.
        (a_store,) = (job for job in metas[-1].store_jobs.values() if job.req_id == "a")
        gpu_spec = a_store.transfer_spec[0]
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        assert gpu_spec.block_indices == (0,) and len(gpu_spec.block_ids) == 6
        engine.run_until_done()
        assert sched.get_stats()["stale_completions"] >= len(in_flight)
        # "a" offered its blocks again after the reset: they are back in the CPU tier.
        assert set(_keys_of_tokens(prompt, engine)) <= keys_in_cpu(engine)
        engine.kv_cache_manager.reset_prefix_cache()
        engine.generate({"b": [*prompt, 3]}, max_tokens=1)
        assert engine.stats.blocks_loaded_verified == 6
        assert engine.stats.verification_failures == 0


def test_no_lookup_until_every_pre_reset_job_is_reported(tmp_path: Path) -> None:
    """After a reset, lookups (which can start promotions into freshly freed rows that a
    pre-reset copy still touches) wait until every worker reported every pre-reset job."""
    factory = chaos_factory(Chaos(min_delay_polls=3, max_delay_polls=3))
    with EngineCore(with_handlers(make_config(tmp_path, fs=True), factory)) as engine:
        metas = capture_metadata(engine)
        rng = random.Random(12)
        first = random_tokens(rng, 96)
        engine.generate({"a": first}, max_tokens=1)  # in the CPU tier and written to disk
        engine.kv_cache_manager.reset_prefix_cache()
        metas.clear()
        engine.add_request("b", random_tokens(rng, 96), 12)
        while not any(m.store_jobs for m in metas):
            engine.step()
        engine.step()
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        assert sched.has_pending_work()
        engine.reset_prefix_cache()  # b's stores are still running on the (delayed) workers
        log = spy_on_manager(engine)
        engine.add_request("c", [*first, 7], 1)  # its prefix is on disk
        engine.step()  # the step that flushes b's pre-reset jobs
        assert not {"lookup", "lookup_prefix"} & set(log)
        assert sched.get_stats()["lookups_skipped_after_reset"] >= 1
        engine.run_until_done()
        assert not sched.has_pending_work()  # which counts pre-reset jobs not yet reported
        # Every pre-reset job was reported: lookups (and promotions from disk) are back.
        engine.kv_cache_manager.reset_prefix_cache()
        engine.generate({"d": [*first, 9]}, max_tokens=1)
        assert "lookup_prefix" in log  # the connector scans a full-attention prefix in one call
        assert engine.stats.blocks_loaded_verified > 0
        assert engine.stats.verification_failures == 0


def test_engine_keeps_stepping_until_cascades_finish(tmp_path: Path) -> None:
    config = make_config(tmp_path, cpu_blocks=64, fs=True)
    with EngineCore(config) as engine:
        rng = random.Random(11)
        for i in range(3):
            engine.add_request(f"r{i}", random_tokens(rng, 80), 2)
        while engine.has_unfinished_requests():
            engine.step()
        # No request left, but stores and cascades to the fs tier are in flight.
        assert engine.has_pending_work()
        steps_before = engine.stats.steps
        engine.run_until_done()
        assert engine.stats.steps > steps_before
        assert engine.stats.idle_steps > 0
        manager = engine.connector.connector_scheduler.manager  # type: ignore[union-attr]
        assert manager.num_jobs_in_flight == 0  # type: ignore[attr-defined]
        assert not manager.has_pending_work()
        assert all(ref == 0 for ref in cpu_ref_counts(engine).values())
        files = list((tmp_path / "fs").rglob("*.bin"))
        assert len(files) == len(keys_in_cpu(engine)) == 15


def test_events_decode_with_hashes_and_medium(tmp_path: Path) -> None:
    from tests.v1.kv_connector.unit.offloading_connector.utils import EventCollector, iter_events
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    collector = EventCollector()
    config = make_config(tmp_path, cpu_blocks=12)
    with EngineCore(config, event_sink=collector) as engine:
        rng = random.Random(12)
        prompts = {f"r{i}": random_tokens(rng, 100) for i in range(3)}
        engine.generate(prompts, max_tokens=3)
        expected = {
            get_offload_block_hash(k) for p in prompts.values() for k in _keys_of_tokens(p, engine)
        }
        stored: set[bytes] = set()
        removed: set[bytes] = set()
        for event in iter_events(collector):
            assert isinstance(event, (BlockStored, BlockRemoved))
            assert event.medium in ("CPU", "GPU") and event.group_idx == 0
            if event.medium == "GPU":  # the engine's prefix cache (tests/v1/engine)
                continue
            if isinstance(event, BlockStored):
                assert event.block_size == 16
                assert set(event.block_hashes) <= expected
                stored.update(event.block_hashes)
            else:
                assert set(event.block_hashes) <= stored
                removed.update(event.block_hashes)
        assert stored == expected  # every offloaded block was announced
        assert removed  # 18 blocks for 12 rows: evictions
        resident = {get_offload_block_hash(k) for k in keys_in_cpu(engine)}
        assert stored - removed == resident
        assert all(b.ts > 0 for b in collector.batches())


# ---------------------------------------------------------------------------------------------
# Lookups, on a scripted manager (no engine)
# ---------------------------------------------------------------------------------------------


class ScriptedManager(OffloadingManager):
    """Answers lookups from ``results`` (default False) and records every call."""

    def __init__(self) -> None:
        self.results: dict[OffloadKey, bool | None] = {}
        self.lookups: list[OffloadKey] = []
        self.touched: list[list[OffloadKey]] = []
        self.loaded: list[list[OffloadKey]] = []

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        self.lookups.append(key)
        return self.results.get(key, False)

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        self.loaded.append(list(keys))
        return CPULoadStoreSpec(list(range(len(keys))))

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.touched.append(list(keys))

    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return PrepareStoreOutput(list(keys), CPULoadStoreSpec(list(range(len(keys)))))

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


def _scheduler(
    block_sizes: tuple[int, ...] = (16,), block_size: int | None = None
) -> tuple[OffloadingConnectorScheduler, ScriptedManager]:
    manager = ScriptedManager()
    return OffloadingConnectorScheduler(ScriptedSpec(manager, block_sizes, block_size)), manager


@pytest.mark.parametrize(
    ("script", "expected", "num_lookups"),
    [
        ([True, True, True], 3, 3),
        ([True, False, True], 1, 2),
        ([False], 0, 1),
        ([True, None, True, False, True], None, 4),  # a None stops nothing: scan to the miss
        ([None, False], None, 2),
        ([], 0, 0),
    ],
)
def test_lookups_scan_the_prefix_up_to_the_first_miss(
    script: list[bool | None], expected: int | None, num_lookups: int
) -> None:
    """``expected``: blocks before the first miss, None if one of them is not readable yet."""
    sched, manager = _scheduler()
    request = make_request(16 * len(script) + 1)  # len(script) full blocks
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    manager.results = dict(zip(keys, script, strict=True))
    if expected is None:
        answer: tuple[int | None, bool] = (None, False)
    else:
        answer = (16 * expected, expected > 0)
    assert sched.get_num_new_matched_tokens(request, 0) == answer
    assert manager.lookups == keys[:num_lookups]


@pytest.mark.parametrize("promoting", [False, True], ids=["tier-not-answered", "promotion"])
def test_a_deferred_lookup_counts_as_a_lookup_or_as_a_transfer_wait(promoting: bool) -> None:
    """A "not yet" for a key no tier has answered for is a deferred lookup; for a key being
    promoted (``promotion_source`` names the tier) the request waits for a transfer."""
    sched, manager = _scheduler()
    if promoting:
        manager.promotion_source = lambda key: "fs"  # type: ignore[method-assign]
    request = make_request(16 * 2 + 1)
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    manager.results = {keys[0]: True, keys[1]: None}
    for _ in range(2):  # deferred twice: the request counts once
        assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    stats = sched.get_stats()
    assert stats["deferred_lookups"] == 2
    assert stats["deferred_lookup_requests"] == (0 if promoting else 1)
    assert stats["transfer_wait_requests"] == (1 if promoting else 0)


def test_get_num_new_matched_tokens() -> None:
    sched, manager = _scheduler()
    request = make_request(100)  # 6 full blocks
    keys = [make_offload_key(h, 0) for h in request.block_hashes]
    # Less than one block beyond what the GPU prefix cache serves: no lookup, no touch.
    assert sched.get_num_new_matched_tokens(request, 96 - 15) == (0, False)
    assert not manager.lookups and not manager.touched
    # Misses from the start.
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert manager.touched == [keys]
    # Four hits after 16 local tokens: 64 tokens to load, asynchronously.
    manager.results.update(dict.fromkeys(keys[:5], True))
    manager.lookups.clear()
    assert sched.get_num_new_matched_tokens(request, 16) == (64, True)
    assert manager.lookups == keys[1:6]
    # A block not readable yet: ask again next step.
    manager.results[keys[2]] = None
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)


def test_a_key_noted_without_a_tier_is_forgotten_once_readable_or_absent() -> None:
    """A lookup answering "not readable yet" for a key with no named tier (a tier's probe in
    flight) only makes it a candidate; readable or absent later with no tier named, it is not
    a promoted block (a store from the GPU may have made it readable). A named tier sticks."""
    sched, manager = _scheduler()
    sources: dict[OffloadKey, str] = {}
    manager.promotion_source = sources.get  # type: ignore[method-assign]
    request = make_request(49)  # 3 full blocks
    k0, k1, k2 = (make_offload_key(h, 0) for h in request.block_hashes)
    manager.results = {k0: None, k1: None, k2: None}
    sources[k1] = "redis"
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    # The notes are the state of a lookup that has not loaded yet: no public view of them.
    promoted = request_states(sched)[request.request_id].promoted_keys
    assert promoted == {k0: None, k1: "redis", k2: None}
    # The next step: k0 and k1 are readable, k2 absent; only k1 came from a named tier.
    manager.results = {k0: True, k1: True, k2: False}
    del sources[k1]  # its promotion finished
    assert sched.get_num_new_matched_tokens(request, 0) == (32, True)
    assert promoted == {k1: "redis"}


def test_lookup_of_a_second_group_stops_at_the_first_groups_hits() -> None:
    sched, manager = _scheduler(block_sizes=(8, 16))
    request = make_request(80, hash_block_size=8)  # 5 offloaded blocks of 16 tokens
    g0 = [make_offload_key(h, 0) for h in request.block_hashes[1::2]]
    g1 = [make_offload_key(h, 1) for h in request.block_hashes[1::2]]
    manager.results.update(dict.fromkeys(g0[:3] + g1, True))
    assert sched.get_num_new_matched_tokens(request, 0) == (48, True)
    assert manager.lookups == g0[:4] + g1[:3]


def test_load_job_specs_are_group_major_with_block_indices() -> None:
    sched, manager = _scheduler(block_sizes=(8, 16), block_size=32)
    request = make_request(130, hash_block_size=8)  # 4 offloaded blocks of 32 tokens
    keys = [[make_offload_key(h, g) for h in request.block_hashes[3::4]] for g in (0, 1)]
    manager.results.update(dict.fromkeys(keys[0] + keys[1], True))
    # 16 tokens served by the GPU prefix cache: the first offloaded block is loaded in part.
    assert sched.get_num_new_matched_tokens(request, 16) == (112, True)
    blocks = (list(range(100, 117)), list(range(200, 209)))  # 130 tokens of 8 and 16
    sched.update_state_after_alloc(request, blocks, 112)
    meta = sched.build_connector_meta(
        SchedulerOutput(
            scheduled_new_reqs=[],
            num_scheduled_tokens={},
        )
    )
    (job,) = meta.load_jobs.values()
    cpu_spec, gpu_spec = job.transfer_spec
    assert manager.loaded == [keys[0] + keys[1]]
    assert isinstance(gpu_spec, GPULoadStoreSpec)
    assert gpu_spec.group_sizes == (14, 7)  # tokens 16..128 in blocks of 8 and 16
    assert gpu_spec.block_indices == (2, 1)
    assert gpu_spec.block_ids.tolist() == list(range(102, 116)) + list(range(201, 208))
    assert len(cpu_spec.block_ids) == 8  # type: ignore[attr-defined]
    assert not meta.jobs_to_flush


def test_request_id_is_not_reused_while_its_transfers_run(tmp_path: Path) -> None:
    factory = chaos_factory(Chaos(min_delay_polls=4, max_delay_polls=4))
    with EngineCore(with_handlers(make_config(tmp_path), factory)) as engine:
        rng = random.Random(13)
        engine.add_request("a", random_tokens(rng, 96), 1)
        while engine.has_unfinished_requests():
            engine.step()
        sched = engine.connector.connector_scheduler  # type: ignore[union-attr]
        assert sched.get_stats()["jobs_in_flight"] > 0, "a's stores should still be in flight"
        assert sched.tracks_request("a")
        with pytest.raises(ValueError, match="still in use"):
            engine.add_request("a", random_tokens(rng, 40), 1)
        engine.run_until_done()
        assert not sched.tracks_request("a")
        engine.generate({"a": random_tokens(rng, 40)}, max_tokens=1)  # the id is free again
        with pytest.raises(ValueError, match="live request"):
            engine.add_request("b", random_tokens(rng, 40), 4)
            engine.add_request("b", random_tokens(rng, 40), 4)
