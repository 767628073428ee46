# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingConnector``: the KV connector v1 (``KVConnectorBase_V1``) over the two halves.

One instance per role: the scheduler-side instance owns an ``OffloadingConnectorScheduler``
(and through it the ``OffloadingManager``), each worker's instance an
``OffloadingConnectorWorker``. Each instance builds its own ``OffloadingSpec`` from
``kv_connector_extra_config``, as upstream vLLM's does in every process; the two halves of a
medium meet through what the spec names (e.g. the shared host region of the run's instance id).
Calling a method of the other role is a programming error and raises ``RuntimeError``.

Example::

    config = KVTransferConfig(kv_connector_extra_config={"cpu_bytes_to_use": 1 << 30})
    scheduler_side = OffloadingConnector(config, KVConnectorRole.SCHEDULER, run_info)
    worker_side = OffloadingConnector(config, KVConnectorRole.WORKER, run_info, rank=0)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from typing_extensions import override

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    LoadResult,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
from vllm.v1.kv_offload.base import OffloadKey, TierStats
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request


class OffloadingConnector(KVConnectorBase_V1):
    """Offloads KV blocks to the tiers of an ``OffloadingSpec``'s manager.

    Args:
        config: ``kv_connector_extra_config`` selects and configures the spec (see
            ``OffloadingConfig``); ``hash_block_size`` (scheduler role; default: the gcd of the
            GPU block sizes), ``enable_kv_events`` and ``record_block_origins`` as documented
            there.
        role: which half this instance is.
        run: the run's block-defining facts.
        rank: the worker rank (worker role only).

    Raises:
        ValueError: the extra config is invalid, or names an unknown spec.

    The spec builds both halves' medium-specific parts: the manager (``spec.get_manager``) on
    the scheduler side, each rank's transfer handlers (``spec.get_handlers``) on the worker side.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        run: KVCacheRunInfo,
        *,
        rank: int = 0,
    ) -> None:
        super().__init__(config, role, run, rank=rank)
        self.spec = self.create_spec(
            config.kv_connector_extra_config, run, enable_events=config.enable_kv_events
        )
        self._scheduler: OffloadingConnectorScheduler | None = None
        self._worker: OffloadingConnectorWorker | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = OffloadingConnectorScheduler(
                self.spec, hash_block_size=config.hash_block_size
            )
            if config.record_block_origins:
                self._scheduler.stored_keys = set()
        else:
            self._worker = OffloadingConnectorWorker(self.spec, rank)

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

    @override
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

    @override
    def update_state_after_alloc(
        self, request: Request, blocks: GroupBlockIds, num_external_tokens: int
    ) -> None:
        """See ``OffloadingConnectorScheduler.update_state_after_alloc``."""
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """See ``OffloadingConnectorScheduler.build_connector_meta``."""
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """See ``OffloadingConnectorScheduler.update_connector_output``."""
        self.connector_scheduler.update_connector_output(connector_output)

    @override
    def request_finished(
        self, request: Request, block_ids: GroupBlockIds | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """See ``OffloadingConnectorScheduler.request_finished``; always ``(False, None)``."""
        self.connector_scheduler.stats_collector.on_request_finished(request.request_id)
        return self.connector_scheduler.request_finished(request, block_ids)

    @override
    def take_events(self) -> Iterable[KVCacheEvent]:
        """Drain the manager's events as KV events; no other effect."""
        return self.connector_scheduler.take_events()

    @override
    def reset_cache(self) -> bool:
        """See ``OffloadingConnectorScheduler.reset_cache``; True (it raises rather than fail)."""
        self.connector_scheduler.reset_cache()
        return True

    # Hooks of this engine (see ``KVConnectorBase_V1``).

    @override
    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for transfers in flight."""
        return self.connector_scheduler.has_pending_work()

    @override
    def tracks_request(self, req_id: str) -> bool:
        """See ``OffloadingConnectorScheduler.tracks_request``."""
        return self.connector_scheduler.tracks_request(req_id)

    @override
    def take_load_results(self) -> list[LoadResult]:
        """Loads completed since the last call (for the engine's accounting)."""
        return self.connector_scheduler.take_load_results()

    @override
    def observe_step(self, wall_seconds: float, cpu_seconds: float) -> None:
        """Record the time the engine spent in this (scheduler-side) connector during a step;
        the step ended (the load guard's compute sample)."""
        self.connector_scheduler.stats_collector.observe_step(wall_seconds, cpu_seconds)
        self.connector_scheduler.on_step_end()

    @override
    def get_stats(self) -> dict[str, int | float]:
        """Connector and manager counters (scheduler role)."""
        return self.connector_scheduler.get_stats()

    @override
    def get_tier_stats(self) -> list[TierStats]:
        """Point-in-time reports of the spec's secondary tiers, in lookup order (scheduler role;
        see ``OffloadingSpec.get_tier_stats``)."""
        self.connector_scheduler  # noqa: B018 (raises on a worker connector)
        return self.spec.get_tier_stats()

    @override
    def wait_for_tiers_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the secondary tiers finished their start-up work; False on timeout
        (scheduler role; see ``OffloadingSpec.wait_for_tiers_ready``)."""
        self.connector_scheduler  # noqa: B018 (raises on a worker connector)
        return self.spec.wait_for_tiers_ready(timeout_s)

    @override
    def stored_keys(self) -> frozenset[OffloadKey]:
        """The keys this connector stored from the GPU (scheduler role; empty unless
        ``record_block_origins``)."""
        return frozenset(self.connector_scheduler.stored_keys or ())

    # -----------------------------------------------------------------------------------------
    # Worker side
    # -----------------------------------------------------------------------------------------

    @override
    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:
        """See ``OffloadingConnectorWorker.register_kv_caches``."""
        self.connector_worker.register_kv_caches(kv_caches)

    @override
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Attach the step's metadata for the hooks below.

        Raises:
            TypeError: ``metadata`` is not ``OffloadingConnectorMetadata`` (nothing is bound).
        """
        super().bind_connector_metadata(
            _check_metadata("bind_connector_metadata", connector_metadata)
        )

    def _get_metadata(self) -> OffloadingConnectorMetadata:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, OffloadingConnectorMetadata)  # bind_connector_metadata
        return metadata

    @override
    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:
        """See ``OffloadingConnectorWorker.handle_preemptions`` (called before binding).

        Raises:
            TypeError: ``metadata`` is not ``OffloadingConnectorMetadata``.
        """
        self.connector_worker.handle_preemptions(
            _check_metadata("handle_preemptions", connector_metadata)
        )

    @override
    def start_load_kv(self, **kwargs: Any) -> None:
        """Submit deferred stores, then this step's loads."""
        self.connector_worker.start_load_kv(self._get_metadata())

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: loads are asynchronous, per request, not per layer."""

    @override
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """No-op: stores are whole blocks, issued after the forward pass."""

    @override
    def wait_for_save(self) -> None:
        """Defer this step's stores to the next step."""
        self.connector_worker.wait_for_save(self._get_metadata())

    @override
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """See ``OffloadingConnectorWorker.get_finished``."""
        return self.connector_worker.get_finished(finished_req_ids)

    @override
    def get_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """See ``OffloadingConnectorWorker.get_block_ids_with_load_errors``."""
        return self.connector_worker.get_block_ids_with_load_errors()

    @override
    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        """See ``OffloadingConnectorWorker.build_connector_worker_meta``."""
        return self.connector_worker.build_connector_worker_meta()

    # -----------------------------------------------------------------------------------------
    # Both
    # -----------------------------------------------------------------------------------------

    @override
    def get_kv_connector_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's ``KVConnectorStats`` of this half since the last call, or None if nothing.

        Worker role: the transfers this rank finished (the engine forwards them in
        ``KVConnectorOutput.kv_connector_stats``). Scheduler role: the workers' stats received
        since, plus this side's, the manager's and the tiers' metrics (see ``stats_collector``).
        """
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return self.connector_worker.get_kv_connector_stats()

    @override
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
