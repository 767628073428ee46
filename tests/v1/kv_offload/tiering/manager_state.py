# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What tests read of a ``TieringOffloadingManager``'s inner state.

The manager's public API answers what the engine and operators ask (``lookup``,
``promotion_source``, ``num_jobs_in_flight``, ``get_stats``, ``has_pending_work``); a test that
proves "a refused call changed nothing" or "every job is reported exactly once" must see the
jobs in flight, the queued promotions and the per-request state themselves. They are read here,
in one place, and nowhere else in the tests.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobId
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.tier_jobs import InFlightJob, PromotionQueue


def jobs_in_flight(manager: TieringOffloadingManager) -> dict[JobId, InFlightJob]:
    """Every job submitted to a tier and not reported yet, by id (a snapshot)."""
    # private: the job table is the manager's; callers see only num_jobs_in_flight.
    return dict(manager._jobs._jobs)


def _promotions(manager: TieringOffloadingManager) -> PromotionQueue:
    # private: the promotion queue is the manager's; callers see only promotion_source(key).
    return manager._promotions


def promoting(manager: TieringOffloadingManager) -> dict[OffloadKey, int]:
    """Each key being promoted -> the index of the tier it comes from (a snapshot)."""
    return dict(_promotions(manager).promoting)


def queued_promotions(manager: TieringOffloadingManager) -> list[OffloadKey]:
    """Every key queued for promotion and not submitted yet (submitted at step end)."""
    # private: the batches are submitted by on_schedule_end; nothing else needs to list them.
    batches = _promotions(manager)._pending
    return [key for pending in batches for batch in pending.values() for key in batch.keys]


def request_states(manager: TieringOffloadingManager) -> dict[str, tuple[int, Any]]:
    """req_id -> (promotion batches queued, the finished request's context or None)."""
    # private: why tiers' on_request_finished is delayed is the manager's own bookkeeping.
    return {
        req_id: (state.queued_promotions, state.finished_req_context)
        for req_id, state in manager._req_state.items()
    }


def request_level_tiers(manager: TieringOffloadingManager) -> dict[str, tuple[int, ...]]:
    """req_id -> the indices of the tiers that asked for REQUEST_LEVEL offloading."""
    # private: answered to the connector only as the request's policy (on_new_request).
    return dict(manager._request_level_tiers)
