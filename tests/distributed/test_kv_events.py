# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV events: msgspec structs and their encoder/decoder pair."""

from __future__ import annotations

import msgspec
import pytest

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecoder,
    KVEventEncoder,
)


def test_batch_round_trip_keeps_types_and_fields() -> None:
    batch = KVEventBatch(
        ts=1234.5,
        events=[
            BlockStored(
                block_hashes=[b"\x01" * 32, b"\x02" * 32],
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium="CPU",
                group_idx=1,
            ),
            BlockRemoved(block_hashes=[b"\x03" * 32], medium="STORAGE"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=2,
    )
    decoded = KVEventDecoder().decode(KVEventEncoder().encode(batch))
    assert decoded == batch
    assert [type(e) for e in decoded.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert decoded.events[1].group_idx is None  # type: ignore[union-attr]


def test_events_are_tagged_array_like() -> None:
    payload = KVEventEncoder().encode(KVEventBatch(ts=0.0, events=[BlockRemoved([b"x"], "CPU")]))
    raw = msgspec.msgpack.decode(payload)
    assert raw == [0.0, [["BlockRemoved", [b"x"], "CPU", None]], None]


def test_decoder_rejects_garbage() -> None:
    with pytest.raises(msgspec.DecodeError):
        KVEventDecoder().decode(b"\xc1 not msgpack")
    bad = msgspec.msgpack.encode([1.0, [["NoSuchEvent", 1]]])
    with pytest.raises(msgspec.ValidationError):
        KVEventDecoder().decode(bad)
