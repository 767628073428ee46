# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``EngineCore``: the synchronous step loop.

One ``step()``::

    scheduler.schedule()              connector: get_num_new_matched_tokens,
                                      update_state_after_alloc, build_connector_meta, take_events
    worker.execute_model(...)         per rank: handle_preemptions, start_load_kv, forward,
                                      wait_for_save, get_finished, build_connector_worker_meta
    aggregate the ranks' outputs      a load is finished once every rank reported it; job
                                      counts are summed
    oracle.record_step(...)           digests of the blocks the step computed (no check)
    scheduler.update_from_output(...) connector: update_connector_output, request_finished,
                                      take_events

With ``async_scheduling`` one step stays in flight, as in vLLM's async scheduling: ``step()``
schedules step N+1 and runs it on the ranks *before* it applies step N's output, so the scheduler
(and the connector's ``build_connector_meta``) never sees the newest completions. The ranks know
the tokens they sampled; the scheduler counts them as output placeholders until they arrive.

The engine keeps stepping while requests are unfinished or the connector has transfers in flight
(``has_pending_work``), so cascades to slower tiers complete even after the last request. A loop
that drives the engine waits ``IDLE_POLL_S`` after a step that computed no token (only transfers or
lookups pending; ``step_or_wait``): stepping on at once would re-run the waiting requests' lookups
back to back with the GIL held, and the tiers' I/O threads, which need the GIL between their system
calls, would move a block every few switch intervals (an fs hit of 512 blocks took 4.5 s instead of
0.1 s so).

The bit-exact check of KV blocks is split in two (``verification.py``): the steps only record
digests; ``verify_kv()`` compares them, after the part of a run that is timed (``run_until_done``
calls it at its end).

The engine sets torch's intra-op threads when it starts (``EngineConfig.intra_op_threads``,
process-wide).

