# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV-cache events: which blocks were stored into or removed from a medium.

Events are msgspec structs so that they encode compactly (msgpack, array-like, tagged union) and
decode into typed objects on the subscriber side. A ``KVEventBatch`` carries the events produced
by one engine step (or one idle poll) with the time they were taken.

Hashes are the block-hash bytes of the engine's chained prefix hashing (``BlockHash``), not the
connector's offload keys (the 4-byte group suffix is stripped; ``group_idx`` carries it).

Example::

    encoder = KVEventEncoder()
    payload = encoder.encode(KVEventBatch(ts=time.time(), events=[BlockRemoved([h], "CPU")]))
    batch = KVEventDecoder().decode(payload)
"""

from __future__ import annotations

from typing import Union

import msgspec

ExternalBlockHash = bytes
"""A block hash as published: the raw digest bytes."""


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every KV-cache event (tagged by class name when encoded)."""


class BlockStored(KVCacheEvent):
    """Blocks became readable in ``medium``.

    Attributes:
        block_hashes: the stored blocks, in order.
        parent_block_hash: hash of the block preceding the first one, when known.
        token_ids: the tokens of the blocks, when known (empty for offloaded blocks: the offload
            manager tracks keys, not tokens).
        block_size: tokens per block.
        lora_id: LoRA adapter id, if any.
        medium: where the blocks are (``"GPU"``, ``"CPU"``, a tier's medium name).
        group_idx: KV-cache group of the blocks, when the producer knows it.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer readable in ``medium`` (evicted or dropped)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the producer's cache was dropped."""

    medium: str | None = None


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 (msgspec needs a type)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch of events with the wall-clock time (``time.time()``) they were collected."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


class KVEventBatch(EventBatch):
    """A batch of KV-cache events; what a publisher sends and a subscriber decodes."""

    events: list[KVEvent]  # type: ignore[assignment]


class KVEventEncoder:
    """Encodes ``KVEventBatch`` objects to msgpack bytes (reusable, not thread-safe)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: KVEventBatch) -> bytes:
        """Encode one batch."""
        return self._encoder.encode(batch)


class KVEventDecoder:
    """Decodes msgpack bytes produced by ``KVEventEncoder`` back into ``KVEventBatch``."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def decode(self, payload: bytes) -> KVEventBatch:
        """Decode one batch; raises ``msgspec.ValidationError`` on a malformed payload."""
        return self._decoder.decode(payload)
