# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's key space: what its Redis keys are named, in one place.

A block's Redis key is ``<prefix><hex of its OffloadKey>``, the prefix naming the namespace (and,
with a fleet secret, the secret's key id: ``key_prefix``). The I/O thread writes and reads those
keys (``transfer.BlockTransfer.redis_key``); the key feed announces the hex part of the keys it
stored and parses it back from other writers' announcements and from the namespace's listing
(``key_feed``), on the namespace's channel (``channel_name``). Every one of them encodes and
decodes through the functions here, so that the names a writer uses and the names its readers
parse cannot drift apart.
"""

from __future__ import annotations

from typing import Final

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.block_format import IntegrityKey

KEY_PREFIX: Final = "kvo"
"""First component of every key the tier writes."""


def key_prefix(namespace: str, integrity: IntegrityKey | None) -> bytes:
    """What every key of ``namespace`` starts with: ``kvo:<namespace>:``, or with a fleet secret
    ``kvo@<key id>:<namespace>:`` (a namespace cannot contain ``@``, so the two never meet)."""
    if integrity is None:
        return f"{KEY_PREFIX}:{namespace}:".encode()
    return f"{KEY_PREFIX}@{integrity.key_id.hex()}:{namespace}:".encode()


CHANNEL_SUFFIX: Final = b"stored"
"""The namespace's channel is its key prefix followed by this. No block name is this (it is not
hex), so channels and keys never meet."""


def channel_name(prefix: bytes) -> bytes:
    """The channel on which the instances of the namespace whose keys start with ``prefix``
    announce their stores."""
    return prefix + CHANNEL_SUFFIX


def block_name(key: OffloadKey) -> bytes:
    """The part of block ``key``'s Redis key after the prefix (lower-case hex, ASCII)."""
    return key.hex().encode()


def parse_block_name(name: bytes) -> OffloadKey | None:
    """The block key that ``block_name`` turned into ``name``; None if ``name`` is not one
    (another namespace under this one's prefix, a message that is not an announcement)."""
    try:
        return OffloadKey(bytes.fromhex(name.decode("ascii")))
    except (UnicodeDecodeError, ValueError):
        return None
