# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Lookups of the filesystem tier: from its index in the step that asks, else a background
``stat``.

* A key the capacity index holds (a file this instance wrote, or found by the start-up scan, the
  reconcile, a probe, a load or a store) is present at once, unless its file was given up after
  failed reads (absent at once; with other writers, probed: one of them may have replaced it).
* A key the index lacks is absent at once while this instance is the only writer of the run
  directory and its index is complete (``Reconciler.solo``: the start-up scan ended, no other
  instance registered since the last complete pass).
* Otherwise (another writer shares the directory, or the scan is still running) the key goes to
  the background probe (``BlockTransfers.probe``: one ``stat``), answered a step later.

Staleness is safe either way: a stale "present" (someone removed the file) is a failed load,
whose blocks are recomputed; a stale "absent" (another instance registered and wrote it within
the last reconcile interval) is a recompute. Every load is verified: never a wrong byte.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.fs.capacity import CapacityIndex
    from vllm.v1.kv_offload.tiering.fs.reconcile import Reconciler
    from vllm.v1.kv_offload.tiering.fs.transfers import BlockTransfers


class FsLookups(AsyncLookupManager):
    """The fs tier's lookups (see the module docstring).

    Borrowed: the index, the store and the reconciler, owned by the tier, which shuts this down
    before them.

    Args:
        name: the tier type (names the thread ``vllm_offloading_lookup_{name}``).
        index: the capacity index.
        store: probes files (lookup thread) and knows which were given up.
        reconciler: tells whether this instance is the only writer (``solo``).
    """

    def __init__(
        self, name: str, index: CapacityIndex, store: BlockTransfers, reconciler: Reconciler
    ) -> None:
        self._index = index
        self._store = store
        self._reconciler = reconciler
        super().__init__(name)

    @override
    def answer_now(self, key: OffloadKey) -> bool | None:
        solo = self._reconciler.solo
        if key in self._index:
            if not self._store.given_up(key):
                return True
            # Given up after failed reads: absent, unless another writer may have replaced the
            # file since (the probe tells a new file by its identity).
            return False if solo else None
        return False if solo else None

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        probe = self._store.probe
        return [probe(key) for key in keys]
