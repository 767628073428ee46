# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Multi-tier offloading: a CPU primary tier fronting write-through secondary tiers.

Principles:

1. **Write-through to every tier.** Every block stored in the primary tier is cascaded to ALL
   secondary tiers, once its GPU -> CPU copy has completed (``complete_store``).
2. **The primary tier is the only gateway to the GPU.** Secondary tiers read and write primary
   rows; workers move data between GPU and primary rows.
3. **Staged promotion.** A block found only in a secondary tier is copied secondary -> primary
   first ("promotion"); ``lookup`` answers None ("ask again") until it is readable in primary.
4. **ref_cnt is the protection.** A cascade pins the block's primary row once per tier
   (``prepare_read``) until that tier reports the job; a promotion reserves a row that stays
   unreadable (ref_cnt -1) until its job is reported.
5. **One per-step pump.** All per-step work (polling tier completions, submitting the step's
   promotions, tier hooks) happens in ``on_schedule_end()``; ``take_events()`` only drains.

The primary tier is ``CPUPrimaryTierOffloadingManager`` (``tiering/primary.py``, re-exported
here); this module holds the ``TieringOffloadingManager`` that drives it and the tiers.

Threading: every method runs on the scheduler thread. Tiers do their I/O on their own threads
and report through ``get_finished_jobs()``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat

import numpy as np
from typing_extensions import override

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    BLOCK_METHODS,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    check_offload_key,
    check_offload_keys,
    key_sequence,
    refuse_after_shutdown,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus
from vllm.v1.kv_offload.metrics import MetricsRecorder
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TierJob

# Upstream vLLM's path of the primary tier (its own module here: tiering/primary.py).
from vllm.v1.kv_offload.tiering.primary import CPUPrimaryTierOffloadingManager
from vllm.v1.kv_offload.tiering.stats import TieringStats
from vllm.v1.kv_offload.tiering.tier_jobs import (
    PromotionQueue,
    SecondaryTierReportError,
    TierJobTable,
    cascade_owner,
)

__all__ = [
    "CPUPrimaryTierOffloadingManager",
    "SecondaryTierReportError",
    "TieringOffloadingManager",
]

logger = init_logger(__name__)

# The methods a shut-down manager refuses (``shutdown``): every one that reads or changes
# blocks, requests or the step.
_REFUSED_AFTER_SHUTDOWN = (
    *BLOCK_METHODS,
    "on_new_request",
    "on_request_finished",
    "on_schedule_end",
    "reset_cache",
)


def _check_keys_before_poll(
    method: str, keys: Collection[OffloadKey], req_context: ReqContext
) -> None:
    """Raise ``TypeError`` unless ``keys`` is a collection of ``OffloadKey`` s (O(keys)).

    The tiering manager's one check of its callers' keys, made before anything a refused call
    must not reach: the step's poll of the tiers (``prepare_load``) and ``lookup_prefix``'s scan,
    whose primary misses may adapt ARC and whose tiers' answers may queue probes. Every other
    check is the primary's, which the call reaches next.
    """
    if isinstance(keys, (bytes, str)) or not all(map(isinstance, keys, repeat(bytes))):
        check_offload_keys(method, keys, req_context)


@dataclass(slots=True)
class _RequestState:
    """Per-request bookkeeping that delays secondary tiers' ``on_request_finished``.

    The request's pending GPU stores (whose ``complete_store`` submits their cascades) are the
    primary's (``has_pending_stores``), key by key: the engine may complete one
    ``prepare_store`` in several parts. Promotions' rows are owned by their batches, not the
    request, so they are not among them.

    Attributes:
        queued_promotions: (tier, request) promotion batches queued but not submitted yet.
        finished_req_context: set once the request finished; tiers are told when no store or
            promotion batch of it is pending.
    """

    queued_promotions: int = 0
    finished_req_context: ReqContext | None = None


