# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The tiering manager's primary <-> secondary jobs, from start to report: one job lifecycle.

* Promotions (``PromotionQueue``): a lookup that finds a key only in a secondary tier reserves
  the key's primary row at once (``reserve_rows``: ref_cnt -1, so later lookups answer None and
  no second promotion is queued; a ``lookup_prefix`` reserves the rows of all the keys it
  promotes in one allocation) and queues the key in its request's batch for that tier;
  ``on_schedule_end`` submits one load job per (tier, request) batch.
* Jobs in flight (``TierJobTable``): submitted to their tiers (a cascade pins its primary rows
  once per tier), and finished when the tier reports them: a cascade's pins are released, a
  promotion's rows are published or freed and its keys leave the queue's ``promoting`` map.

Secondary tiers are third-party code: a tier may report a job id it was never given, a job that
another tier runs, or the same job twice. ``TierJobTable.take`` checks every report before the
manager acts on it, and the manager raises ``SecondaryTierReportError`` (naming the tier, the
job and its keys) once it has applied the tiers' valid reports: a bad report changes nothing,
and a valid report next to it is never lost (a tier reports each job only once).

The primary-side pins and reservations of the jobs are owned by internal request contexts
(``cascade_owner`` / ``promotion_owner``), not by the request the job runs for, so that the
engine's completions for that request can never release or publish them.

Threading: everything here runs on the scheduler thread, inside the tiering manager's calls.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobId, SecondaryTierManager, TierJob
from vllm.v1.kv_offload.tiering.stats import TieringStats

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.primary import CPUPrimaryTierOffloadingManager

__all__ = [
    "InFlightJob",
    "PromotionBatch",
    "PromotionQueue",
    "SecondaryTierReportError",
    "TierJobTable",
    "cascade_owner",
    "describe_keys",
    "promotion_owner",
]

logger = init_logger(__name__)

# Owner ids of internal pins and reservations. The angle brackets keep them apart from the
# engine's request ids (the engine's own "<...>" ids would still only collide with the same
# job's owner, which it cannot know).
_CASCADE_OWNER = "<tiering cascades to tier #{}>"
_PROMOTION_OWNER = "<tiering promotion batch {}>"


def cascade_owner(tier_idx: int) -> ReqContext:
    """The owner of the ``prepare_read`` pins of the cascades to one tier.

    One per tier, built once: a job allocates nothing more. Its pins are released by the job's
    own key tuple, which tiers mostly report in submission order, so the release finds it first.
    """
    return ReqContext(_CASCADE_OWNER.format(tier_idx))


def promotion_owner(batch: int) -> ReqContext:
    """The owner of one (tier, request, step) promotion batch's reserved rows."""
    return ReqContext(_PROMOTION_OWNER.format(batch))


def describe_keys(keys: tuple[OffloadKey, ...] | list[OffloadKey]) -> str:
    """``"key <hex>"`` or ``"keys <hex>, ... (n in all)"`` for error messages."""
    if len(keys) == 1:
        return f"key {keys[0].hex()}"
    shown = ", ".join(key.hex() for key in keys[:3])
    more = f", ... ({len(keys)} in all)" if len(keys) > 3 else ""
    return f"keys {shown}{more}"


@dataclass(slots=True)
class PromotionBatch:
    """Promotions one request queued for one tier during the current step.

    Attributes:
        req_context: the request (the job's ``req_context``).
        owner: owns the reserved rows in the primary (``promotion_owner``).
        keys, block_ids: the keys and their reserved rows, in lookup order.
    """

    req_context: ReqContext
    owner: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


