# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV events: vLLM 0.33's encoding, the decoder, ``KVEventsConfig`` and endpoint offsets."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tests.distributed.kv_event_helpers import block_stored
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecoder,
    KVEventEncoder,
    KVEventsConfig,
    offset_endpoint_port,
)


def _stored(**fields: Any) -> BlockStored:
    return block_stored(fields.pop("block_hashes", [b"\x01" * 32, b"\x02" * 32]), **fields)


def test_batch_round_trip_keeps_types_and_fields() -> None:
    batch = KVEventBatch(
        ts=1234.5,
        events=[
            _stored(group_idx=1),
            BlockRemoved(block_hashes=[b"\x03" * 32], medium="STORAGE", locality="LOCAL"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    decoded = KVEventDecoder().decode(KVEventEncoder().encode(batch))
    assert decoded == batch
    assert [type(e) for e in decoded.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert decoded.events[1].group_idx is None  # type: ignore[union-attr]


def test_batch_is_an_array_and_events_are_tagged_maps_without_defaults() -> None:
    # vLLM 0.33's bytes: [ts, events, rank] (msgspec writes every position of an array, None
    # included); each event {"type": class name, fields...}, fields equal to their default left
    # out, required ones always present (None included).
    batch = KVEventBatch(
        ts=0.5,
        events=[
            BlockRemoved([b"x"], "CPU"),
            _stored(block_hashes=[b"y"], medium="STORAGE", locality="REMOTE"),
            AllBlocksCleared(),
        ],
    )
    raw = msgspec.msgpack.decode(KVEventEncoder().encode(batch))
    assert raw == [
        0.5,
        [
            {"type": "BlockRemoved", "block_hashes": [b"x"], "medium": "CPU"},
            {
                "type": "BlockStored",
                "block_hashes": [b"y"],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 16,
                "lora_id": None,
                "medium": "STORAGE",
                "lora_name": None,
                "locality": "REMOTE",
            },
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]
    stamped = KVEventBatch(ts=0.5, events=[], data_parallel_rank=3)
    assert msgspec.msgpack.decode(KVEventEncoder().encode(stamped)) == [0.5, [], 3]


def test_decoder_reads_vllm_integer_hashes() -> None:
    # vLLM publishes 64-bit integer hashes by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [2**63 + 5], "medium": "GPU"}], 0]
    )
    batch = KVEventDecoder().decode(payload)
    assert batch.events == [BlockRemoved([2**63 + 5], "GPU")]
    assert batch.data_parallel_rank == 0


def test_decoder_skips_events_of_unknown_types() -> None:
    payload = msgspec.msgpack.encode(
        [
            1.0,
            [
                {"type": "BlockMigrated", "block_hashes": [1], "to": "elsewhere"},
                {"type": "AllBlocksCleared"},
            ],
        ]
    )
    decoder = KVEventDecoder()
    assert decoder.decode(payload).events == [AllBlocksCleared()]
    assert decoder.unknown_events == 1


def test_decoder_rejects_garbage() -> None:
    with pytest.raises(msgspec.DecodeError):
        KVEventDecoder().decode(b"\xc1 not msgpack")
    bad = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "medium": "CPU"}]])
    with pytest.raises(msgspec.ValidationError):
        KVEventDecoder().decode(bad)  # a known event without its required hashes


def test_offset_endpoint_port_follows_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://127.0.0.1:6000", 1) == "tcp://127.0.0.1:6001"
    assert offset_endpoint_port("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint_port("tcp://127.0.0.1:*", 2) == "tcp://127.0.0.1:*"
    assert offset_endpoint_port(None, 2) is None


def test_config_defaults_and_checks() -> None:
    assert KVEventsConfig().publisher == "null"
    on = KVEventsConfig(enable_kv_cache_events=True)
    assert on.publisher == "zmq" and on.endpoint == "tcp://*:5557" and on.buffer_steps == 10_000
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(publisher="kafka")
    with pytest.raises(ValueError, match="buffer_steps"):
        KVEventsConfig(buffer_steps=0)
    with pytest.raises(ValueError, match="needs a port"):
        KVEventsConfig(endpoint="tcp://127.0.0.1")
    with pytest.raises(ValueError, match="not a tcp"):
        KVEventsConfig(replay_endpoint="http://127.0.0.1:80")
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_dict({"enable_kv_cache_events": True, "endpoints": "x"})
    assert KVEventsConfig.from_dict({"topic": "kv"}).topic == "kv"
