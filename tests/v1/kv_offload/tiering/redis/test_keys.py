# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's key names (``keys``): the one codec the I/O thread writes with and the key
feed parses announcements and listings with."""

from __future__ import annotations

from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.block_format import IntegrityKey
from vllm.v1.kv_offload.tiering.redis.keys import (
    block_name,
    channel_name,
    key_prefix,
    parse_block_name,
)


def test_every_block_name_parses_back_to_its_key() -> None:
    keys = [make_offload_key(bytes([i + 1]) * 16, i) for i in range(4)]
    names = [block_name(key) for key in keys]
    assert [parse_block_name(name) for name in names] == keys
    assert len(set(names)) == len(keys)


def test_names_that_are_not_blocks_do_not_parse() -> None:
    # The channel's suffix, odd-length or non-hex text, non-ASCII bytes.
    for name in (b"stored", b"abc", b"zz", b"\xff\xfe"):
        assert parse_block_name(name) is None


def test_the_prefix_names_the_namespace_and_the_secret_s_key_id() -> None:
    assert key_prefix("ns", None) == b"kvo:ns:"
    secret = IntegrityKey(b"s" * 32)
    assert key_prefix("ns", secret) == b"kvo@" + secret.key_id.hex().encode() + b":ns:"
    assert key_prefix("ns", secret) != key_prefix("ns", IntegrityKey(b"t" * 32))


def test_the_channel_is_under_the_prefix_and_never_a_block_name() -> None:
    prefix = key_prefix("ns", None)
    channel = channel_name(prefix)
    assert channel.startswith(prefix)
    assert parse_block_name(channel[len(prefix) :]) is None
