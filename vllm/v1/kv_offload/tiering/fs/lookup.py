# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Asynchronous presence probes of the filesystem tier (one ``stat`` per key, off-thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager


class FsLookupManager(AsyncLookupManager):
    """Resolves lookups of the filesystem tier on the async-lookup thread.

    Args:
        name: the tier type (names the thread ``vllm_offloading_lookup_{name}``).
        probe: ``key -> present``; runs on the lookup thread, may block on the filesystem, must
            not touch the primary tier or scheduler state.
    """

    def __init__(self, name: str, probe: Callable[[OffloadKey], bool]) -> None:
        self._probe = probe
        super().__init__(name)

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        probe = self._probe
        return [probe(key) for key in keys]
