# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The tiering manager's promotions: rows reserved by ``lookup``, loads submitted at step end.

A lookup that finds a key only in a secondary tier reserves the key's primary row at once
(``reserve_row``: ref_cnt -1, so later lookups answer None and no second promotion is queued)
and queues the key in its request's batch for that tier; ``on_schedule_end`` submits one load
job per (tier, request) batch. The reserved rows are owned in the primary by the batch
(``promotion_owner``), never by the request, so that no engine completion can publish them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.jobs import promotion_owner
from vllm.v1.kv_offload.tiering.primary import CPUPrimaryTierOffloadingManager

__all__ = ["PromotionBatch", "PromotionQueue"]


@dataclass(slots=True)
class PromotionBatch:
    """Promotions one request queued for one tier during the current step.

    Attributes:
        req_context: the request (the job's ``req_context``).
        owner: owns the reserved rows in the primary (see ``tiering/jobs.py``).
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
        key: OffloadKey,
        req_context: ReqContext,
    ) -> bool | None:
        """Reserve ``key``'s primary row and queue it in its request's batch for the tier.

        Returns:
            None if the primary cannot make room (nothing changed); True if this opened a new
            batch for the request, False if the key joined the request's batch.
        """
        pending = self._pending[tier_idx]
        entry = pending.get(req_context.req_id)
        owner = promotion_owner(self._num_batches) if entry is None else entry.owner
        row = primary.reserve_row(key, owner)
        if row is None:
            return None
        opened = entry is None
        if entry is None:
            self._num_batches += 1
            entry = pending[req_context.req_id] = PromotionBatch(req_context, owner)
            self._num_queued += 1
        entry.keys.append(key)
        entry.block_ids.append(row)
        self.promoting[key] = tier_idx
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

    def queued_keys(self) -> list[OffloadKey]:
        """Every key queued and not submitted yet (tests and diagnostics)."""
        return [key for pending in self._pending for b in pending.values() for key in b.keys]

    def clear(self) -> None:
        """Forget every batch and promotion (``reset_cache``: the primary frees the rows)."""
        for tier_idx in range(len(self._pending)):
            self._pending[tier_idx] = {}
        self._num_queued = 0
        self.promoting.clear()
