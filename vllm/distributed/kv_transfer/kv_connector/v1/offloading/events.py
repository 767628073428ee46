# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The manager's ``OffloadingEvent`` s as KV-cache events (``BlockStored`` / ``BlockRemoved``).

Media and locality pass through as the tiers name them (vLLM's names: ``CPU``; ``STORAGE`` with
``LOCAL`` for the fs tier, ``REMOTE`` for the redis tier). The offload tiers track keys, not
tokens: a ``BlockStored`` carries no token ids and no parent hash.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    get_offload_block_hash,
    get_offload_group_idx,
)


def to_kv_events(events: Iterable[OffloadingEvent], block_size: int) -> list[KVCacheEvent]:
    """One KV event per (manager event, KV-cache group), with the keys' block hashes.

    Args:
        events: the manager's events, in order.
        block_size: tokens per offloaded block.
    """
    out: list[KVCacheEvent] = []
    for event in events:
        by_group: dict[int, list[bytes | int]] = {}
        for key in event.keys:
            by_group.setdefault(get_offload_group_idx(key), []).append(get_offload_block_hash(key))
        for group_idx, hashes in by_group.items():
            if event.removed:
                out.append(
                    BlockRemoved(
                        block_hashes=hashes,
                        medium=event.medium,
                        group_idx=group_idx,
                        locality=event.locality,
                    )
                )
            else:
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=block_size,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
                        group_idx=group_idx,
                        locality=event.locality,
                    )
                )
    return out
