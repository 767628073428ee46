# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ExampleSecondaryTierManager``: an in-memory secondary tier (type ``"example"``).

The reference implementation of ``SecondaryTierManager`` and the test double of the tiering
tests. It keeps whole primary rows in a dict with LRU order, really copies them between the
primary view and its storage, and completes every job synchronously: the copy happens inside
``submit_*`` and the result is reported by the next ``get_finished_jobs()``.

A production tier must not copy on the scheduler thread (see ``docs/writing_a_tier.md``); here
the copy of a few rows is a ``memcpy`` and synchronous completion keeps tests deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
from typing_extensions import override

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    drain_events,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TierJob

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import OffloadingSpec

logger = init_logger(__name__)

EXAMPLE_MEDIUM = "EXAMPLE"
"""Medium name of the example tier in ``OffloadingEvent.medium``."""


class ExampleSecondaryTierManager(SecondaryTierManager):
    """In-memory secondary tier with optional LRU capacity; completes jobs synchronously.

    Storage: ``key ->`` a read-only ``uint8`` array of one whole primary row (``row_bytes``
    bytes: every worker's slice of the block plus padding), in LRU order (least recently used
    first). A store job copies all its new rows out of the primary view with one indexed copy
    (``rows[ids]``), and each key keeps a view of its row of that copy; a load job copies all its
    rows into the primary view with one indexed assignment. (One ``bytes`` copy per block cost
    a sixth of a tiering run's time.) A copy's memory is freed once none of its rows is stored.

    Protection: a store job's own keys are never evicted to make room for that job. Loads only
    read the tier's storage and write the job's primary rows.

    Tier kwargs (from ``secondary_tiers`` entries in the config):
        capacity_blocks: most blocks kept; None (default) means unbounded. When a store needs
            room, least recently used blocks are evicted; a job with more distinct keys than the
            capacity fails as a whole and stores nothing.
        enable_events: record ``OffloadingEvent``s (medium ``"EXAMPLE"``) for stored and evicted
            blocks, drained by ``take_events()``.
        request_level: answer ``on_new_request`` with ``REQUEST_LEVEL`` (every block of the
            request, prefix hits included, is cascaded here); default ``BLOCK_LEVEL``.
    """

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        capacity_blocks: int | None = None,
        enable_events: bool = False,
        request_level: bool = False,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if capacity_blocks is not None and (
            isinstance(capacity_blocks, bool)
            or not isinstance(capacity_blocks, int)
            or capacity_blocks <= 0
        ):
            raise ValueError(
                f"secondary tier {tier_type!r}: capacity_blocks must be None or an integer > 0, "
                f"got {capacity_blocks!r}"
            )
        # Zero-copy uint8 array over the primary rows: shape (num_primary_blocks, row_bytes).
        self._rows: npt.NDArray[np.uint8] | None = np.asarray(primary_kv_view)
        if self._rows.ndim != 2:
            raise ValueError(
                f"secondary tier {tier_type!r}: primary_kv_view must be 2-D "
                f"(num_blocks, row_bytes), got shape {self._rows.shape}"
            )
        self._capacity = capacity_blocks
        self._request_level = bool(request_level)
        self._blocks: OrderedDict[OffloadKey, npt.NDArray[np.uint8]] = OrderedDict()
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        logger.info(
            "example tier %r: capacity_blocks=%s, row_bytes=%d",
            tier_type,
            capacity_blocks,
            self._rows.shape[1],
        )

    # -----------------------------------------------------------------------------------------
    # Required primitives
    # -----------------------------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return key in self._blocks

    @override
    def submit_store(self, job: TierJob) -> None:
        """Copy the job's primary rows into the tier (new keys only), evicting LRU blocks.

        Layout: for each ``i``, a copy of ``rows[job.block_ids[i], :]`` (``row_bytes`` bytes) is
        stored under ``job.keys[i]``.
        """
        assert not job.is_promotion, f"example tier: job {job.job_id} is a promotion"
        rows = self._require_rows()
        keys = list(job.keys)
        job_keys = set(keys)
        if self._capacity is not None and len(job_keys) > self._capacity:
            logger.warning(
                "example tier %r: store job %d has %d blocks, more than the capacity %d",
                self.tier_type,
                job.job_id,
                len(job_keys),
                self._capacity,
            )
            self._finished.append(JobResult(job.job_id, success=False))
            return
        # Distinct new keys, first occurrence wins (a key may repeat within one job).
        blocks = self._blocks
        new: dict[OffloadKey, int] = {}
        for i, key in enumerate(keys):
            if key not in blocks and key not in new:
                new[key] = i
        evicted = self._evict(len(new), protected=job_keys)
        if new:
            ids = job.block_ids
            if len(new) < len(keys):  # only some keys are new: their rows
                ids = ids[list(new.values())]
            copied = rows.take(ids, axis=0)  # one indexed copy
            copied.flags.writeable = False
            blocks.update(zip(new, copied, strict=True))
        stored = list(new)
        if self._events is not None:
            if evicted:
                self._events.append(OffloadingEvent(evicted, EXAMPLE_MEDIUM, removed=True))
            if stored:
                self._events.append(OffloadingEvent(stored, EXAMPLE_MEDIUM, removed=False))
        self._finished.append(JobResult(job.job_id, success=True))

    @override
    def submit_load(self, job: TierJob) -> None:
        """Copy ``job.keys`` into the primary rows ``job.block_ids``; fail if any is missing.

        Layout: ``rows[job.block_ids[i], :] = stored bytes of job.keys[i]`` (``row_bytes`` each).
        Nothing is written when the job fails.
        """
        assert job.is_promotion, f"example tier: job {job.job_id} is not a promotion"
        rows = self._require_rows()
        blocks = self._blocks
        keys = list(job.keys)
        if any(key not in blocks for key in keys):
            self._finished.append(JobResult(job.job_id, success=False))
            return
        if keys:
            rows[job.block_ids] = np.stack([blocks[key] for key in keys])  # one indexed copy
        move_to_end = blocks.move_to_end
        for key in keys:
            move_to_end(key)
        self._finished.append(JobResult(job.job_id, success=True))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    @override
    def drain_jobs(self) -> None:
        """Nothing to wait for: every job finished inside its ``submit_*`` call."""

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._request_level:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    # -----------------------------------------------------------------------------------------
    # Optional hooks
    # -----------------------------------------------------------------------------------------

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        # Reverse order so that the first key ends up the most recently used.
        for key in reversed(list(keys)):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        return drain_events(self._events)

    @override
    def shutdown(self) -> None:
        # Drop the array over the primary view so the primary tier can release its mapping.
        self._rows = None
        self._blocks.clear()
        self._finished.clear()

    # -----------------------------------------------------------------------------------------
    # Inspection (tests, examples)
    # -----------------------------------------------------------------------------------------

    def get_num_blocks(self) -> int:
        """Number of blocks stored."""
        return len(self._blocks)

    def get_block_bytes(self, key: OffloadKey) -> bytes | None:
        """The stored row of ``key`` (``row_bytes`` bytes), or None if absent."""
        row = self._blocks.get(key)
        return None if row is None else row.tobytes()

    def keys_lru_order(self) -> list[OffloadKey]:
        """Stored keys, least recently used first. O(blocks stored): for tests only."""
        return list(self._blocks)

    # -----------------------------------------------------------------------------------------
    # Internals
    # -----------------------------------------------------------------------------------------

    def _require_rows(self) -> npt.NDArray[np.uint8]:
        if self._rows is None:
            raise RuntimeError(f"example tier {self.tier_type!r} is shut down")
        return self._rows

    def _evict(self, num_new: int, protected: set[OffloadKey]) -> list[OffloadKey]:
        """Evict least recently used unprotected blocks so that ``num_new`` more fit."""
        if self._capacity is None:
            return []
        excess = len(self._blocks) + num_new - self._capacity
        if excess <= 0:
            return []
        victims: list[OffloadKey] = []
        for key in self._blocks:
            if key not in protected:
                victims.append(key)
                if len(victims) == excess:
                    break
        # The caller checked that the job's distinct keys fit in the capacity.
        assert len(victims) == excess, (
            f"example tier {self.tier_type!r}: could evict {len(victims)} of {excess} blocks"
        )
        for key in victims:
            del self._blocks[key]
        return victims
