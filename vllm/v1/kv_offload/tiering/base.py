# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The secondary-tier interface.

A secondary tier (filesystem, remote store, ...) sits behind the CPU primary tier. It never touches
GPU memory: every byte flows through the primary tier's shared host region.

* Store ("cascade"): GPU -> CPU primary -> secondary. The tiering manager submits a store job once
  the GPU -> CPU copy of the blocks has completed; the primary rows stay pinned until the tier
  reports the job.
* Load ("promotion"): secondary -> CPU primary -> GPU. The tiering manager allocates primary rows
  (not readable until the job is reported) and submits a load job that fills them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from vllm.v1.kv_offload.base import (
    BlockIds,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    TierStats,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import OffloadingSpec

JobId = int
"""Id of a primary <-> secondary job, unique within one tiering manager (shared by all tiers)."""


@dataclass(slots=True, eq=False)
class TierJob:
    """One transfer between the primary tier and one secondary tier (read-only).

    Upstream vLLM names this class ``JobMetadata``; that name stays importable from here
    (``JobMetadata is TierJob``) for tiers written against upstream.

    A slotted, unfrozen dataclass without ``__post_init__``: the tiering manager creates one per
    job on the scheduler's hot path, and its ``__init__`` is plain attribute stores (a frozen
    dataclass's construction, one ``object.__setattr__`` per field, plus a ``__post_init__``
    check, cost several times more). The manager builds ``block_ids`` parallel to ``keys``
    itself, so nothing is checked here. Equality is identity (``eq=False``).

    Attributes:
        job_id: unique id; the tier reports it exactly once through ``get_finished_jobs()``.
        keys: the blocks moved, in order.
        block_ids: primary-tier rows, int64, parallel to ``keys``: row ``block_ids[i]`` of the
            primary view holds (store) or receives (load) block ``keys[i]``.
        is_promotion: True for a load (secondary -> primary), False for a store (primary ->
            secondary).
        req_context: the request on whose behalf the job runs (for a promotion, the first request
            that asked for any of its keys this step).
    """

    job_id: JobId
    keys: Collection[OffloadKey]
    block_ids: BlockIds
    is_promotion: bool
    req_context: ReqContext

    def __repr__(self) -> str:
        kind = "promotion" if self.is_promotion else "cascade"
        return (
            f"TierJob(job_id={self.job_id}, {kind}, {len(self.keys)} keys, "
            f"req_id={self.req_context.req_id!r})"
        )


JobMetadata = TierJob
"""Upstream vLLM's name of ``TierJob``."""


class JobResult(NamedTuple):
    """Outcome of a job: every block of it was moved (``success``) or the job failed as a whole.

    A named tuple (cheap to build: tiers report one per job); compares by value.
    """

    job_id: JobId
    success: bool


class SecondaryTierManager(ABC):
    """A storage tier behind the CPU primary tier.

    Contract:
        * A secondary tier never touches GPU memory; all data flows through the CPU primary tier.
        * Every method runs on the scheduler thread and must not block: I/O runs on the tier's own
          threads (or remote service) and is reported through ``get_finished_jobs()``.
        * The tier reads or writes only the primary rows named by a job's ``block_ids``, and only
          between the ``submit_*`` call and the report of that job. The framework keeps those rows
          valid (pinned for a store, reserved for a load) for exactly that window.
        * Every submitted job is reported exactly once, success or failure; a ``submit_*`` that
          raises is treated by the manager as a failed job and must not be reported again.

    Attributes:
        tier_type: the type name this tier was registered under (e.g. ``"fs"``).
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        **tier_kwargs: Any,
    ) -> None:
        """Create the tier.

        Args:
            offloading_spec: the run's offloading spec (geometry, block size, parallel sizes).
            primary_kv_view: the primary tier's rows, a ``memoryview`` of format ``"B"`` and shape
                ``(num_primary_blocks, row_bytes)``; row ``b`` holds primary block ``b`` (every
                worker's slice of it). Borrowed: valid until ``shutdown()``.
            tier_type: the registered type name.
            **tier_kwargs: the tier's own configuration; unknown keys must raise ``ValueError``.
        """
        if tier_kwargs:
            raise ValueError(
                f"secondary tier {tier_type!r} got unknown config keys {sorted(tier_kwargs)}"
            )
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Report whether the tier holds ``key``.

        Returns:
            True if present and loadable; False if absent; None if the tier cannot answer yet
            (e.g. an asynchronous probe is pending): ask again in a later step.
        """

    @abstractmethod
    def submit_store(self, job: TierJob) -> None:
        """Start copying the primary rows ``job.block_ids`` into the tier, asynchronously.

        The tier skips blocks it already holds and evicts if it needs room. It must not copy on
        the calling thread. The rows stay pinned until the job is reported.
        """

    @abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Start copying ``job.keys`` from the tier into the primary rows ``job.block_ids``.

        The rows were allocated for this job and are not readable by anyone until it is reported;
        on failure the manager frees them, so a partly written row is never served.
        """

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Return the jobs finished since the last call. Every job is reported exactly once."""

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has finished or failed.

        Never aborts a transfer mid-flight (a partial copy would corrupt a primary row or the
        tier). Queued jobs that have not started may be cancelled, but are still reported (as
        failed). After it returns the tier touches no primary row, and every result is available
        from ``get_finished_jobs()``. One of the few deliberately blocking calls (used by
        ``reset_cache``).
        """

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Return the tier's offload policy for a new request (usually BLOCK_LEVEL)."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark ``keys`` as recently used. Default: no-op."""

    def on_request_finished(self, req_context: ReqContext) -> None:  # noqa: B027
        """Called once every per-request call (submit, touch) for the request has been issued.

        Transfers for the request may still be in flight. Tiers release per-request bookkeeping
        here. Default: no-op.
        """

    def on_schedule_end(self) -> None:  # noqa: B027
        """Called once at the end of each scheduler step.

        Secondary tiers may override this for per-step cleanup or deferred work submission (e.g.
        flushing a batch of asynchronous lookups). The tiering manager calls it after it has
        submitted the step's promotions. Default: no-op.
        """

    def has_pending_work(self) -> bool:
        """Whether the tier has work in flight that needs further steps. Default: False."""
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Yield the tier's events since the last call; only drains. Default: nothing."""
        return ()

    def get_stats(self) -> TierStats | None:
        """Return a point-in-time report of the tier (occupancy and cumulative counters).

        For reports and monitoring (``OffloadingSpec.get_tier_stats``): called on the scheduler
        thread, between steps, possibly after every step, so it must be cheap and must not block
        on I/O; no side effect. Default: None (the tier reports nothing).
        """
        return None

    def wait_until_ready(self, timeout_s: float | None = None) -> bool:
        """Block until the tier's start-up work has ended (e.g. indexing the blocks it already
        holds), so that ``get_stats`` counts them.

        A tier serves requests while that work runs; this is for callers that report the
        start-up state (``OffloadingSpec.wait_for_tiers_ready``, which the CLI's runs call before
        their first request), and is never called on the step path.

        Args:
            timeout_s: the longest wait; None waits without bound.

        Returns:
            False if ``timeout_s`` expired first. Default: True (nothing to wait for).
        """
        return True

    def shutdown(self) -> None:  # noqa: B027
        """Stop the tier's threads and release its resources. Default: no-op."""
