# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A value that is not the block it claims to be is never served: it is deleted and counted."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.v1.kv_offload.tiering.redis.conftest import Engine, key_of
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext


def _garbage(client: redis.Redis, good: bytes, other: bytes) -> bytes:
    return b"not a block" * 100


def _other_keys_value(client: redis.Redis, good: bytes, other: bytes) -> bytes:
    value = client.get(other)  # a valid block, of another key
    assert isinstance(value, bytes)
    return value


def _truncated(client: redis.Redis, good: bytes, other: bytes) -> bytes:
    return good[:-1000]


def _payload_bit_flip(client: redis.Redis, good: bytes, other: bytes) -> bytes:
    flipped = bytearray(good)
    flipped[-7] ^= 0x10
    return bytes(flipped)


@pytest.mark.parametrize(
    "corrupt",
    [_garbage, _other_keys_value, _truncated, _payload_bit_flip],
    ids=lambda f: f.__name__,
)
def test_corrupt_value_is_never_served_and_is_deleted(
    tmp_path: Path,
    server: RedisServer,
    engines: list[Engine],
    corrupt: Callable[[redis.Redis, bytes, bytes], bytes],
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer = Engine(tmp_path / "w", server.url)
    reader = Engine(tmp_path / "r", server.url)
    engines += [writer, reader]
    bad, other, fine = key_of(1), key_of(2), key_of(3)
    ctx = ReqContext("w")
    writer.manager.on_new_request(ctx)
    writer.store([bad, other, fine], ctx)
    client = server.client()
    bad_rkey = writer.tier.redis_key(bad)
    good_value = client.get(bad_rkey)
    assert isinstance(good_value, bytes)
    client.set(bad_rkey, corrupt(client, good_value, writer.tier.redis_key(other)))

    req = ReqContext("r")
    reader.manager.on_new_request(req)
    assert reader.promote([bad], req) == [False]  # the promotion failed; the key now misses
    assert client.exists(bad_rkey) == 0, "the invalid value was deleted"
    counters = reader.tier.get_stats().counters
    assert counters["corrupt_removed"] == 1 and counters["blocks_loaded"] == 0
    assert sum("is invalid" in r.getMessage() for r in caplog.records) == 1
    # The primary row was freed, never made readable: nothing of the bad value is served.
    assert reader.manager.primary_tier.lookup(bad, req) is not True
    # The valid blocks are still served, bit-exact.
    assert reader.promote([fine, other], req) == [True, True]
    reader.assert_cpu_holds([fine, other], req)
    client.close()
