# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Checks of the tiering manager's callers: values that are not keys.

Every public method of ``TieringOffloadingManager`` refuses a bad call before it changes
anything. Most checks are the primary tier's own (``CPUOffloadingManager`` validates before it
mutates); this adds a type check before the once-per-step poll of the tiers (so a refused call
never polls).
"""

from __future__ import annotations

from collections.abc import Collection
from itertools import repeat

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, check_offload_keys

__all__ = ["check_keys_before_poll"]


def check_keys_before_poll(
    method: str, keys: Collection[OffloadKey], req_context: ReqContext
) -> None:
    """Raise ``TypeError`` unless ``keys`` is a collection of ``OffloadKey`` s (O(keys)).

    Called once per step, before the call that polls the tiers; later calls of the step leave
    the check to the primary tier, which type-checks only the keys it has not seen.
    """
    if isinstance(keys, (bytes, str)) or not all(map(isinstance, keys, repeat(bytes))):
        check_offload_keys(method, keys, req_context)
