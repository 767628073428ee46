# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine's scheduler: waiting queue, running batch, chunked prefill, preemption.

It calls the KV connector in vLLM's order::

    schedule():
        for each running request: allocate its new tokens' blocks (preempting from the tail of
            the running list when blocks run out)
        for each waiting request (only if nothing was preempted this step):
            kv_cache_manager.get_computed_blocks        # GPU prefix cache
            connector.get_num_new_matched_tokens        # offloaded prefix
            kv_cache_manager.allocate_slots
            connector.update_state_after_alloc
        connector.build_connector_meta(scheduler_output)
        connector.take_events()
    update_from_output():
        connector.update_connector_output(kv_connector_output)
        finished loads: the request becomes schedulable (failed blocks are recomputed)
        sampled tokens; finished requests -> connector.request_finished, then blocks freed
        connector.take_events()

A request whose connector load is in flight is in ``WAITING_FOR_REMOTE_KVS`` and keeps its GPU
blocks until the workers report the load, even if it is aborted meanwhile.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from typing_extensions import ParamSpec

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, PromotedBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.engine.kv_cache_manager import KVCacheManager
from vllm.v1.engine.load_accounting import (
    account_promoted,
    count_verified_promoted,
    record_finished,
)
from vllm.v1.engine.outputs import ModelRunnerOutput, RequestOutput
from vllm.v1.engine.stats import SECONDARY, EngineStats, RequestTimes
from vllm.v1.engine.verification import KVOracle, VerifyMode
from vllm.v1.request import Request, RequestStatus

__all__ = ["ModelRunnerOutput", "RequestOutput", "Scheduler"]

_P = ParamSpec("_P")
_T = TypeVar("_T")


@dataclass
class _PendingLoad:
    num_local_tokens: int
    num_external_tokens: int


