# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Checks of the tiering manager's callers: values that are not keys, keys being promoted.

Every public method of ``TieringOffloadingManager`` refuses a bad call before it changes
anything. Most checks are the primary tier's own (``CPUOffloadingManager`` validates before it
mutates); these helpers add what only the tiering manager knows: which keys are being promoted,
and a type check before the once-per-step poll of the tiers (so a refused call never polls).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import repeat

from vllm.v1.kv_offload.base import (
    OffloadKey,
    OffloadKeyStateError,
    ReqContext,
    check_offload_keys,
)
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

__all__ = ["check_keys_before_poll", "explain_refusal"]


def check_keys_before_poll(
    method: str, keys: Collection[OffloadKey], req_context: ReqContext
) -> None:
    """Raise ``TypeError`` unless ``keys`` is a collection of ``OffloadKey`` s (O(keys)).

    Called once per step, before the call that polls the tiers; later calls of the step leave
    the check to the primary tier, which type-checks only the keys it has not seen.
    """
    if isinstance(keys, (bytes, str)) or not all(map(isinstance, keys, repeat(bytes))):
        check_offload_keys(method, keys, req_context)


def explain_refusal(
    error: OffloadKeyStateError,
    promoting: dict[OffloadKey, int],
    tiers: Sequence[SecondaryTierManager],
) -> OffloadKeyStateError:
    """The primary tier's refusal of a call, naming the secondary tier if the key is promoted.

    A promoted key's row is reserved in the primary for the promotion, so the primary sees it
    only as "being written" by an internal owner; the caller needs to know it is a promotion.
    """
    tier_idx = promoting.get(error.key)
    if tier_idx is None:
        return error
    return OffloadKeyStateError(
        error.method,
        error.key,
        error.req_id,
        f"being promoted from secondary tier #{tier_idx} ({tiers[tier_idx].tier_type}); "
        "its row is written by that tier, not by a GPU store",
        "a key whose store this request prepared and has not completed",
    )
