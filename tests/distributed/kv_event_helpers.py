# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV events as the tests of the event stream, the fleet's publishers and the router build them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import BlockStored


def block_stored(
    hashes: Sequence[bytes],
    medium: str = "CPU",
    locality: str | None = None,
    block_size: int = 16,
    **fields: Any,
) -> BlockStored:
    """A ``BlockStored`` of ``hashes`` (no parent, tokens or LoRA) in ``medium``; ``fields``
    sets any other field (``group_idx``, ...)."""
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        locality=locality,
        **fields,
    )
