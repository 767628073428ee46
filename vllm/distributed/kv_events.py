# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV-cache events in vLLM 0.33's encoding, their configuration and the publisher interface.

An event says which blocks became readable in (``BlockStored``) or left (``BlockRemoved``) a
medium, or that a producer dropped everything (``AllBlocksCleared``). A ``KVEventBatch`` carries
the events of one engine step (or one idle poll) with the wall-clock time they were taken and the
producing instance's ``data_parallel_rank``.

Encoding (msgpack through msgspec), the same bytes vLLM 0.33 produces, so that routers and
indexers built for vLLM read them (``docs/fleet.md`` spells the format out):

* the batch is **array**-encoded: ``[ts, events, data_parallel_rank]`` (every position
  written, a missing rank as nil);
* each event is **map**-encoded and tagged with its class name under the key ``type``
  (``{"type": "BlockStored", "block_hashes": [...], ...}``); fields equal to their default are
  omitted, required fields are always present (None included).

Media as vLLM names them: ``GPU`` (the engine's prefix cache), ``CPU`` (the CPU primary tier),
``STORAGE`` (a secondary tier), with ``locality`` ``LOCAL`` (only this instance reads it: the fs
tier) or ``REMOTE`` (every instance sharing the store can load it: the redis tier).

Hashes are the block-hash bytes of the engine's chained prefix hashing (``BlockHash``); vLLM may
publish 64-bit integers instead (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), so the decoder takes
both (``ExternalBlockHash``).

Publishing: ``EventPublisher`` is what the engine core hands its batches to (``publish`` never
blocks); ``NullEventPublisher`` drops them; the ZeroMQ publisher and the factory that picks
one by ``KVEventsConfig`` (``make_event_publisher``) live in
``vllm.distributed.kv_event_publisher``, and the subscriber with replay in
``vllm.distributed.kv_event_subscriber``. ``KVEventsConfig`` holds vLLM's
``kv_events_config`` keys.

Example::

    encoder = KVEventEncoder()
    payload = encoder.encode(KVEventBatch(ts=time.time(), events=[BlockRemoved([h], "CPU")]))
    batch = KVEventDecoder().decode(payload)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Union

import msgspec
from typing_extensions import override

from vllm.logger import init_logger

logger = init_logger(__name__)

ExternalBlockHash = Union[bytes, int]  # noqa: UP007 (a runtime alias msgspec reads)
"""A block hash as published: the raw digest bytes (this project), or vLLM's 64-bit integer."""

MEDIUM_GPU = "GPU"
"""The engine's GPU prefix cache."""
MEDIUM_CPU = "CPU"
"""The CPU primary tier."""
MEDIUM_STORAGE = "STORAGE"
"""A secondary tier (its ``locality`` says who can read it)."""
LOCALITY_LOCAL = "LOCAL"
"""Readable by the producing instance only (the fs tier's directory)."""
LOCALITY_REMOTE = "REMOTE"
"""Readable by every instance sharing the store (the redis tier)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events with the wall-clock time (``time.time()``) they were collected; array-encoded."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every KV-cache event: map-encoded, tagged ``type`` = class name."""


class BlockStored(KVCacheEvent):
    """Blocks became readable in ``medium``.

    Attributes:
        block_hashes: the stored blocks, in order.
        parent_block_hash: hash of the block preceding the first one, when known.
        token_ids: the tokens of the blocks, when known (empty from the offload tiers, which
            track keys, not tokens).
        block_size: tokens per block.
        lora_id: LoRA adapter id (deprecated upstream in favour of ``lora_name``).
        medium: ``GPU``, ``CPU`` or ``STORAGE``.
        lora_name: LoRA adapter name, if any.
        extra_keys: per block, the extra keys of its hash (multimodal, salt), if any.
        group_idx: KV-cache group of the blocks.
        kv_cache_spec_kind: the group's attention kind, when the producer says.
        kv_cache_spec_sliding_window: the group's window in tokens, for sliding-window groups.
        locality: for ``STORAGE``: ``LOCAL`` or ``REMOTE``.
        ownership: who owns the copy, when the producer says (unused here).
        session_id: the session that stored the blocks, when the producer says (unused here).
        lookahead_token_ids: tokens past the blocks, when the producer says (unused here).
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[int] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks are no longer readable in ``medium`` (evicted or dropped)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block the producer had announced was dropped (every medium)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007 (msgspec needs a type)


class KVEventBatch(EventBatch):
    """A batch of KV-cache events; what a publisher sends and a subscriber decodes."""

    events: list[KVEvent]


class KVEventEncoder:
    """Encodes ``KVEventBatch`` objects to msgpack bytes (reusable, not thread-safe)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, batch: EventBatch) -> bytes:
        """Encode one batch."""
        return self._encoder.encode(batch)


