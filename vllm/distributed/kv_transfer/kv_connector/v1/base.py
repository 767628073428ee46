# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The KV connector v1 interface, as the engine calls it: ``KVConnectorBase_V1``.

A connector has two halves, one per role. The scheduler-side half runs in the engine core next to
the scheduler; the worker-side half runs in every worker process, next to the GPU KV cache. They
talk only through metadata: the scheduler side builds a ``KVConnectorMetadata`` per step that the
workers consume, and each worker returns a ``KVConnectorWorkerMetadata`` that the engine combines
over ranks and hands back to the scheduler side in ``KVConnectorOutput``.

The engine knows a connector only through this module (and ``KVConnectorFactory``, which builds
the class a ``KVTransferConfig`` names), so an out-of-tree connector plugs in as in vLLM: a
subclass of ``KVConnectorBase_V1`` named by ``kv_connector`` and ``kv_connector_module_path``.

Call order within one engine step (scheduler side unless noted)::

    schedule():
        get_num_new_matched_tokens(request, num_computed_tokens)   # per waiting request
        update_state_after_alloc(request, blocks, num_external_tokens)
        build_connector_meta(scheduler_output)
        take_events()
    worker: handle_preemptions(meta); bind_connector_metadata(meta); start_load_kv();
            <model forward>; wait_for_save(); get_finished(finished_req_ids);
            get_block_ids_with_load_errors(); build_connector_worker_meta();
            get_kv_connector_stats(); clear_connector_metadata()
    update_from_output():
        update_connector_output(connector_output)
        take_load_results()                                         # this engine's accounting
        request_finished(request)                                   # per finished request
        take_events()
    get_kv_connector_stats()                                        # once per step

