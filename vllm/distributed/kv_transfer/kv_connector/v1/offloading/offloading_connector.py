# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingConnector``: the KV connector v1 facade over the two halves.

One instance per role: the scheduler-side instance owns an ``OffloadingConnectorScheduler``
(and through it the ``OffloadingManager``), each worker's instance an
``OffloadingConnectorWorker``. Calling a method of the other role is a programming error and
raises ``AssertionError``.

Example::

    spec = OffloadingConnector.create_spec({"cpu_bytes_to_use": 1 << 30}, run_info)
    scheduler_side = OffloadingConnector(spec, KVConnectorRole.SCHEDULER)
    worker_side = OffloadingConnector(spec, KVConnectorRole.WORKER, rank=0)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    ReqId,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    LoadResult,
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
from vllm.v1.kv_offload.base import TierStats
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request


class OffloadingConnector:
    """Offloads KV blocks to the tiers of an ``OffloadingSpec``'s manager.

    Args:
        spec: the offloading spec shared by both roles.
        role: which half this instance is.
        rank: the worker rank (worker role only).
        hash_block_size: tokens per hashed block of ``Request.block_hashes`` (scheduler role;
            default: the gcd of the GPU block sizes).

    The spec builds both halves' medium-specific parts: the manager (``spec.get_manager``) on
    the scheduler side, each rank's transfer handlers (``spec.get_handlers``) on the worker side.
    """

    def __init__(
        self,
        spec: OffloadingSpec,
        role: KVConnectorRole,
        *,
        rank: int = 0,
        hash_block_size: int | None = None,
    ) -> None:
        self.spec = spec
        self.role = role
        self._scheduler: OffloadingConnectorScheduler | None = None
        self._worker: OffloadingConnectorWorker | None = None
        self._metadata: OffloadingConnectorMetadata | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = OffloadingConnectorScheduler(spec, hash_block_size=hash_block_size)
        else:
            self._worker = OffloadingConnectorWorker(spec, rank)

    @staticmethod
    def create_spec(
        extra_config: Mapping[str, Any] | OffloadingConfig,
        run: KVCacheRunInfo,
        *,
        enable_events: bool = False,
    ) -> OffloadingSpec:
        """Parse ``kv_connector_extra_config`` and build the spec it selects."""
        config = (
            extra_config
            if isinstance(extra_config, OffloadingConfig)
            else OffloadingConfig.from_extra_config(extra_config)
        )
        return OffloadingSpecFactory.create_spec(config, run, enable_events=enable_events)

    @property
    def connector_scheduler(self) -> OffloadingConnectorScheduler:
        """The scheduler-side half (scheduler role only).

        Raises:
            RuntimeError: this is a worker-side connector.
        """
        if self._scheduler is None:
            raise RuntimeError("OffloadingConnector: a scheduler-side call on a worker connector")
        return self._scheduler

    @property
    def connector_worker(self) -> OffloadingConnectorWorker:
        """The worker-side half (worker role only).

        Raises:
            RuntimeError: this is the scheduler-side connector.
        """
        if self._worker is None:
            raise RuntimeError("OffloadingConnector: a worker-side call on a scheduler connector")
        return self._worker

    # -----------------------------------------------------------------------------------------
    # Scheduler side
    # -----------------------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """See ``OffloadingConnectorScheduler.get_num_new_matched_tokens``.

        Each call is timed, and deferrals are tracked per request, for the lookup metrics (one
        clock read pair per call, not per key).
        """
        scheduler = self.connector_scheduler
        start = time.perf_counter()
        result = scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        scheduler.stats_collector.on_lookup(
            request.request_id, result[0] is None, time.perf_counter() - start
        )
        return result

    def update_state_after_alloc(
        self, request: Request, blocks: GroupBlockIds, num_external_tokens: int
    ) -> None:
        """See ``OffloadingConnectorScheduler.update_state_after_alloc``."""
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """See ``OffloadingConnectorScheduler.build_connector_meta``."""
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """See ``OffloadingConnectorScheduler.update_connector_output``."""
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: GroupBlockIds | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """See ``OffloadingConnectorScheduler.request_finished``; always ``(False, None)``."""
        self.connector_scheduler.stats_collector.on_request_finished(request.request_id)
        return self.connector_scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Drain the manager's events as KV events; no other effect."""
        return self.connector_scheduler.take_events()

    def take_load_results(self) -> list[LoadResult]:
        """Loads completed since the last call (for the engine's accounting)."""
        return self.connector_scheduler.take_load_results()

    def reset_cache(self) -> None:
        """See ``OffloadingConnectorScheduler.reset_cache``."""
        self.connector_scheduler.reset_cache()

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for transfers in flight."""
        return self.connector_scheduler.has_pending_work()

    def get_stats(self) -> dict[str, int | float]:
        """Connector and manager counters (scheduler role)."""
        return self.connector_scheduler.get_stats()

    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's ``KVConnectorStats`` of this half since the last call, or None if nothing.

        Worker role: the transfers this rank finished (the engine forwards them in
        ``KVConnectorOutput.kv_connector_stats``). Scheduler role: the workers' stats received
        since, plus this side's, the manager's and the tiers' metrics (see ``stats_collector``).
        """
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return self.connector_worker.get_kv_connector_stats()

    def observe_step_seconds(self, seconds: float) -> None:
        """Record the time the engine spent in this (scheduler-side) connector during a step."""
        self.connector_scheduler.stats_collector.observe_step_seconds(seconds)

    def get_tier_stats(self) -> list[TierStats]:
        """Point-in-time reports of the spec's secondary tiers, in lookup order (scheduler role;
        see ``OffloadingSpec.get_tier_stats``)."""
        self.connector_scheduler  # noqa: B018 (raises on a worker connector)
        return self.spec.get_tier_stats()

    def wait_for_tiers_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the secondary tiers finished their start-up work; False on timeout
        (scheduler role; see ``OffloadingSpec.wait_for_tiers_ready``)."""
        self.connector_scheduler  # noqa: B018 (raises on a worker connector)
        return self.spec.wait_for_tiers_ready(timeout_s)

    # -----------------------------------------------------------------------------------------
    # Worker side
    # -----------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        """See ``OffloadingConnectorWorker.register_kv_caches``."""
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        """Attach the step's metadata for the hooks below.

        Raises:
            TypeError: ``metadata`` is not ``OffloadingConnectorMetadata`` (nothing is bound).
        """
        self._metadata = _check_metadata("bind_connector_metadata", metadata)

    def clear_connector_metadata(self) -> None:
        """Detach the step's metadata."""
        self._metadata = None

    def _get_metadata(self) -> OffloadingConnectorMetadata:
        if self._metadata is None:
            raise RuntimeError(
                "OffloadingConnector: no connector metadata is bound (bind_connector_metadata "
                "must come first in the step)"
            )
        return self._metadata

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        """See ``OffloadingConnectorWorker.handle_preemptions`` (called before binding).

        Raises:
            TypeError: ``metadata`` is not ``OffloadingConnectorMetadata``.
        """
        self.connector_worker.handle_preemptions(_check_metadata("handle_preemptions", metadata))

    def start_load_kv(self) -> None:
        """Submit deferred stores, then this step's loads."""
        self.connector_worker.start_load_kv(self._get_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: loads are asynchronous, per request, not per layer."""

    def save_kv_layer(self, layer_name: str) -> None:
        """No-op: stores are whole blocks, issued after the forward pass."""

    def wait_for_save(self) -> None:
        """Defer this step's stores to the next step."""
        self.connector_worker.wait_for_save(self._get_metadata())

    def get_finished(self, finished_req_ids: Iterable[ReqId]) -> tuple[set[ReqId], set[ReqId]]:
        """See ``OffloadingConnectorWorker.get_finished``."""
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """See ``OffloadingConnectorWorker.get_block_ids_with_load_errors``."""
        return self.connector_worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        """See ``OffloadingConnectorWorker.build_connector_worker_meta``."""
        return self.connector_worker.build_connector_worker_meta()

    # -----------------------------------------------------------------------------------------
    # Both
    # -----------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the half's resources (manager, or handlers)."""
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()


def _check_metadata(method: str, metadata: KVConnectorMetadata) -> OffloadingConnectorMetadata:
    """``metadata`` as ``OffloadingConnectorMetadata``; TypeError if it is anything else."""
    if not isinstance(metadata, OffloadingConnectorMetadata):
        raise TypeError(
            f"OffloadingConnector.{method}: metadata is {type(metadata).__name__}, expected "
            "OffloadingConnectorMetadata"
        )
    return metadata