class KVEventDecoder:
    """Decodes msgpack payloads of ``KVEventBatch`` es (reusable, not thread-safe).

    A batch holding an event type this module does not know (a newer producer's) is still
    decoded: the unknown events are skipped and counted in ``unknown_events``.
    """

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._raw = msgspec.msgpack.Decoder(type=EventBatch)
        self._event = msgspec.msgpack.Decoder(type=KVEvent)
        self._reencode = msgspec.msgpack.Encoder()
        self.unknown_events = 0

    def decode(self, payload: bytes) -> KVEventBatch:
        """Decode one batch.

        Raises:
            msgspec.DecodeError: the payload is not msgpack.
            msgspec.ValidationError: it is not a batch, or a known event is malformed.
        """
        try:
            return self._decoder.decode(payload)
        except msgspec.ValidationError:
            raw = self._raw.decode(payload)
        # The slow path, only for a batch the fast one refused: event by event.
        events: list[KVEvent] = []
        for item in raw.events:
            if isinstance(item, dict) and item.get("type") not in _KNOWN_TAGS:
                self.unknown_events += 1
                continue
            events.append(self._event.decode(self._reencode.encode(item)))
        return KVEventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)


_KNOWN_TAGS = frozenset(cls.__name__ for cls in (BlockStored, BlockRemoved, AllBlocksCleared))


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``kv_events_config`` keys: whether and where KV events are published.

    Attributes:
        enable_kv_cache_events: collect KV events at all.
        publisher: ``"zmq"`` (the ZeroMQ publisher) or ``"null"`` (collected, not sent); None
            picks ``"zmq"`` when events are enabled.
        endpoint: the PUB socket's address. As in vLLM, an address with a wildcard (``*``),
            ``::``, ``ipc://`` or ``inproc://`` is bound; any other is connected to (a
            subscriber that binds). Offset by the data-parallel rank (``offset_endpoint_port``).
        replay_endpoint: the ROUTER socket's address for replay requests (always bound), or
            None for no replay; offset like ``endpoint``.
        buffer_steps: batches kept for replay.
        hwm: ZeroMQ high-water mark of the PUB socket (messages queued per subscriber before
            ZeroMQ drops for that subscriber, which then sees a gap).
        max_queue_size: batches queued between the engine thread and the publisher thread;
            past it a batch is dropped and counted (the engine never waits).
        topic: the first frame of every message.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(
                f"kv_events_config: publisher must be 'zmq' or 'null', got {self.publisher!r}"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                check_endpoint(value, f"kv_events_config: {name}")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVEventsConfig:
        """Build from a ``kv_events_config`` mapping (vLLM's keys; unknown keys are refused)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)


def check_endpoint(endpoint: str, what: str) -> None:
    """Refuse an address ZeroMQ would not take (``tcp://host:port``, ``ipc://``, ``inproc://``)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"{what}: {endpoint!r} is not a tcp://, ipc:// or inproc:// address")
    if scheme == "tcp":
        _, colon, port = rest.rpartition(":")
        if not colon or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
            raise ValueError(f"{what}: {endpoint!r} needs a port (tcp://HOST:PORT)")


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint of rank ``data_parallel_rank``, as vLLM derives it.

    Rank 0 (and None) unchanged; ``inproc://NAME`` becomes ``inproc://NAME_dp<rank>``; a tcp
    address's port is offset by the rank (a wildcard port stays a wildcard); ``ipc://`` paths
    are unchanged, as in vLLM (give each rank its own).
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port == "*":
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    return endpoint


class EventPublisher(ABC):
    """Where the engine core hands its event batches (one publisher per engine instance).

    Ownership and threading: the engine thread calls ``publish``; it must return at once (no
    I/O, no waiting). A publisher lives as long as the instance, across engines built one after
    another (a report's baseline and offloaded runs): its sequence numbers continue.

    Args:
        data_parallel_rank: stamped on every batch that has none (the instance's index).
    """

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, batch: EventBatch) -> None:
        """Queue ``batch`` for sending, in order; never blocks (a full queue drops and counts)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Send what is queued (bounded in time), close the sockets. Idempotent."""

    @property
    def dropped_batches(self) -> int:
        """Batches dropped because the queue was full (never sent, never replayable)."""
        return 0


class NullEventPublisher(EventPublisher):
    """Drops every batch (``publisher = "null"``): events are collected, not sent."""

    @override
    def publish(self, batch: EventBatch) -> None:
        return

    @override
    def shutdown(self) -> None:
        return
