# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``Worker``: one worker rank: its GPU KV cache, its model runner, the connector's worker half.

Per step (``execute_model``) a rank runs the connector's worker hooks around the forward pass in
vLLM's order::

    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    connector.start_load_kv()
    <forward (ModelRunner.execute): write the KV of every scheduled token; sample where a
     request reached its end>
    connector.wait_for_save()
    connector.get_finished(finished_req_ids); get_block_ids_with_load_errors()
    connector.build_connector_worker_meta()
    connector.clear_connector_metadata()

The rank keeps its own view of each running request (tokens, block table), built from the
scheduler's output as a real worker process would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVTransferConfig,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.model import GroupKVCache, KVLayout, allocate_group_kv_cache
from vllm.v1.engine.model_runner import (
    HashModelRunner,
    ModelKind,
    ModelRunner,
    ScheduledSeq,
    TransformerModelRunner,
)
from vllm.v1.kv_offload.spec import KVCacheRunInfo
from vllm.v1.kv_offload.worker.canonical import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    KVCacheLayout,
    canonicalize_layer,
)
from vllm.v1.outputs import KVConnectorOutput

_CANONICAL_LAYOUT = {
    KVLayout.PER_LAYER: KVCacheLayout.KV_FIRST,
    KVLayout.PER_LAYER_BLOCKS_FIRST: KVCacheLayout.BLOCKS_FIRST,
    KVLayout.CROSS_LAYER: KVCacheLayout.CROSS_LAYER,
}


def canonical_kv_caches(groups: Sequence[GroupKVCache]) -> CanonicalKVCaches:
    """Describe a rank's KV tensors (every group, every layer) as canonical tensors."""
    tensors: list[CanonicalKVCacheTensor] = []
    refs: list[tuple[CanonicalKVCacheRef, ...]] = []
    for group in groups:
        group_refs: list[CanonicalKVCacheRef] = []
        for t in group.tensors:
            for view in canonicalize_layer(t, _CANONICAL_LAYOUT[group.layout]):
                canonical = CanonicalKVCacheTensor.from_tensor(view)
                group_refs.append(CanonicalKVCacheRef(len(tensors), canonical.page_size_bytes))
                tensors.append(canonical)
        refs.append(tuple(group_refs))
    return CanonicalKVCaches(tuple(tensors), tuple(refs))


@dataclass
class _RequestState:
    token_ids: list[int]
    block_ids: list[list[int]]
    num_computed_tokens: int


@dataclass
class WorkerOutput:
    """One rank's results of a step.

    Attributes:
        sampled_token_ids: tokens sampled per request (identical on every rank).
        kv_connector_output: the connector's report, or None without a connector.
        connector_seconds: time spent in connector hooks on this rank.
        connector_cpu_seconds: of it, this rank's thread's CPU time.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
    connector_seconds: float = 0.0
    connector_cpu_seconds: float = 0.0


class Worker:
    """One worker rank (see the module docstring).

    Args:
        config: the engine's settings.
        rank: this rank.
        kv_transfer_config: the connector to run (None: no connector); the factory builds its
            worker-side instance for this rank, which gets the rank's KV caches at once.
        run: the run's block-defining facts (the engine's ``run_info()``); needed with a
            connector.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int,
        kv_transfer_config: KVTransferConfig | None = None,
        run: KVCacheRunInfo | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.kv_caches = [
            allocate_group_kv_cache(
                g,
                bs,
                config.num_gpu_blocks,
                config.num_layers,
                config.num_kv_heads,
                config.head_size,
                config.torch_dtype,
                config.kv_layout,
                config.device,
            )
            for g, bs in enumerate(config.gpu_block_sizes)
        ]
        self.runner: ModelRunner
        if config.model is ModelKind.TRANSFORMER:
            self.runner = TransformerModelRunner(
                self.kv_caches,
                config.model_preset,
                config.vocab_size,
                config.model_seed,
                config.sliding_windows,
            )
        else:
            self.runner = HashModelRunner(self.kv_caches, rank, config.vocab_size)
        self._requests: dict[str, _RequestState] = {}
        self.connector: KVConnectorBase_V1 | None = None
        if kv_transfer_config is not None:
            assert run is not None, "a worker with a connector needs the run's facts"
            self.connector = KVConnectorFactory.create_connector(
                kv_transfer_config, KVConnectorRole.WORKER, run, rank=rank
            )
            self.connector.register_kv_caches(canonical_kv_caches(self.kv_caches))

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._requests.pop(req_id, None)
            self.runner.release(req_id)
        for new in so.scheduled_new_reqs:
            self._requests[new.req_id] = _RequestState(
                token_ids=[*new.prompt_token_ids, *new.output_token_ids],
                block_ids=[list(ids) for ids in new.block_ids],
                num_computed_tokens=new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self._requests[req_id]
            assert state.num_computed_tokens == num_computed, (
                f"rank {self.rank}: request {req_id} computed {state.num_computed_tokens} tokens, "
                f"scheduler says {num_computed}"
            )
            if new_ids is not None:
                for g, ids in enumerate(new_ids):
                    state.block_ids[g].extend(ids)

    def _forward(self, so: SchedulerOutput) -> dict[str, int]:
        seqs: list[ScheduledSeq] = []
        for req_id, num_new in so.num_scheduled_tokens.items():
            state = self._requests[req_id]
            start = state.num_computed_tokens
            end = start + num_new
            assert end <= len(state.token_ids), (
                f"rank {self.rank}: request {req_id} scheduled past its known tokens"
            )
            seqs.append(
                ScheduledSeq(
                    req_id,
                    state.token_ids,
                    start,
                    end,
                    state.block_ids,
                    sample=end == len(state.token_ids),
                )
            )
            state.num_computed_tokens = end
        sampled = self.runner.execute(seqs)
        for req_id, token in sampled.items():
            self._requests[req_id].token_ids.append(token)
        return sampled

    def execute_model(self, so: SchedulerOutput) -> WorkerOutput:
        """Run one step on this rank."""
        self._update_states(so)
        connector = self.connector
        out = WorkerOutput()
        if connector is not None:
            meta = so.kv_connector_metadata
            assert meta is not None, "the scheduler built no connector metadata"
            # One read of each clock around each run of hooks: wall, and this thread's CPU.
            t0, c0 = time.perf_counter(), time.thread_time()
            connector.handle_preemptions(meta)
            connector.bind_connector_metadata(meta)
            connector.start_load_kv()
            out.connector_cpu_seconds += time.thread_time() - c0
            out.connector_seconds += time.perf_counter() - t0
        out.sampled_token_ids = self._forward(so)
        if connector is not None:
            t0, c0 = time.perf_counter(), time.thread_time()
            connector.wait_for_save()
            finished_sending, finished_recving = connector.get_finished(so.finished_req_ids)
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=finished_sending or set(),
                finished_recving=finished_recving or set(),
                invalid_block_ids=connector.get_block_ids_with_load_errors(),
                kv_connector_worker_meta=connector.build_connector_worker_meta(),
                kv_connector_stats=connector.get_kv_connector_stats(),
            )
            connector.clear_connector_metadata()
            out.connector_cpu_seconds += time.thread_time() - c0
            out.connector_seconds += time.perf_counter() - t0
        return out

    def shutdown(self) -> None:
        """Shut the connector's worker half down."""
        if self.connector is not None:
            self.connector.shutdown()
