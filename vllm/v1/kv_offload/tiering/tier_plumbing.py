# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Plumbing shared by secondary tiers that answer lookups in the background (fs, redis).

``AsyncLookupTier`` routes ``lookup`` and the request hooks to the tier's ``AsyncLookupManager``;
``primary_view_rows`` and ``check_job_rows`` check the primary view and a job's rows.
"""

from __future__ import annotations

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobMetadata, SecondaryTierManager

__all__ = ["AsyncLookupTier", "check_job_rows", "primary_view_rows"]


def primary_view_rows(view: memoryview, tier: str) -> tuple[int, int]:
    """``(num_rows, row_bytes)`` of the primary view; ValueError unless it is a C-contiguous
    memoryview of format 'B' and shape (num_blocks, row_bytes). ``tier`` names it in errors."""
    shape = view.shape or ()
    if view.format != "B" or len(shape) != 2 or not view.c_contiguous or shape[1] <= 0:
        raise ValueError(
            f"{tier} tier: the primary view must be a C-contiguous memoryview of format 'B' "
            f"and shape (num_blocks, row_bytes), got format {view.format!r}, shape {shape}"
        )
    return shape[0], shape[1]


def check_job_rows(job: JobMetadata, num_rows: int, tier: str) -> None:
    """Assert that every primary row the job names is in ``[0, num_rows)``."""
    if len(job.block_ids):
        lo, hi = int(job.block_ids.min()), int(job.block_ids.max())
        assert lo >= 0 and hi < num_rows, (
            f"{tier} tier: job {job.job_id} names primary rows [{lo}, {hi}] outside [0, {num_rows})"
        )


class AsyncLookupTier(SecondaryTierManager):
    """A secondary tier whose lookups are answered by an ``AsyncLookupManager``: at once when its
    ``answer_now`` can decide, else batched per step on a background thread.

    Subclasses set ``self._lookups`` in ``__init__``, shut it down in ``shutdown()`` and add
    ``lookup_counters()`` to their ``get_stats().counters``.
    """

    _lookups: AsyncLookupManager

    def wait_lookups_idle(self, timeout: float | None = None) -> bool:
        """Block until the lookup thread answered every batch flushed so far (a drain, as
        ``drain_jobs`` is for jobs); the next lookups of those keys answer without deferring."""
        return self._lookups.wait_idle(timeout)

    def lookup_counters(self) -> dict[str, int]:
        """``lookup_requests``, ``lookup_deferred_requests`` and ``lookup_deferred_keys`` (see
        ``AsyncLookupManager.counters``)."""
        return self._lookups.counters()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True or False at once when the tier's local view decides, else None until the
        background probe answered (a later step)."""
        return self._lookups.lookup(key, req_context)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self) -> None:
        """Post this step's lookups to the lookup thread as one batch."""
        self._lookups.flush()