class PromotionQueue:
    """The step's queued promotion batches, and which tier each key is promoted from."""

    def __init__(self, num_tiers: int) -> None:
        # Per tier (by index): req_id -> the batch queued this step, submitted at step end.
        self._pending: list[dict[str, PromotionBatch]] = [{} for _ in range(num_tiers)]
        self._num_queued = 0
        self._num_batches = 0  # names each batch's owner
        # key -> index of the tier it is being promoted from, from lookup until the tier
        # reports the load (for promotion_source; complete_store ignores these keys).
        self.promoting: dict[OffloadKey, int] = {}

    def __bool__(self) -> bool:
        """Whether a batch is queued (not submitted yet)."""
        return self._num_queued > 0

    def queue(
        self,
        primary: CPUPrimaryTierOffloadingManager,
        tier_idx: int,
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
        protected: Collection[OffloadKey] | None = None,
    ) -> bool | None:
        """Reserve the primary rows of ``keys`` (distinct, not resident) in one allocation and
        queue them, in order, in their request's batch for the tier.

        Args:
            protected: resident blocks the reservation's eviction must spare (see
                ``CPUOffloadingManager.reserve_rows``).

        Returns:
            None if the primary cannot make room for all of them (nothing changed); True if
            this opened a new batch for the request, False if the keys joined the request's
            batch.
        """
        pending = self._pending[tier_idx]
        entry = pending.get(req_context.req_id)
        owner = promotion_owner(self._num_batches) if entry is None else entry.owner
        rows = primary.reserve_rows(keys, owner, protected)
        if rows is None:
            return None
        opened = entry is None
        if entry is None:
            self._num_batches += 1
            entry = pending[req_context.req_id] = PromotionBatch(req_context, owner)
            self._num_queued += 1
        entry.keys.extend(keys)
        entry.block_ids.extend(rows)
        self.promoting.update(dict.fromkeys(keys, tier_idx))
        return opened

    def take_all(self) -> Iterator[tuple[int, str, PromotionBatch]]:
        """Yield and forget every queued batch as ``(tier_idx, req_id, batch)``."""
        if not self._num_queued:
            return
        for tier_idx, pending in enumerate(self._pending):
            if not pending:
                continue
            self._pending[tier_idx] = {}
            for req_id, batch in pending.items():
                self._num_queued -= 1
                yield tier_idx, req_id, batch
        assert self._num_queued == 0, f"{self._num_queued} promotion batches left queued"

    def finish(self, keys: Iterable[OffloadKey]) -> None:
        """The keys' load was reported (or failed at submit): they are no longer promoted."""
        for key in keys:
            self.promoting.pop(key, None)

    def without_promoted(self, keys: tuple[OffloadKey, ...]) -> tuple[OffloadKey, ...]:
        """``keys`` less those being promoted (a non-key is kept, for the caller's check)."""
        promoting = self.promoting
        return tuple(key for key in keys if key.__class__ is not bytes or key not in promoting)

    def clear(self) -> None:
        """Forget every batch and promotion (``reset_cache``: the primary frees the rows)."""
        for tier_idx in range(len(self._pending)):
            self._pending[tier_idx] = {}
        self._num_queued = 0
        self.promoting.clear()


