# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A fs tier job's I/O tasks: one ``IoTask`` per block, and the job's record of failures.

``FileSystemSecondaryTier`` turns each submitted job into ``block_tasks`` for its
``DualQueueThreadPool``: every task moves one block between its primary row and the key's block
file on an I/O thread, and appends the key to the job's ``JobRecord.failed_keys`` if it fails or
is cancelled. A promotion (load) task unpins its key in the capacity index when it ends, so the
block can be evicted again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.fs.index import CapacityIndex
from vllm.v1.kv_offload.tiering.fs.io_pool import IoTask

MoveBlock = Callable[[OffloadKey, int, bool], bool]
"""``(key, block_id, is_load) -> success``: moves one block between primary row ``block_id`` and
``key``'s file (an I/O thread calls it)."""


@dataclass(slots=True)
class JobRecord:
    """A submitted job until reported; ``failed_keys`` is appended to by I/O threads."""

    is_promotion: bool
    failed_keys: list[OffloadKey] = field(default_factory=list)


class BlockTask(IoTask):
    """Moves one block between primary row ``block_id`` and ``key``'s file."""

    __slots__ = ("_block_id", "_index", "_key", "_move", "_record")

    def __init__(
        self,
        move: MoveBlock,
        index: CapacityIndex,
        record: JobRecord,
        key: OffloadKey,
        block_id: int,
    ) -> None:
        self._move = move
        self._index = index
        self._record = record
        self._key = key
        self._block_id = block_id

    @override
    def run(self) -> bool:
        ok = False
        try:
            ok = self._move(self._key, self._block_id, self._record.is_promotion)
        finally:
            if self._record.is_promotion:
                self._index.unpin((self._key,))
            if not ok:
                self._record.failed_keys.append(self._key)
        return ok

    @override
    def cancel(self) -> None:
        if self._record.is_promotion:
            self._index.unpin((self._key,))
        self._record.failed_keys.append(self._key)


def block_tasks(
    job: JobMetadata, record: JobRecord, move: MoveBlock, index: CapacityIndex
) -> list[IoTask]:
    """One ``BlockTask`` per (key, primary row) of ``job``."""
    return [
        BlockTask(move, index, record, key, block_id)
        for key, block_id in zip(job.keys, job.block_ids.tolist(), strict=True)
    ]