class TieringOffloadingManager(OffloadingManager):
    """A CPU primary tier with write-through secondary tiers and staged promotion.

    Step lifecycle (driven by the connector's ``build_connector_meta()``, once per step):
    ``on_schedule_end()`` polls tier completions (unless already polled since the last reset),
    resets the polling gate, submits the step's promotions (one ``submit_load`` per
    (tier, request)) and then calls every tier's ``on_schedule_end()``. ``take_events()`` only
    drains events.

    Protection:
        * Cascade: ``complete_store(success=True)`` pins the stored blocks once per tier; each pin
          is released when that tier reports the job, success or failure.
        * Promotion: ``lookup`` reserves the block's primary row at once (ref_cnt -1), so every
          later lookup of it answers None and no second promotion is queued; the row becomes
          readable (or is freed) when the tier reports the load.
        * A tier that raises inside ``submit_*`` is treated as having failed the job at once:
          pins are released / reserved rows freed, and no job is left behind.
        * Those pins and reserved rows are owned in the primary by internal contexts, not by the
          request (``tiering/tier_jobs.py``): the engine's ``complete_load`` /
          ``complete_store`` for the request can release or publish only what its own
          ``prepare_*`` calls took.

    Errors: every public method validates its arguments and the keys' states before it changes
    anything (as ``CPUOffloadingManager`` does), including before it submits any tier job:
    ``TypeError`` for values that are not keys, ``OffloadKeyStateError`` (a ``ValueError``) for
    a key in the wrong state (e.g. ``prepare_load`` of a key being promoted, ``complete_store``
    of a key another request is writing), ``RuntimeError`` after ``shutdown()``. A tier that
    breaks the job contract (reports an unknown job, another tier's job, or a job twice) gets
    ``SecondaryTierReportError`` from the poll that saw it, after the valid reports were
    applied; the bad reports change nothing.

    Where the checks are: the tiering manager checks only what the primary cannot, at its own
    boundary: the type of the keys before the step's poll of the tiers (a refused call polls
    nothing), and, in ``shutdown()``, the refusal of every later call. The states of keys are
    checked by the primary's public methods, which the engine's calls reach; the manager's own
    calls into the primary (cascades, promotions, their completions) take the exact-match fast
    paths and are not re-validated.

    Args:
        primary_tier: the CPU primary tier (owned from now on; shut down last).
        secondary_tiers: the tiers, in lookup order (owned; shut down first).
    """

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: Sequence[SecondaryTierManager] | None = None,
    ) -> None:
        self._primary = primary_tier
        self._tiers: tuple[SecondaryTierManager, ...] = tuple(secondary_tiers or ())
        # Who owns the cascades' pins in the primary, per tier (never a request).
        self._cascade_owners = tuple(cascade_owner(i) for i in range(len(self._tiers)))
        # The step's queued promotions and the keys being promoted.
        self._promotions = PromotionQueue(len(self._tiers))
        # Keys ``probe`` found only in a tier during this step -> that tier's index; a lookup
        # in the same step promotes from it. Cleared when the step ends: a tier's answer is
        # only as fresh as the step that asked.
        self._probed: dict[OffloadKey, int] = {}
        self._processed_jobs_this_step = False
        # req_id -> indices of the tiers that asked for REQUEST_LEVEL offloading.
        self._request_level_tiers: dict[str, tuple[int, ...]] = {}
        self._req_state: dict[str, _RequestState] = {}
        self._shut_down = False
        # The primary's two lookup probes, bound once: lookup() calls them directly.
        # (see CachePolicy.lookup_table: an entry of type exactly BlockStatus is the key's
        # resident block; anything else, or no entry, means asking policy.lookup).
        table = primary_tier.policy.lookup_table()
        self._primary_lookup_get = (table if table is not None else {}).get
        self._primary_policy_lookup = primary_tier.policy.lookup
        # Counters for get_stats(); lookups are the primary's hits and misses.
        self._lookup_hits = 0
        self._lookup_misses = 0
        # Per-tier counters and job samples for monitoring (``tiering_stats``).
        self._tiering_stats = TieringStats(len(self._tiers))
        # Every submitted, unreported primary <-> secondary job.
        self._jobs = TierJobTable(self._tiers, primary_tier, self._promotions, self._tiering_stats)

    # -----------------------------------------------------------------------------------------
    # Introspection
    # -----------------------------------------------------------------------------------------

    @property
    def primary_tier(self) -> CPUPrimaryTierOffloadingManager:
        """The CPU primary tier."""
        return self._primary

    @property
    def secondary_tiers(self) -> tuple[SecondaryTierManager, ...]:
        """The secondary tiers, in lookup order."""
        return self._tiers

    @property
    def tiering_stats(self) -> TieringStats:
        """Per-tier lookup, hit and job counters and finished-job samples (monitoring)."""
        return self._tiering_stats

    @property
    def num_jobs_in_flight(self) -> int:
        """Jobs submitted to tiers and not reported yet."""
        return len(self._jobs)

    # -----------------------------------------------------------------------------------------
    # Job plumbing
    # -----------------------------------------------------------------------------------------

    def _maybe_process_finished_jobs(self) -> None:
        """Poll every tier's finished jobs, at most once between two resets of the gate.

        The gate ``_processed_jobs_this_step`` is set here and reset in ``on_schedule_end()``
        (and in ``reset_cache()``), so tiers are polled at most once per step however many
        ``lookup``/``prepare_load``/``prepare_store`` calls the step makes.
        """
        if self._processed_jobs_this_step:
            return
        self._processed_jobs_this_step = True
        self._jobs.poll()

    def _cascade(
        self, keys: tuple[OffloadKey, ...], req_context: ReqContext, tier_indices: Iterable[int]
    ) -> None:
        """Write ready primary blocks ``keys`` through to the given tiers, one pin per tier.

        The pins are owned by the tier's cascade owner (``cascade_owner``), not by the request.
        """
        for tier_idx in tier_indices:
            job_id = self._jobs.new_id()
            owner = self._cascade_owners[tier_idx]
            spec = self._primary.prepare_read(keys, owner)
            assert isinstance(spec, CPULoadStoreSpec), f"primary returned {type(spec).__name__}"
            job = TierJob(
                job_id=job_id,
                keys=keys,
                block_ids=spec.block_ids,
                is_promotion=False,
                req_context=req_context,
            )
            self._jobs.submit(tier_idx, job, owner)

    def _initiate_promotion(
        self,
        tier_idx: int,
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
        protected: Collection[OffloadKey] | None = None,
    ) -> bool:
        """Reserve the primary rows of ``keys`` now (all or none; the eviction spares the
        resident blocks ``protected``) and queue their load from the tier for the end of the
        step.

        Returns:
            False if the primary tier cannot make room (the caller reports a miss).
        """
        opened = self._promotions.queue(self._primary, tier_idx, keys, req_context, protected)
        if opened is None:
            return False
        if opened:
            self._get_req_state(req_context.req_id).queued_promotions += 1
        return True

    def _flush_pending_promotions(self) -> None:
        """Submit the step's promotions: one ``submit_load`` per (tier, request)."""
        for tier_idx, req_id, batch in self._promotions.take_all():
            job = TierJob(
                job_id=self._jobs.new_id(),
                keys=tuple(batch.keys),
                block_ids=np.array(batch.block_ids, dtype=np.int64),
                is_promotion=True,
                req_context=batch.req_context,
            )
            self._jobs.submit(tier_idx, job, batch.owner)
            state = self._req_state.get(req_id)
            assert state is not None and state.queued_promotions > 0, (
                f"request {req_id}: promotion batch submitted without queued-batch count"
            )
            state.queued_promotions -= 1
            self._maybe_finish_secondary_tiers(req_id)

    # -----------------------------------------------------------------------------------------
    # Request state
    # -----------------------------------------------------------------------------------------

    def _get_req_state(self, req_id: str) -> _RequestState:
        state = self._req_state.get(req_id)
        if state is None:
            state = self._req_state[req_id] = _RequestState()
        return state

    def _maybe_finish_secondary_tiers(self, req_id: str) -> None:
        """Tell the tiers a request finished once no cascade or promotion of it is pending."""
        state = self._req_state.get(req_id)
        if state is None or state.queued_promotions or self._primary.has_pending_stores(req_id):
            return
        del self._req_state[req_id]
        req_context = state.finished_req_context
        if req_context is None:
            return  # still running: nothing pending any more, nothing to tell yet
        self._request_level_tiers.pop(req_id, None)
        for tier in self._tiers:
            tier.on_request_finished(req_context)

    # -----------------------------------------------------------------------------------------
    # OffloadingManager
    # -----------------------------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if readable in primary; None if in flight or being promoted; False otherwise.

        On a primary miss the tiers are asked in order; the first that holds the key gets a
        promotion queued (its primary row reserved now, the load submitted at step end) and the
        answer is None. If the primary cannot make room the answer is False (recompute rather
        than retry forever). A tier answering None makes the overall answer None unless a later
        tier starts a promotion. A key ``probe`` found in a tier in this step is promoted from
        that tier without asking again.
        """
        # The common case (the step's poll done, a primary hit) costs no call below this one:
        # a probe of the primary policy's lookup table. The primary's hit/miss counters are
        # kept here, since its own lookup() is bypassed (get_stats and the tier metrics add
        # them).
        if key.__class__ is not bytes:
            check_offload_key("lookup", key, req_context)
        if not self._processed_jobs_this_step:
            self._maybe_process_finished_jobs()
        block = self._primary_lookup_get(key)
        if block.__class__ is not BlockStatus:
            block = self._primary_policy_lookup(key)
        if block is not None:
            if block.ref_cnt < 0:
                return None  # being written (a GPU store or a promotion in flight)
            self._lookup_hits += 1
            return True
        if self._probed:
            tier_idx = self._probed.pop(key, None)
            if tier_idx is not None:
                # Probed this step and found in that tier (counted then): promote it now.
                return None if self._initiate_promotion(tier_idx, (key,), req_context) else False
        return self._lookup_in_tiers(key, req_context, promote=True)

    @override
    def lookup_prefix(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> list[bool | None]:
        """``lookup`` of ``keys`` in order up to the first False, its promotions reserved at
        the end in one allocation that evicts none of the blocks the call found readable.

        Each key is answered as ``lookup`` answers it; the promotions of the keys only a tier
        holds are collected as the scan goes (None, as ``lookup`` answers them) and, when they
        all come from one tier, reserved in one ``reserve_rows``. If the primary cannot make
        room for all of them (or they come from several tiers), they are reserved one by one
        in order, and the first that finds no room is answered False, ending the scan there.
        """
        keys = key_sequence("lookup_prefix", keys, req_context)
        # Every key, before the poll and the scan: a primary miss may adapt ARC's target and a
        # tier's answer may queue a probe, so a refused call must not reach either.
        _check_keys_before_poll("lookup_prefix", keys, req_context)
        if not self._processed_jobs_this_step:
            self._maybe_process_finished_jobs()
        scan_resident = self._primary.scan_resident
        probed = self._probed
        results: list[bool | None] = []
        # (position in results, tier index, key) of each key to promote.
        found: list[tuple[int, int, OffloadKey]] = []
        # The same keys, to answer a key that comes twice as lookup would (being promoted).
        to_promote: set[OffloadKey] = set()
        i = scan_resident(keys, 0, results, req_context)
        while i < len(keys):
            key = keys[i]  # a primary miss
            tier_idx = probed.pop(key, None) if probed else None
            if tier_idx is None and key in to_promote:
                result: bool | None = None  # the same key again: as lookup finds it reserved
            else:
                if tier_idx is None:
                    tier_idx, result = self._ask_tiers(key, req_context)
                if tier_idx is not None:
                    found.append((len(results), tier_idx, key))
                    to_promote.add(key)
                    result = None
            results.append(result)
            if result is False:
                break
            i = scan_resident(keys, i + 1, results, req_context)
        if found:
            self._promote_found(results, found, keys, req_context)
        self._lookup_hits += results.count(True)
        return results

    def _promote_found(
        self,
        results: list[bool | None],
        found: list[tuple[int, int, OffloadKey]],
        keys: Sequence[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """Reserve and queue the promotions ``lookup_prefix`` found (``(position in results,
        tier index, key)`` each), sparing the blocks it answered readable; where no room is
        left, answer that key False and drop the answers after it."""
        # The keys to promote are not resident: only the readable ones need sparing. (The
        # scan may have stopped early: the answers are a prefix of the keys.)
        protected = {key for key, result in zip(keys, results, strict=False) if result is True}
        tier_idx = found[0][1]
        if all(t == tier_idx for _, t, _ in found) and self._initiate_promotion(
            tier_idx, [key for _, _, key in found], req_context, protected
        ):
            return
        for position, tier_idx, key in found:
            if not self._initiate_promotion(tier_idx, (key,), req_context, protected):
                results[position] = False
                del results[position + 1 :]
                return

    @override
    def probe(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """``lookup`` without the promotion: a key only a tier holds answers None, and the tier
        is remembered until the step ends, so that a ``lookup`` of it in this step promotes it
        from that tier without asking the tiers (or counting the lookup) again."""
        if key.__class__ is not bytes:
            check_offload_key("probe", key, req_context)
        if not self._processed_jobs_this_step:
            self._maybe_process_finished_jobs()
        block = self._primary_lookup_get(key)
        if block.__class__ is not BlockStatus:
            block = self._primary_policy_lookup(key)
        if block is not None:
            if block.ref_cnt < 0:
                return None
            self._lookup_hits += 1
            return True
        if key in self._probed:
            return None  # probed before in this step: found in a tier, counted then
        return self._lookup_in_tiers(key, req_context, promote=False)

    def _lookup_in_tiers(
        self, key: OffloadKey, req_context: ReqContext, promote: bool
    ) -> bool | None:
        """``lookup`` (``promote``) or ``probe`` after a primary miss: ask the tiers in order."""
        tier_idx, result = self._ask_tiers(key, req_context)
        if tier_idx is None:
            return result
        if not promote:
            self._probed[key] = tier_idx
            return None
        return None if self._initiate_promotion(tier_idx, (key,), req_context) else False

    def _ask_tiers(
        self, key: OffloadKey, req_context: ReqContext
    ) -> tuple[int | None, bool | None]:
        """After a primary miss, ask the tiers in order: ``(index, None)`` of the first that holds
        the key, else ``(None, None)`` if a tier's answer is pending, ``(None, False)`` if none
        holds it."""
        self._lookup_misses += 1
        any_pending = False
        for tier_idx, tier in enumerate(self._tiers):
            tier_result = tier.lookup(key, req_context)
            if tier_result is True:
                # Only hits are counted here: how many lookups reached each tier follows from
                # the primary's misses and the faster tiers' hits (TieringStats.report).
                self._tiering_stats.hits[tier_idx] += 1
                return tier_idx, None
            if tier_result is None:
                any_pending = True
        return None, None if any_pending else False

    @override
    def promotion_source(self, key: OffloadKey) -> str | None:
        tier_idx = self._promotions.promoting.get(key)
        return None if tier_idx is None else self._tiers[tier_idx].tier_type

    @override
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        """Pin ready blocks ``keys`` for the request (finished tier jobs are applied first).

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: a key is not readable (absent, being stored or promoted).
            RuntimeError: the manager is shut down.
        """
        if not self._processed_jobs_this_step:
            _check_keys_before_poll("prepare_load", keys, req_context)
            self._maybe_process_finished_jobs()
        return self._primary.prepare_load(keys, req_context)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._primary.touch(keys, req_context)
        for tier in self._tiers:
            tier.touch(keys, req_context)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Release pins the request took with ``prepare_load`` (never a cascade's pins).

        Raises:
            OffloadKeyStateError: the request does not hold that many pins on a key.
            TypeError, RuntimeError: as ``prepare_load``.
        """
        self._primary.complete_load(keys, req_context)

    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate primary rows for the new keys (finished cascades are released first).

        For tiers that asked for REQUEST_LEVEL offloading, the keys already ready in primary are
        cascaded to those tiers now (new keys are cascaded by ``complete_store``).

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey`` (nothing is allocated).
            RuntimeError: the manager is shut down.
        """
        if not self._processed_jobs_this_step:
            _check_keys_before_poll("prepare_store", keys, req_context)
            # Release finished cascades' pins before the primary picks eviction victims.
            self._maybe_process_finished_jobs()
        output = self._primary.prepare_store(keys, req_context)
        if output is None:
            return None
        req_id = req_context.req_id
        request_level_tiers = self._request_level_tiers.get(req_id)
        if request_level_tiers:
            new_keys = set(output.keys_to_store)
            get = self._primary.policy.get
            existing: list[OffloadKey] = []
            for key in dict.fromkeys(keys):
                if key in new_keys:
                    continue
                block = get(key)
                if block is not None and block.is_ready:
                    existing.append(key)
            if existing:
                self._cascade(tuple(existing), req_context, request_level_tiers)
        return output

    @override
    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Finish the request's primary stores among ``keys``; on success cascade those keys to
        every tier (one pin each).

        As ``CPUOffloadingManager.complete_store`` (upstream vLLM's contract): keys may be any
        part of the request's pending stores (the rest may come in later calls), and keys that
        are not pending for it are ignored: absent ones, already stored ones (also while
        cascades pin them), and ones being promoted from a secondary tier (stored before; their
        row belongs to the promotion). Only the keys this call made readable are cascaded.

        Raises:
            OffloadKeyStateError: a key is being written for another request's store. Nothing
                changed.
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            RuntimeError: the manager is shut down.
        """
        done = keys if type(keys) is tuple else tuple(keys)
        if self._promotions.promoting:
            done = self._promotions.without_promoted(done)
        # The primary validates every key before it changes anything; only then are cascades
        # submitted.
        completed = self._primary.finish_store(done, req_context, success)
        if success and completed and self._tiers:
            self._cascade(completed, req_context, range(len(self._tiers)))
        if self._req_state:
            self._maybe_finish_secondary_tiers(req_context.req_id)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """REQUEST_LEVEL if any tier asks for it (those tiers get every block), else BLOCK_LEVEL."""
        primary_policy = self._primary.on_new_request(req_context).policy
        request_level = tuple(
            tier_idx
            for tier_idx, tier in enumerate(self._tiers)
            if tier.on_new_request(req_context).policy is OffloadPolicy.REQUEST_LEVEL
        )
        if request_level:
            self._request_level_tiers[req_context.req_id] = request_level
        if request_level or primary_policy is OffloadPolicy.REQUEST_LEVEL:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        """Tell the primary now and the tiers once the request's cascades were all submitted."""
        self._primary.on_request_finished(req_context)
        state = self._get_req_state(req_context.req_id)
        state.finished_req_context = req_context
        self._maybe_finish_secondary_tiers(req_context.req_id)

    @override
    def take_events(self) -> Iterator[OffloadingEvent]:
        """Yield the primary's events, then each tier's in order. Nothing else."""
        yield from self._primary.take_events()
        for tier in self._tiers:
            yield from tier.take_events()

    @override
    def on_schedule_end(self) -> None:
        """End of a scheduler step: poll -> reset gate -> flush promotions -> tier hooks.

        A ``SecondaryTierReportError`` from the poll is raised after the rest of the step ran.
        """
        try:
            self._maybe_process_finished_jobs()
        finally:
            self._processed_jobs_this_step = False
            self._probed.clear()
            self._flush_pending_promotions()
            for tier in self._tiers:
                tier.on_schedule_end()

    @override
    def has_pending_work(self) -> bool:
        """True while a tier job is in flight or queued, or the primary or a tier says so.

        False after ``shutdown()``: nothing can progress any more.
        """
        if self._shut_down:
            return False
        return (
            bool(self._jobs)
            or bool(self._promotions)
            or self._primary.has_pending_work()
            or any(tier.has_pending_work() for tier in self._tiers)
        )

    @override
    def reset_cache(self) -> None:
        """Drain every tier, drop unsubmitted promotions and reset the primary.

        Blocks until every tier job has finished (``drain_jobs``). Secondary tiers keep their
        data. Requests that already finished get their delayed ``on_request_finished`` and are
        forgotten; running requests keep their REQUEST_LEVEL tiers.

        Raises:
            SecondaryTierReportError: a tier misreported a job, or did not report every job
                after ``drain_jobs()``; nothing was reset (rows a tier may still touch stay
                pinned or reserved).
            RuntimeError: the manager is shut down.
        """
        for tier in self._tiers:
            tier.drain_jobs()
        self._jobs.poll()
        if self._jobs:
            raise SecondaryTierReportError(
                [
                    "reset_cache: tiers did not report jobs after drain_jobs(): "
                    + ", ".join(self._jobs.unreported())
                ]
            )
        # Never submitted: no I/O touches their reserved rows, which the primary reset frees.
        self._promotions.clear()
        self._probed.clear()
        req_states, self._req_state = self._req_state, {}
        for req_id, state in req_states.items():
            if state.finished_req_context is not None:
                self._request_level_tiers.pop(req_id, None)
                for tier in self._tiers:
                    tier.on_request_finished(state.finished_req_context)
        # The primary zeroes its counters; the tiers' lookup counts derive from its misses.
        self._tiering_stats.primary_misses_before_reset += self._primary_misses()
        self._primary.reset_cache()
        self._lookup_hits = 0
        self._lookup_misses = 0
        # Running requests keep their REQUEST_LEVEL tiers: their later prepare_store calls must
        # still cascade what is in the primary (finished ones were dropped above). Their
        # counters restart at zero: pre-reset jobs are never completed.
        self._processed_jobs_this_step = False

    def _primary_misses(self) -> int:
        """The primary's misses: its own counter plus those of the lookups made here."""
        return int(self._primary.get_stats()["misses"]) + self._lookup_misses

    @override
    def get_stats(self) -> dict[str, int | float]:
        """The primary's counters plus the tiering job counters (``tiering_*``)."""
        stats: dict[str, int | float] = dict(self._primary.get_stats())
        stats["hits"] += self._lookup_hits
        stats["misses"] += self._lookup_misses
        stats["tiering_jobs_in_flight"] = len(self._jobs)
        stats["tiering_cascades_submitted"] = self._jobs.num_cascades
        stats["tiering_promotions_submitted"] = self._jobs.num_promotions
        stats["tiering_jobs_failed"] = self._jobs.num_failed
        return stats

    @override
    def report_metrics(self, recorder: MetricsRecorder) -> None:
        """Per-tier lookups, jobs and job samples, and each tier's ``get_stats()`` (the primary's
        counters come from ``get_stats()``)."""
        row_bytes = 0
        if not self._shut_down:
            view = self._primary.get_kv_memoryview()  # (num_blocks, row_bytes)
            row_bytes = view.nbytes // max(len(view), 1)
        self._tiering_stats.report(recorder, self._tiers, row_bytes, self._primary_misses())

    @override
    def shutdown(self) -> None:
        """Shut every tier down (in order), then the primary; idempotent.

        Every component is shut down even if an earlier one raises; the first error is re-raised
        afterwards. From now on every call that reads or changes blocks or steps the manager
        raises ``RuntimeError`` (``refuse_after_shutdown``); ``take_events``, ``get_stats`` and
        ``report_metrics`` still answer, ``has_pending_work`` answers False.
        """
        if self._shut_down:
            return
        self._shut_down = True
        refuse_after_shutdown(self, _REFUSED_AFTER_SHUTDOWN)
        first_error: BaseException | None = None
        for tier_idx, tier in enumerate(self._tiers):
            try:
                tier.shutdown()
            except Exception as e:
                logger.exception("secondary tier #%d (%s) failed to shut down", tier_idx, tier)
                first_error = first_error or e
        try:
            self._primary.shutdown()
        except Exception as e:
            logger.exception("primary tier failed to shut down")
            first_error = first_error or e
        if first_error is not None:
            raise first_error