class Scheduler:
    """Schedules requests over the GPU KV cache and drives the scheduler-side connector.

    Args:
        kv_cache_manager: the GPU block tables.
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per step.
        connector: the scheduler-side connector, or None.
        stats: where to count.
        oracle: records the digests of loaded blocks (and, with ``VerifyMode.ALL``, of finishing
            requests' blocks) for the engine's check after the run (None: nothing recorded).
        event_sink: receives the KV events of each drain that found any: the GPU prefix cache's
            (``KVCacheManager.take_events``), then the connector's.
        max_model_len: a request stops (length-capped) once it holds this many tokens; default
            and upper bound: the tokens the GPU KV cache holds, so a request alone always fits.
        async_scheduling: ``schedule()`` may run before the previous step's output was applied
            (one step in flight): a request that samples in a step gets an output placeholder,
            and the next step already computes the placeholder token's KV.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        connector: KVConnectorBase_V1 | None,
        stats: EngineStats,
        oracle: KVOracle | None = None,
        event_sink: Callable[[list[KVCacheEvent]], None] | None = None,
        max_model_len: int | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        capacity = min(
            p.num_blocks * bs
            for p, bs in zip(kv_cache_manager.pools, kv_cache_manager.block_sizes, strict=True)
        )
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.max_num_seqs = max_num_seqs
        self.async_scheduling = async_scheduling
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        self.stats = stats
        self.oracle = oracle
        self.event_sink = event_sink
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self._pending_loads: dict[str, _PendingLoad] = {}
        # Aborted while loading: blocks are freed once the load is reported.
        self._free_after_load: dict[str, Request] = {}
        self._outputs: dict[str, RequestOutput] = {}
        # Waiting requests whose load finished: they hold their GPU blocks.
        self._loaded: set[str] = set()
        # GPU blocks (per group) whose load failed on some rank, until their request's load is
        # reported by every rank.
        self._invalid_blocks: dict[int, set[int]] = {}
        # Blocks of a finished load that were promoted from a secondary tier, by request.
        self._promoted: dict[str, tuple[PromotedBlock, ...]] = {}
        # Until its first token: when each request passed the points its TTFT is split at.
        self._times: dict[str, RequestTimes] = {}
        # Scheduler-side connector time of the current step: wall, and this thread's CPU.
        self.step_connector_seconds = 0.0
        self.step_connector_cpu_seconds = 0.0

    # -----------------------------------------------------------------------------------------
    # Requests
    # -----------------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: the id is in use (by a live request, or by a finished one whose
                offloading transfers are still in flight), or the prompt does not leave room
                for one generated token within ``max_model_len``.
        """
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already in use by a live request")
        if self.connector is not None and self.connector.tracks_request(req_id):
            raise ValueError(
                f"request id {req_id!r} is still in use: transfers of a finished request with "
                "that id are in flight; use a unique id"
            )
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: a prompt of {request.num_prompt_tokens} tokens "
                f"leaves no room below max_model_len={self.max_model_len}"
            )
        self.requests[request.request_id] = request
        self._times[req_id] = RequestTimes(request.arrival_time)
        self.waiting.append(request)
        self.stats.requests_added += 1

    def abort_request(self, req_id: str) -> bool:
        """Abort a request; returns False if it is unknown or already finished."""
        request = self.requests.get(req_id)
        if request is None or request.is_finished:
            return False
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        loading = request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        self._loaded.discard(req_id)
        request.status = RequestStatus.FINISHED_ABORTED
        self.stats.requests_aborted += 1
        self._free_request(request, delay_free=loading)
        self._output(req_id).finished = True
        self._output(req_id).finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def has_pending_work(self) -> bool:
        """Requests to serve, or connector transfers to finish."""
        return (
            self.has_unfinished_requests()
            or bool(self._free_after_load)
            or (self.connector is not None and self._timed(self.connector.has_pending_work))
        )

    def _output(self, req_id: str) -> RequestOutput:
        out = self._outputs.get(req_id)
        if out is None:
            out = self._outputs[req_id] = RequestOutput(req_id, [])
        return out

    def _timed(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Call a connector hook, adding its wall time and this thread's CPU time to the
        step's (one read of each clock before and after the hook)."""
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self.step_connector_cpu_seconds += time.thread_time() - start_cpu
            self.step_connector_seconds += time.perf_counter() - start

    # -----------------------------------------------------------------------------------------
    # schedule()
    # -----------------------------------------------------------------------------------------

    def _holds_blocks(self, request: Request) -> bool:
        """A waiting request whose connector load finished (it holds its GPU blocks)."""
        return request.request_id in self._loaded

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """Decide the step: which requests compute how many tokens with which blocks."""
        kv = self.kv_cache_manager
        connector = self.connector
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData()
        preempted: set[str] = set()

        # Running requests first, in order; blocks are taken from the tail when short.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._finishes_in_flight(request):
                index += 1  # its last token is being sampled: nothing left to compute (as vLLM)
                continue
            num_new = min(
                request.num_tokens + request.num_output_placeholders - request.num_computed_tokens,
                budget,
            )
            assert num_new > 0, f"running {request} has nothing to compute"
            new_blocks = None
            while True:
                new_blocks = kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_blocks if any(new_blocks) else None)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        # Waiting requests, unless this step had to preempt. Those whose load finished hold
        # GPU blocks already: they go first, so that they release them.
        if not preempted:
            # The reorder walks the whole queue, so only while a finished load holds blocks
            # (usually one step), not on every step of a long queue.
            holders = [r for r in self.waiting if self._holds_blocks(r)] if self._loaded else []
            if holders:
                self.waiting = deque(
                    holders + [r for r in self.waiting if not self._holds_blocks(r)]
                )
            skipped: deque[Request] = deque()
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                    skipped.append(self.waiting.popleft())
                    continue
                placed = self._try_place(request, budget)
                if placed is None:
                    break
                if placed == "skip":
                    skipped.append(self.waiting.popleft())
                    continue
                self.waiting.popleft()
                if placed == "loading":
                    skipped.append(request)
                    continue
                num_new = request.num_tokens - request.num_computed_tokens
                num_new = min(num_new, budget)
                new_reqs.append(
                    NewRequestData.from_request(request, kv.get_block_ids(request.request_id))
                )
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                num_scheduled[request.request_id] = num_new
                budget -= num_new
            self.waiting.extendleft(reversed(skipped))
            if not num_scheduled and not self.running:
                # Nothing runs and nothing fits: waiting requests holding blocks can block each
                # other (and everyone behind them) forever. Give their blocks back; they restart
                # from the prefix cache.
                for request in [r for r in self.waiting if self._holds_blocks(r)]:
                    self._loaded.discard(request.request_id)
                    kv.free(request)
                    request.status = RequestStatus.PREEMPTED
                    request.num_computed_tokens = 0
                    request.num_preemptions += 1
                    self.stats.preemptions += 1
                    preempted.add(request.request_id)

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=preempted,
        )
        self.finished_req_ids = set()
        if connector is not None:
            output.kv_connector_metadata = self._timed(connector.build_connector_meta, output)
        self.drain_events()
        # The scheduled tokens count as computed from here on (as in vLLM).
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if (
                self.async_scheduling
                and request.num_computed_tokens
                == request.num_tokens + request.num_output_placeholders
            ):
                # This step samples a token the next schedule() cannot know yet.
                request.num_output_placeholders += 1
        return output

    def _finishes_in_flight(self, request: Request) -> bool:
        """Whether the tokens being sampled by steps in flight finish the request."""
        n = request.num_output_placeholders
        return n > 0 and (
            request.num_output_tokens + n >= request.max_tokens
            or request.num_tokens + n >= self.max_model_len
        )

    def _try_place(self, request: Request, budget: int) -> str | None:
        """Allocate a waiting request's blocks.

        Returns:
            ``"run"`` (scheduled this step), ``"loading"`` (a load was started), ``"skip"`` (ask
            again next step), or None (no room: stop scheduling waiting requests).
        """
        kv = self.kv_cache_manager
        connector = self.connector
        # Preempted with a step in flight, it waited a step, which brought its token in.
        assert request.num_output_placeholders == 0, f"{request} placed with tokens in flight"
        if request.request_id in self._loaded:
            # Its connector load finished (possibly in part): it holds its blocks already and
            # computes the rest, without asking the connector again.
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                return None
            self._loaded.discard(request.request_id)
            if connector is not None:
                self._timed(
                    connector.update_state_after_alloc,
                    request,
                    kv.get_block_ids(request.request_id),
                    0,
                )
            return "run"

        computed_blocks, num_local = kv.get_computed_blocks(request)
        num_external, load_async = 0, False
        if connector is not None:
            ext, load_async = self._timed(connector.get_num_new_matched_tokens, request, num_local)
            times = self._times.get(request.request_id)
            if ext is None:
                if times is not None and times.deferred is None:
                    times.deferred = time.monotonic()
                return "skip"
            if times is not None and times.deferred is not None and times.answered is None:
                times.answered = time.monotonic()
            num_external = ext
        num_new = 0 if load_async else min(request.num_tokens - num_local - num_external, budget)
        new_blocks = kv.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=num_local,
            new_computed_blocks=computed_blocks,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async,
        )
        if new_blocks is None:
            return None
        if connector is not None:
            self._timed(
                connector.update_state_after_alloc,
                request,
                kv.get_block_ids(request.request_id),
                num_external,
            )
        times = self._times.get(request.request_id)
        if times is not None and times.placed is None:
            times.placed = time.monotonic()
        self.stats.placements += 1
        self.stats.prompt_tokens += request.num_tokens
        self.stats.tokens_from_gpu_cache += num_local
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_local
            self._pending_loads[request.request_id] = _PendingLoad(num_local, num_external)
            return "loading"
        assert num_external == 0, "synchronous connector loads are not supported"
        request.num_computed_tokens = num_local
        return "run"

    # -----------------------------------------------------------------------------------------
    # update_from_output()
    # -----------------------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Apply a step's results; return the per-request outputs of the step."""
        kv_output = model_output.kv_connector_output
        connector = self.connector
        if connector is not None and kv_output is not None:
            self._timed(connector.update_connector_output, kv_output)
            self._account_loads()
        if kv_output is not None:
            # Ranks may report a load in different steps: keep failed blocks until the load's
            # request is finished on every rank.
            for group, ids in kv_output.invalid_block_ids.items():
                self._invalid_blocks.setdefault(group, set()).update(ids)
            for req_id in sorted(kv_output.finished_recving):
                self._finish_load(req_id)

        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            self.stats.tokens_computed += scheduler_output.num_scheduled_tokens[req_id]
            token = model_output.sampled_token_ids.get(req_id)
            if token is None:
                continue
            if self.async_scheduling:
                assert request.num_output_placeholders > 0, f"{request} sampled unexpectedly"
                request.num_output_placeholders -= 1
            else:
                assert request.num_computed_tokens == request.num_tokens, (
                    f"{request} sampled before its last token was computed"
                )
            request.append_output_token_ids(token)
            self.stats.output_tokens += 1
            times = self._times.pop(req_id, None)
            if times is not None:
                self.stats.ttft_parts.append(times.parts(time.monotonic()))
            out = self._output(req_id)
            out.new_token_ids.append(token)
            if (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                if request.status is RequestStatus.RUNNING:
                    self.running.remove(request)
                else:  # preempted while its last token was in flight (async scheduling)
                    self.waiting.remove(request)
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self._free_request(request)
                out.finished = True
                out.finish_reason = "length"

        self.drain_events()
        return self.take_outputs()

    def take_outputs(self) -> list[RequestOutput]:
        """Outputs produced since the last call (e.g. of requests aborted between steps)."""
        outputs = list(self._outputs.values())
        self._outputs = {}
        return outputs

    def _account_loads(self) -> None:
        assert self.connector is not None
        for result in self._timed(self.connector.take_load_results):
            self._promoted[result.req_id] = result.promoted_blocks
            by_tier = self.stats.bytes_from_tier
            for tier, n in result.promoted_bytes.items():
                name = tier or SECONDARY
                by_tier[name] = by_tier.get(name, 0) + n
            self.stats.load_jobs_finished += 1
            if not result.success:
                self.stats.load_jobs_failed += 1

    def _finish_load(self, req_id: str) -> None:
        """A request's load was reported by every worker: make it schedulable (or free it)."""
        pending = self._pending_loads.pop(req_id, None)
        aborted = self._free_after_load.pop(req_id, None)
        promoted = self._promoted.pop(req_id, ())
        kv = self.kv_cache_manager
        holder = aborted or self.requests.get(req_id)
        assert holder is not None and pending is not None, f"unexpected finished load of {req_id}"
        num_local, num_ext = pending.num_local_tokens, pending.num_external_tokens
        end = num_local + num_ext
        blocks = kv.get_block_ids(req_id)
        loaded: dict[int, list[tuple[int, int]]] = {}
        valid_tokens = end
        for g, bs in enumerate(kv.block_sizes):
            loaded[g] = [(i, blocks[g][i]) for i in range(num_local // bs, end // bs)]
            bad = self._invalid_blocks.get(g)
            if bad:
                for i, block_id in loaded[g]:
                    if block_id in bad:
                        valid_tokens = min(valid_tokens, i * bs)
                        break
                bad.difference_update(b for _, b in loaded[g])
        if aborted is not None:
            kv.free(aborted)
            return
        if valid_tokens < end and kv.has_sliding_window:
            valid_tokens = num_local  # an SWA window may straddle the failure: recompute all
        request = holder
        assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS, (
            f"{request} finished loading but is not waiting for it"
        )
        if self.oracle is not None:
            checkable = kv.window_pairs(
                {
                    g: [(i, b) for i, b in pairs if i * kv.block_sizes[g] < valid_tokens]
                    for g, pairs in loaded.items()
                },
                min(valid_tokens, request.num_tokens - 1),
            )
            count_verified_promoted(self.stats, kv.block_sizes, promoted, valid_tokens)
            self.oracle.record_blocks(request, checkable, loaded=True)
        valid_tokens = max(num_local, valid_tokens - valid_tokens % kv.alignment)
        num_computed = min(valid_tokens, request.num_tokens - 1)
        # SWA blocks below the window were allocated for the load but not loaded: free them
        # before they could be cached.
        kv.remove_skipped_blocks(request, num_computed)
        kv.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING
        self._loaded.add(req_id)
        times = self._times.get(req_id)
        if times is not None and times.loaded is None:
            times.loaded = time.monotonic()
        self.stats.tokens_load_failed += end - valid_tokens
        served = max(num_computed - num_local, 0)
        from_secondary = account_promoted(self.stats, promoted, num_local, num_computed)
        self.stats.tokens_from_secondary += from_secondary
        self.stats.tokens_from_cpu += served - from_secondary

    def _free_request(self, request: Request, delay_free: bool = False) -> None:
        """Tell the connector, then free the request's GPU blocks (unless a load writes them)."""
        req_id = request.request_id
        oracle = self.oracle
        if oracle is not None and oracle.mode is VerifyMode.ALL and not delay_free:
            record_finished(oracle, self.kv_cache_manager, request)
        if self.connector is not None:
            self._timed(self.connector.request_finished, request)
        if delay_free:
            self._free_after_load[req_id] = request
        else:
            self.kv_cache_manager.free(request)
        if not delay_free:
            self._pending_loads.pop(req_id, None)
        self.finished_req_ids.add(req_id)
        del self.requests[req_id]
        self._times.pop(req_id, None)
        self.stats.requests_finished += 1

    def drain_events(self) -> None:
        """Drain the GPU prefix cache's and the connector's KV events into the event sink (no
        other effect)."""
        events = self.kv_cache_manager.take_events()
        if self.connector is not None:
            events.extend(self._timed(self.connector.take_events))
        if events and self.event_sink is not None:
            self.event_sink(events)

    # -----------------------------------------------------------------------------------------
    # Cache reset
    # -----------------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        """Forget the GPU prefix cache and everything offloaded (between steps only)."""
        self.kv_cache_manager.reset_prefix_cache()
        if self.connector is not None:
            self._timed(self.connector.reset_cache)

    def iter_requests(self) -> Iterable[Request]:
        """Every unfinished request."""
        return self.requests.values()