The API is synchronous (``add_request`` / ``abort_request`` / ``step``) so that an asyncio front
end can drive it from one task. KV events (the GPU prefix cache's, then the connector's) are
handed to ``event_sink``, one ``KVEventBatch`` per drain that found any (an ``EventPublisher``'s
``publish`` is such a sink; it stamps the instance's ``data_parallel_rank``).

Example::

    with EngineCore(EngineConfig(kv_connector_extra_config={"cpu_bytes_to_use": 1 << 28})) as e:
        e.add_request("r0", prompt_token_ids=list(range(100)), max_tokens=8)
        outputs = e.run_until_done()
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import torch
from typing_extensions import override

from vllm.distributed.kv_events import KVCacheEvent, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    KVTransferConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.utils.closing import ClosingContextManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.kv_cache_manager import KVCacheManager
from vllm.v1.engine.model_runner import ModelKind
from vllm.v1.engine.scheduler import ModelRunnerOutput, RequestOutput, Scheduler
from vllm.v1.engine.stats import EngineStats, StepRecord
from vllm.v1.engine.verification import BlockKey, KVOracle, VerificationResult, VerifyMode
from vllm.v1.engine.worker import Worker, WorkerOutput
from vllm.v1.kv_offload.base import TierStats
from vllm.v1.kv_offload.spec import KVCacheRunInfo
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

IDLE_POLL_S: Final = 0.001
"""How long a loop driving ``step()`` waits after a step that computed no token (module
docstring): ``EngineCore.step_or_wait``, and ``AsyncLLM``'s engine thread (which waits for its
next command that long)."""


def freeze_gc_heap() -> None:
    """Move every object alive now out of the garbage collector's sight (``gc.freeze()``).

    Called once start-up is over, as vLLM's engine core does: the start-up heap (the CPU tier's
    row status objects and tables among it) is static, and without the freeze every full
    collection while serving traverses all of it. Garbage is collected first, since frozen
    objects are never collected. The collector itself stays enabled.
    """
    gc.collect()
    gc.freeze()


def _connector_extra_config(config: EngineConfig) -> Mapping[str, Any]:
    """The connector's ``kv_connector_extra_config``, with the load guard off by default for
    the hash stand-in.

    The stand-in computes almost nothing (its prefill is free by design, for fast tests), so
    the guard would find every load slower than recomputing and skip the hits the tests and
    ``run --model hash`` are about. A config that sets ``load_guard`` is passed unchanged.
    """
    extra = config.kv_connector_extra_config
    assert extra is not None
    if (
        config.model is ModelKind.HASH
        and config.kv_connector == "OffloadingConnector"
        and config.kv_connector_module_path is None
        and "load_guard" not in extra
    ):
        return {**extra, "load_guard": False}
    return extra


class KVOutputAggregator:
    """Combines the ranks' connector outputs of each step.

    A request's load is finished once every rank reported it (ranks may report in different
    steps); failed block ids and job counts are combined as they come.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._recv_counts: dict[str, int] = {}

    def aggregate(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput:
        """Aggregate one step's outputs (one per rank)."""
        out = KVConnectorOutput()
        meta: KVConnectorWorkerMetadata | None = None
        for rank_out in outputs:
            if rank_out is None:
                continue
            for req_id in rank_out.finished_recving:
                count = self._recv_counts.get(req_id, 0) + 1
                if count == self.world_size:
                    self._recv_counts.pop(req_id, None)
                    out.finished_recving.add(req_id)
                else:
                    self._recv_counts[req_id] = count
            for group, ids in rank_out.invalid_block_ids.items():
                out.invalid_block_ids.setdefault(group, set()).update(ids)
            rank_stats = rank_out.kv_connector_stats
            if rank_stats is not None:
                out.kv_connector_stats = (
                    rank_stats
                    if out.kv_connector_stats is None
                    else out.kv_connector_stats.aggregate(rank_stats)
                )
            rank_meta = rank_out.kv_connector_worker_meta
            if rank_meta is not None:
                meta = rank_meta if meta is None else meta.aggregate(rank_meta)
        out.kv_connector_worker_meta = meta
        return out


class EngineCore(ClosingContextManager):
    """The engine: scheduler, GPU block pool, worker ranks and the KV connector.

    Args:
        config: the engine's settings. ``kv_connector`` (default: the offloading connector; an
            out-of-tree one: with ``kv_connector_module_path``) is built for each role by
            ``KVConnectorFactory``, with ``kv_connector_extra_config``. For the offloading
            connector that config selects the offloading spec, which builds both the
            scheduler-side manager and each rank's transfer handlers (an out-of-tree spec:
            ``spec_name`` + ``spec_module_path``).
        event_sink: receives each ``KVEventBatch`` on the engine thread; must not block (e.g.
            ``EventPublisher.publish``, which encodes and sends on its own thread).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        event_sink: Callable[[KVEventBatch], None] | None = None,
    ) -> None:
        self.config = config
        self.stats = EngineStats()
        self._hash_block_size = config.effective_hash_block_size
        self._block_hasher = get_request_block_hasher(self._hash_block_size)
        self._event_sink = event_sink
        self._step_index = 0
        self._closed = False
        # Receives the connector's stats of every step (engine thread), e.g. an exporter.
        self.kv_connector_stats_sink: Callable[[KVConnectorStats], None] | None = None
        # The connector's stats collected by the latest step() (None: it collected nothing), for
        # a step callback that wants this step's figures without asking the tiers again.
        self.step_kv_connector_stats: KVConnectorStats | None = None

        if config.intra_op_threads:
            torch.set_num_threads(config.intra_op_threads)
        # The connector, as the engine knows it: KVConnectorBase_V1 (built by the factory from
        # the class KVTransferConfig names), one instance per role.
        self.kv_transfer_config: KVTransferConfig | None = None
        self.connector: KVConnectorBase_V1 | None = None
        self.workers: list[Worker] = []
        run = self.run_info()
        try:
            if config.kv_connector_extra_config is not None:
                self.kv_transfer_config = KVTransferConfig(
                    kv_connector=config.kv_connector,
                    kv_connector_module_path=config.kv_connector_module_path,
                    kv_connector_extra_config=_connector_extra_config(config),
                    hash_block_size=self._hash_block_size,
                    enable_kv_events=config.enable_kv_events,
                    record_block_origins=config.record_block_origins,
                )
                # The scheduler side first: a tiering spec creates the shared region here.
                self.connector = KVConnectorFactory.create_connector(
                    self.kv_transfer_config, KVConnectorRole.SCHEDULER, run
                )
                if config.record_block_origins:
                    self.stats.served_not_stored_here = {}
            for rank in range(config.tensor_parallel_size):
                self.workers.append(Worker(config, rank, self.kv_transfer_config, run))
        except BaseException:
            self.shutdown()
            raise
        self.oracle: KVOracle | None = None
        if config.verify is not VerifyMode.NONE:
            self.oracle = KVOracle(
                config.verify,
                [w.runner for w in self.workers],
                config.gpu_block_sizes,
                self._hash_block_size,
            )
        self.kv_cache_manager = KVCacheManager(
            config.num_gpu_blocks,
            config.gpu_block_sizes,
            self._hash_block_size,
            config.enable_prefix_caching,
            config.sliding_windows,
            enable_kv_cache_events=config.enable_kv_events,
        )
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.connector,
            self.stats,
            oracle=self.oracle,
            event_sink=self._publish_events if config.enable_kv_events else None,
            max_model_len=config.max_model_len,
            async_scheduling=config.async_scheduling,
        )
        # Async scheduling: the step executed but not applied yet (its output and the ranks'
        # raw outputs), applied by the next step().
        self._in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self._aggregator = KVOutputAggregator(config.tensor_parallel_size)
        if config.freeze_gc_heap:
            freeze_gc_heap()

    def run_info(self) -> KVCacheRunInfo:
        """The facts of this run that define an offloaded block's bytes."""
        c = self.config
        group_bytes = tuple(c.num_layers * c.gpu_page_bytes(g) for g in range(c.num_groups))
        kv_bytes = sum(group_bytes)
        return KVCacheRunInfo(
            model_name=c.model_name,
            dtype=c.dtype,
            kv_layout=c.kv_layout.value,
            num_layers=c.num_layers * c.num_groups,
            num_kv_heads=c.num_kv_heads,
            head_size=c.head_size,
            gpu_block_sizes=c.gpu_block_sizes,
            gpu_kv_bytes_per_block=kv_bytes,
            tensor_parallel_size=c.tensor_parallel_size,
            instance_id=c.instance_id,
            sliding_windows=c.sliding_windows,
            group_kv_bytes_per_block=group_bytes,
        )

    # -----------------------------------------------------------------------------------------
    # Requests
    # -----------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request; it is scheduled by the following steps."""
        self.scheduler.add_request(
            Request(
                request_id,
                prompt_token_ids,
                max_tokens,
                block_hasher=self._block_hasher,
                kv_transfer_params=kv_transfer_params,
            )
        )

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (its output is reported finished by the next step)."""
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished_requests()

    def has_pending_work(self) -> bool:
        """Whether ``step()`` has anything to do: requests, transfers to finish, or a step in
        flight to apply."""
        return self._in_flight is not None or self.scheduler.has_pending_work()

    # -----------------------------------------------------------------------------------------
    # Stepping
    # -----------------------------------------------------------------------------------------

    def step_or_wait(self) -> list[RequestOutput]:
        """``step()``, then, if the step computed no token (only transfers or lookups pending),
        wait ``IDLE_POLL_S`` before returning: what a loop driving the engine calls instead of
        ``step()`` (module docstring)."""
        idle_before = self.stats.idle_steps
        outputs = self.step()
        if self.stats.idle_steps > idle_before:
            start = time.perf_counter()
            time.sleep(IDLE_POLL_S)
            self.stats.idle_wait_seconds += time.perf_counter() - start
        return outputs

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns what each request produced in it.

        When there is nothing to do it only drains KV events (idle) and returns ``[]``.
        """
        assert not self._closed, "the engine is shut down"
        self.step_kv_connector_stats = None
        scheduler = self.scheduler
        if not scheduler.has_pending_work():
            if self._in_flight is not None:
                # Nothing new to schedule: only apply the step in flight.
                results = scheduler.update_from_output(*self._take_in_flight())
                self._emit_kv_connector_stats()
                return results
            pending = scheduler.take_outputs()
            scheduler.drain_events()
            return pending
        scheduler.step_connector_seconds = 0.0
        scheduler.step_connector_cpu_seconds = 0.0

        scheduler_output = scheduler.schedule()
        outputs: list[WorkerOutput] = [w.execute_model(scheduler_output) for w in self.workers]
        kv_output = (
            self._aggregator.aggregate([o.kv_connector_output for o in outputs])
            if self.connector is not None
            else None
        )
        model_output = ModelRunnerOutput(
            sampled_token_ids=outputs[0].sampled_token_ids, kv_connector_output=kv_output
        )
        if self.oracle is not None and scheduler_output.total_num_scheduled_tokens:
            # Before the output is applied: finishing requests still hold their blocks.
            kv = self.kv_cache_manager
            self.oracle.record_step(
                scheduler_output,
                {r: kv.get_block_ids(r) for r in scheduler_output.num_scheduled_tokens},
                scheduler.requests,
            )
        if self.config.async_scheduling:
            # Apply the previous step only now: this step was scheduled without its output.
            previous = self._take_in_flight() if self._in_flight is not None else None
            self._in_flight = (scheduler_output, model_output)
            if previous is not None:
                results = scheduler.update_from_output(*previous)
            else:
                results = scheduler.take_outputs()
        else:
            results = scheduler.update_from_output(scheduler_output, model_output)

        stats = self.stats
        stats.steps += 1
        if scheduler_output.total_num_scheduled_tokens == 0:
            stats.idle_steps += 1
        connector_s = scheduler.step_connector_seconds
        connector_cpu_s = scheduler.step_connector_cpu_seconds
        worker_s = sum(o.connector_seconds for o in outputs)
        worker_cpu_s = sum(o.connector_cpu_seconds for o in outputs)
        if self.connector is not None:
            # The collection is connector work of this step too: timed like the hooks, and
            # observed after it, so this step's sample is in the next collection.
            collect_s, collect_cpu_s = self._emit_kv_connector_stats()
            connector_s += collect_s
            connector_cpu_s += collect_cpu_s
            self.connector.observe_step(connector_s, connector_cpu_s)
        stats.connector_seconds += connector_s
        stats.worker_connector_seconds += worker_s
        if self.config.record_steps:
            meta = kv_output.kv_connector_worker_meta if kv_output is not None else None
            moved = dict(meta.bytes_moved()) if meta is not None else {}
            stats.step_records.append(
                StepRecord(
                    step=self._step_index,
                    end_time=time.monotonic(),
                    num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
                    num_running=len(scheduler.running),
                    num_waiting=len(scheduler.waiting),
                    connector_seconds=connector_s,
                    connector_cpu_seconds=connector_cpu_s,
                    worker_connector_seconds=worker_s,
                    worker_connector_cpu_seconds=worker_cpu_s,
                    bytes_moved=moved,
                )
            )
        self._step_index += 1
        return results

    def _take_in_flight(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        assert self._in_flight is not None
        in_flight, self._in_flight = self._in_flight, None
        return in_flight

    def _emit_kv_connector_stats(self) -> tuple[float, float]:
        """Collect the connector's stats (once per step, as vLLM's scheduler does, so that
        nothing accumulates between collections) and hand them to the sink; return the
        collection's wall and thread CPU seconds (the sink's time excluded)."""
        if self.connector is None:
            return 0.0, 0.0
        start, start_cpu = time.perf_counter(), time.thread_time()
        kv_stats = self.connector.get_kv_connector_stats()
        elapsed = time.perf_counter() - start, time.thread_time() - start_cpu
        self.step_kv_connector_stats = kv_stats
        if kv_stats is not None and self.kv_connector_stats_sink is not None:
            self.kv_connector_stats_sink(kv_stats)
        return elapsed

    def run_until_done(self, max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Step until no request is unfinished and no transfer is in flight, then check what the
        oracle recorded (``verify_kv``; its results are in ``stats``).

        Returns:
            The tokens generated per request during these steps.

        Raises:
            RuntimeError: still busy after ``max_steps`` steps.
        """
        generated: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.has_pending_work():
                for out in self.scheduler.take_outputs():
                    generated.setdefault(out.request_id, []).extend(out.new_token_ids)
                self.verify_kv()
                return generated
            for out in self.step_or_wait():
                generated.setdefault(out.request_id, []).extend(out.new_token_ids)
        raise RuntimeError(f"the engine is still busy after {max_steps} steps")

    def generate(
        self, prompts: Mapping[str, Sequence[int]], max_tokens: int
    ) -> dict[str, list[int]]:
        """Add ``prompts`` (by request id) and run until done; returns their outputs."""
        for req_id, prompt in prompts.items():
            self.add_request(req_id, prompt, max_tokens)
        outputs = self.run_until_done()
        return {req_id: outputs.get(req_id, []) for req_id in prompts}

    def reset_prefix_cache(self) -> None:
        """Drop the GPU prefix cache and everything offloaded (between steps)."""
        self.scheduler.reset_prefix_cache()

    # -----------------------------------------------------------------------------------------
    # Stats, events, verification
    # -----------------------------------------------------------------------------------------

    def connector_stats(self) -> dict[str, int | float]:
        """The connector's and manager's counters (empty without offloading)."""
        return self.connector.get_stats() if self.connector is not None else {}

    def tier_stats(self) -> list[TierStats]:
        """Point-in-time reports of the secondary tiers, in lookup order (empty without
        offloading or secondary tiers; see ``OffloadingSpec.get_tier_stats``)."""
        return self.connector.get_tier_stats() if self.connector is not None else []

    def wait_for_tiers_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the secondary tiers finished their start-up work (e.g. the fs tier's scan
        of what is already on disk); False if ``timeout_s`` expired first. For reports, before
        the first request; True without offloading."""
        if self.connector is None:
            return True
        return self.connector.wait_for_tiers_ready(timeout_s)

    def _publish_events(self, events: list[KVCacheEvent]) -> None:
        self.stats.events_published += 1
        if self._event_sink is not None:
            self._event_sink(KVEventBatch(ts=time.time(), events=events))  # type: ignore[arg-type]

    def verify_kv(self, reference: Mapping[BlockKey, bytes] | None = None) -> VerificationResult:
        """Check every block the oracle recorded since the last call (between steps; off the
        step path). Adds the results to ``stats`` (``blocks_verified``, ``blocks_loaded_verified``,
        ``verification_failures``, ``verify_seconds``).

        Args:
            reference: digests of blocks computed elsewhere, e.g. a baseline engine's
                ``computed_block_digests()``: they are the preferred reference.

        Returns:
            What this call checked (empty with ``VerifyMode.NONE``).
        """
        if self.oracle is None:
            return VerificationResult()
        result = self.oracle.check(reference)
        stats = self.stats
        stats.blocks_verified += result.blocks_checked + result.computed_checked
        stats.blocks_loaded_verified += result.loaded_checked
        stats.verification_failures += result.mismatched
        stats.blocks_recomputed_for_check += result.recomputed
        stats.verify_seconds += result.seconds
        return result

    def computed_block_digests(self) -> dict[BlockKey, bytes]:
        """Digests of every block this engine computed (empty with ``VerifyMode.NONE``): the
        reference another engine's ``verify_kv`` takes."""
        return {} if self.oracle is None else self.oracle.computed_digests()

    # -----------------------------------------------------------------------------------------
    # Lifecycle
    # -----------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Shut the workers' connectors down, then the scheduler side (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for worker in self.workers:
            try:
                worker.shutdown()
            except Exception as e:
                errors.append(e)
        if self.connector is not None:
            try:
                self.connector.shutdown()
            except Exception as e:
                errors.append(e)
        if errors:
            raise errors[0]

    @override
    def _release(self) -> None:
        self.shutdown()

    def iter_requests(self) -> Iterable[Request]:
        """Every unfinished request (read-only use)."""
        return self.scheduler.iter_requests()