Every hook runs on its half's one thread (the engine thread, or the worker's); none may block
except ``wait_for_save`` and ``wait_for_layer_load``, which upstream also lets block. Hooks the
base implements are documented no-ops a connector overrides when it needs them. The last group,
"hooks of this engine", is not in upstream vLLM's base class: the engine calls them for its
reports and its step loop (``docs/design.md`` lists them with the other differences).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from typing_extensions import Self

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
    from vllm.v1.kv_offload.base import OffloadKey, TierStats
    from vllm.v1.kv_offload.spec import KVCacheRunInfo
    from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is."""

    SCHEDULER = 0
    """Runs in the engine core, next to the scheduler."""
    WORKER = 1
    """Runs in a worker, next to the GPU KV cache."""


@dataclass(frozen=True)
class KVTransferConfig:
    """Which connector an engine runs, and what it is built from (both roles get the same).

    Upstream vLLM hands a connector the whole ``VllmConfig``; this engine hands it the parts a
    connector reads, gathered here.

    Attributes:
        kv_connector: a connector registered with ``KVConnectorFactory`` (e.g.
            ``"OffloadingConnector"``), or the class name in ``kv_connector_module_path``.
        kv_connector_module_path: the module of an out-of-tree connector class.
        kv_connector_extra_config: the connector's own settings (for the offloading connector:
            the keys ``OffloadingConfig`` parses).
        hash_block_size: tokens per hashed block of ``Request.block_hashes`` (upstream: the
            cache config's block size); None: the gcd of the GPU block sizes.
        enable_kv_events: collect KV events for ``take_events`` (upstream: ``KVEventsConfig``).
        record_block_origins: also track which blocks this connector stored itself, so that a
            load result tells them from blocks stored elsewhere (``PromotedBlock.stored_here``);
            costs memory per block stored.
    """

    kv_connector: str = "OffloadingConnector"
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    hash_block_size: int | None = None
    enable_kv_events: bool = False
    record_block_origins: bool = False


class KVConnectorMetadata(ABC):  # noqa: B024 (a marker base: subclasses define the fields)
    """Scheduler -> worker metadata of one step. Subclasses define the payload."""


class KVConnectorWorkerMetadata(ABC):
    """Worker -> scheduler metadata of one step, produced by each worker rank."""

    @abstractmethod
    def aggregate(self, other: Self) -> Self:
        """Combine this rank's metadata with another rank's (same step); returns the result.

        Aggregation is commutative and associative, so the engine may fold the ranks in any
        order. Neither input is mutated.
        """

    def bytes_moved(self) -> Mapping[str, int]:
        """Bytes of the transfers finished in the step, per direction ``"SRC_to_DST"``, for the
        engine's per-step records (not in upstream vLLM). Default: none reported."""
        return {}


@dataclass(frozen=True, slots=True)
class PromotedBlock:
    """An offloaded block of a finished load that a slower tier served (through a faster one).

    Attributes:
        start_token, end_token: the tokens of the load that the block holds.
        tier: type name of the tier it came from (e.g. ``"redis"``); None when unknown.
        key: the block's key (of the first KV-cache group that was promoted).
        stored_here: whether this connector had stored the block itself before the load
            finished; None unless ``KVTransferConfig.record_block_origins``.
    """

    start_token: int
    end_token: int
    tier: str | None
    key: OffloadKey
    stored_here: bool | None


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of a finished load, for the engine's accounting (``take_load_results``).

    Attributes:
        req_id: the request that loaded.
        num_blocks: offloaded blocks the load spans (a sliding-window group loads only some).
        num_tokens: tokens loaded.
        num_promoted_tokens: of those, tokens of ``promoted_blocks``.
        success: every worker loaded every block.
        promoted_blocks: the blocks a slower tier served, by which the engine attributes served
            tokens to the tier they came from.
        promoted_bytes: per tier type (None: not named), the bytes the load read of keys
            promoted from that tier: each such key's bytes as a load moves them (its KV-cache
            group's bytes of one offloaded block, every worker's). Empty for a failed load.
    """

    req_id: str
    num_blocks: int
    num_tokens: int
    num_promoted_tokens: int
    success: bool
    promoted_blocks: tuple[PromotedBlock, ...] = ()
    promoted_bytes: Mapping[str | None, int] = field(default_factory=dict)


class KVConnectorBase_V1(ABC):
    """Base class of KV connectors (see the module docstring for the call order).

    One instance per role and process: the scheduler-side instance lives in the engine core, one
    worker-side instance in each worker rank. A connector calls only its own role's hooks; the
    engine never calls the other role's.

    Args:
        config: what the engine runs the connector with (the same for every role).
        role: which half this instance is.
        run: the facts of the KV cache (model, dtype, layout, block sizes, parallel sizes), as
            upstream's ``KVCacheConfig``.
        rank: the worker rank of a worker-side instance, in ``[0, run.world_size)`` (upstream
            reads it from the distributed state).
    """

    def __init__(
        self,
        config: KVTransferConfig,
        role: KVConnectorRole,
        run: KVCacheRunInfo,
        *,
        rank: int = 0,
    ) -> None:
        self._kv_transfer_config = config
        self._role = role
        self._run = run
        self._rank = rank
        self._connector_metadata: KVConnectorMetadata | None = None

    @property
    def role(self) -> KVConnectorRole:
        """Which half this instance is."""
        return self._role

    # -----------------------------------------------------------------------------------------
    # Worker side
    # -----------------------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Attach the step's metadata for the hooks that follow; called before the forward."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """Detach the step's metadata; called after the forward."""
        self._connector_metadata = None

    def has_connector_metadata(self) -> bool:
        """Whether metadata is bound."""
        return self._connector_metadata is not None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        """The bound metadata (for the connector's own hooks).

        Raises:
            RuntimeError: none is bound (``bind_connector_metadata`` must come first).
        """
        if self._connector_metadata is None:
            raise RuntimeError(
                f"{type(self).__name__}: no connector metadata is bound "
                "(bind_connector_metadata must come first in the step)"
            )
        return self._connector_metadata

    def register_kv_caches(self, kv_caches: CanonicalKVCaches) -> None:  # noqa: B027
        """Take note of this rank's GPU KV caches, once, before the first step.

        Upstream passes ``{layer name: tensor}``; this engine passes them in canonical form
        (every layer's tensors with their page sizes, per KV-cache group). The worker owns the
        tensors and keeps them alive until ``shutdown``. Default: nothing to register.
        """

    def handle_preemptions(self, connector_metadata: KVConnectorMetadata) -> None:  # noqa: B027
        """Before the metadata is bound and the forward pass runs: make GPU blocks about to be
        overwritten (preempted requests, reused blocks) safe, e.g. by finishing the transfers
        that read them. Default: nothing to do."""

    @abstractmethod
    def start_load_kv(self, **kwargs: Any) -> None:
        """Start this step's loads into the GPU KV cache (they may finish in later steps).

        Upstream passes the forward context; this engine has none, so keyword arguments only.
        """

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV of this step's loads is in place (layer-wise
        loading); a connector that loads whole blocks implements it as a no-op."""

    @abstractmethod
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        """Start saving ``layer_name``'s KV of this step (layer-wise saving); a connector that
        stores whole blocks after the forward pass implements it as a no-op."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """After the forward pass: the saves of this step are issued (or waited for) before the
        GPU blocks they read may be overwritten."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished sending, finished receiving)`` request ids since the last call.

        Args:
            finished_req_ids: the requests that finished generating since the last step.

        Returns:
            Requests whose asynchronous saves finished (only those ``request_finished`` kept
            blocks for), and requests whose asynchronous loads finished (successfully or not).
            Default: ``(None, None)``, nothing asynchronous.
        """
        return None, None

    def get_block_ids_with_load_errors(self) -> dict[int, set[int]]:
        """GPU block ids whose load failed since the last call, per KV-cache group (upstream:
        one set, its block ids being unique across groups); their KV is recomputed. Default:
        none."""
        return {}

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This rank's report of the step for the scheduler side, or None. Default: None."""
        return None

    # -----------------------------------------------------------------------------------------
    # Both sides
    # -----------------------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The statistics since the last call, or None. Worker side: the engine forwards them
        in ``KVConnectorOutput.kv_connector_stats``; scheduler side: the engine collects them
        once per step. Default: None."""
        return None

    def shutdown(self) -> None:  # noqa: B027
        """Release the half's resources; the engine calls it once, after its last step.
        Default: nothing to release."""

    # -----------------------------------------------------------------------------------------
    # Scheduler side
    # -----------------------------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` the connector can provide.

        Returns:
            ``(n, load_async)``: ``n`` tokens can be loaded (None: ask again at a later step),
            asynchronously if ``load_async`` (False whenever ``n`` is 0).
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: GroupBlockIds, num_external_tokens: int
    ) -> None:
        """The request's GPU blocks were allocated (every block it holds now, per group;
        upstream passes them as ``KVCacheBlocks``). ``num_external_tokens`` is what the
        connector is to load (0: nothing); decide on it, not on whether ``blocks`` is empty."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The step's metadata for the workers. Must not modify ``scheduler_output``."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:  # noqa: B027
        """The workers' reports of a step, combined over ranks. Default: ignored."""

    def request_finished(
        self, request: Request, block_ids: GroupBlockIds | None = None
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request finished (or was aborted), before its GPU blocks are freed; called once.

        Returns:
            Whether the connector keeps the blocks until ``get_finished`` reports the request as
            finished sending, and optional KV transfer params for the request's output.
            Default: ``(False, None)``.
        """
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The KV events since the last call; draining only, no other effect. Default: none."""
        return ()

    def reset_cache(self) -> bool | None:
        """Drop everything the connector caches (between steps). Returns whether it did;
        default: None (nothing to reset)."""
        return None

    # -----------------------------------------------------------------------------------------
    # Hooks of this engine (scheduler side; not in upstream vLLM's base class)
    # -----------------------------------------------------------------------------------------

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping (transfers in flight) although no request is
        unfinished (upstream's nearest hook: ``has_pending_push_work``). Default: False."""
        return False

    def tracks_request(self, req_id: str) -> bool:
        """Whether the connector still holds state under ``req_id`` (e.g. a finished request's
        transfers in flight): the engine refuses a new request with that id until then.
        Default: False."""
        return False

    def take_load_results(self) -> list[LoadResult]:
        """Loads finished since the last call, for the engine's accounting. Default: none."""
        return []

    def observe_step(self, wall_seconds: float, cpu_seconds: float) -> None:  # noqa: B027
        """The time the engine spent in this half's hooks during one step (wall, and the
        engine thread's CPU), for the connector's statistics; called once at the end of every
        step that scheduled, so it also marks the step's end. Default: ignored."""

    def get_stats(self) -> dict[str, int | float]:
        """Cumulative counters of the connector (and what it drives), for reports; no side
        effect. Default: none."""
        return {}

    def get_tier_stats(self) -> list[TierStats]:
        """Point-in-time reports of the connector's storage tiers behind the first one, in
        lookup order. Default: none."""
        return []

    def wait_for_tiers_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the tiers finished their start-up work (for reports, before the first
        request; never on the step path); False if ``timeout_s`` expired first. Default:
        True."""
        return True

    def stored_keys(self) -> frozenset[OffloadKey]:
        """The keys this connector stored itself, when ``record_block_origins`` is on. Default:
        none."""
        return frozenset()