class SecondaryTierReportError(RuntimeError):
    """A secondary tier broke the job contract (``SecondaryTierManager``): a tier bug.

    Raised after the manager applied every valid report of the same poll; the reports named
    here changed nothing.

    Attributes:
        problems: one line per bad report, naming the tier, the job and its keys.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


class InFlightJob(NamedTuple):
    """A job submitted and not reported yet (a named tuple: one is built per job).

    Attributes:
        tier_idx: the index of the tier it was submitted to.
        job: the job.
        owner: the context that owns the job's primary pins (cascade) or rows (promotion).
        submitted_at: ``perf_counter()`` at submit, for the job's latency sample.
    """

    tier_idx: int
    job: TierJob
    owner: ReqContext
    submitted_at: float = 0.0


class TierJobTable:
    """Every submitted, unreported job, by id; ids are unique within one tiering manager.

    Submits jobs to their tiers and applies the tiers' reports to the primary (``poll``).

    Attributes:
        num_cascades, num_promotions, num_failed: jobs submitted and failed (``get_stats``).
    """

    def __init__(
        self,
        tiers: tuple[SecondaryTierManager, ...],
        primary: CPUPrimaryTierOffloadingManager,
        promotions: PromotionQueue,
        stats: TieringStats,
    ) -> None:
        self._tiers = tiers
        self._primary = primary
        self._promotions = promotions
        self._stats = stats
        self._jobs: dict[JobId, InFlightJob] = {}
        self._next_job_id: JobId = 0
        self.num_cascades = 0
        self.num_promotions = 0
        self.num_failed = 0

    def __len__(self) -> int:
        return len(self._jobs)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator[JobId]:
        return iter(self._jobs)

    def new_id(self) -> JobId:
        job_id = self._next_job_id
        self._next_job_id += 1
        return job_id

    def submit(self, tier_idx: int, job: TierJob, owner: ReqContext) -> None:
        """Register ``job`` and hand it to its tier; a raising tier fails the job at once."""
        tier = self._tiers[tier_idx]
        entry = InFlightJob(tier_idx, job, owner, time.perf_counter())
        assert job.job_id not in self._jobs, f"job id {job.job_id} reused"
        self._jobs[job.job_id] = entry
        if job.is_promotion:
            self.num_promotions += 1
        else:
            self.num_cascades += 1
        self._stats.on_submit(tier_idx, job.is_promotion)
        try:
            if job.is_promotion:
                tier.submit_load(job)
            else:
                tier.submit_store(job)
        except Exception:
            logger.exception(
                "secondary tier #%d (%s) raised in submit_%s of job %d (%d blocks); "
                "treating the job as failed",
                tier_idx,
                tier.tier_type,
                "load" if job.is_promotion else "store",
                job.job_id,
                len(job.keys),
            )
            del self._jobs[job.job_id]
            self._finish(entry, success=False)
            self._stats.on_finish(tier_idx, job.is_promotion, len(job.keys), 0.0, False)

    def poll(self) -> None:
        """Apply every result the tiers report now (O(results)).

        Raises:
            SecondaryTierReportError: a tier reported a job not in flight on it; raised once
                every valid report of every tier was applied (tiers report each job once).
        """
        now = time.perf_counter()  # one clock read per poll, not per job
        problems: list[str] = []
        on_finish = self._stats.on_finish
        for tier_idx, tier in enumerate(self._tiers):
            for result in tier.get_finished_jobs():
                entry = self.take(tier_idx, result.job_id, problems)
                if entry is None:
                    continue
                job = entry.job
                self._finish(entry, result.success)
                on_finish(
                    tier_idx,
                    job.is_promotion,
                    len(job.keys),
                    now - entry.submitted_at,
                    result.success,
                )
        if problems:
            raise SecondaryTierReportError(problems)

    def _finish(self, entry: InFlightJob, success: bool) -> None:
        if not success:
            self.num_failed += 1
        job = entry.job
        if job.is_promotion:
            self._promotions.finish(job.keys)
            # Success makes the rows readable; failure frees them (never serve a partial row).
            self._primary.complete_write(job.keys, entry.owner, success)
        else:
            # A failed cascade is dropped: the block is just absent from that tier.
            self._primary.complete_read(job.keys, entry.owner)

    def take(self, tier_idx: int, job_id: JobId, problems: list[str]) -> InFlightJob | None:
        """Remove and return the job tier ``tier_idx`` reports as ``job_id``.

        A report that does not name a job in flight on that tier is appended to ``problems``
        and changes nothing (a job reported by the wrong tier stays in flight on its own).
        """
        entry = self._jobs.get(job_id)
        if entry is not None and entry.tier_idx == tier_idx:
            del self._jobs[job_id]
            return entry
        tier = self._tiers[tier_idx]
        if entry is None:
            problems.append(
                f"secondary tier #{tier_idx} ({tier.tier_type}) reported unknown job {job_id!r} "
                "(never submitted, already reported, or its submit raised)"
            )
        else:
            owner = self._tiers[entry.tier_idx]
            problems.append(
                f"secondary tier #{tier_idx} ({tier.tier_type}) reported job {job_id} "
                f"({'promotion' if entry.job.is_promotion else 'cascade'} of "
                f"{describe_keys(tuple(entry.job.keys))}, request "
                f"{entry.job.req_context.req_id!r}) that was submitted to tier "
                f"#{entry.tier_idx} ({owner.tier_type})"
            )
        return None

    def unreported(self) -> list[str]:
        """One line per job still in flight, naming its tier and keys (for errors)."""
        return [
            f"job {job_id} on tier #{entry.tier_idx} ({self._tiers[entry.tier_idx].tier_type}), "
            f"{describe_keys(tuple(entry.job.keys))}"
            for job_id, entry in self._jobs.items()
        ]
