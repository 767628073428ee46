# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``PrefixIndex``: which instance holds which KV block, in which medium, from KV events alone.

The index is fed the ``KVEventBatch`` es every instance publishes (``docs/fleet.md``) and keeps,
per block hash, the places it can be loaded from:

* ``GPU``, ``CPU`` and ``STORAGE``/``LOCAL`` copies belong to the instance that announced them;
* a ``STORAGE``/``REMOTE`` copy (the redis tier) is loadable by **every** instance sharing the
  store, whichever announced it: it counts for all of them.

``match`` walks a prompt's block hashes (the chained prefix hashes, computed the way the
instances compute them) and returns, per instance, how many of the prompt's leading tokens it
would serve from each place, the way an instance serves a prefix: its GPU prefix cache first,
then its offload tiers in lookup order (CPU, then local storage, then the shared store), the
first block found nowhere ending the prefix. A caller may add blocks it knows an instance's GPU
holds or is about to hold (``match``'s ``on_gpu``: the router's requests in flight there, whose
blocks are computed, or being computed, and pinned in that GPU pool until they finish).

Events carry the block size of their medium; a block of ``block_size`` tokens is named by the
hash of its last hashed piece, so the index serves a prompt hashed at any divisor of the sizes.

Threading: not thread-safe; the owner (``EventFeed``) serialises ``apply`` and ``match``.
"""

from __future__ import annotations

import enum
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_events import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
)


class Place(enum.IntEnum):
    """Where an instance finds a block, in the order it looks (cheapest first)."""

    GPU = 0
    CPU = 1
    LOCAL_STORAGE = 2
    SHARED_STORAGE = 3


def place_of(medium: str | None, locality: str | None) -> Place | None:
    """The place an event's ``medium``/``locality`` names (None: not one the router scores)."""
    if medium == MEDIUM_GPU:
        return Place.GPU
    if medium == MEDIUM_CPU:
        return Place.CPU
    if medium == MEDIUM_STORAGE:
        return Place.SHARED_STORAGE if locality == LOCALITY_REMOTE else Place.LOCAL_STORAGE
    return None


@dataclass
class PrefixMatch:
    """What one instance would serve of a prompt's prefix.

    Attributes:
        tokens: per ``Place``, the prompt tokens it would serve from there.
        from_other: of the shared-storage tokens, those no block of which this instance
            announced itself (KV another instance computed).
    """

    tokens: list[int] = field(default_factory=lambda: [0] * len(Place))
    from_other: int = 0

    @property
    def cached(self) -> int:
        """Tokens served from any place (the prefix not recomputed)."""
        return sum(self.tokens)


class PrefixIndex:
    """The fleet's block locations (see the module docstring).

    Args:
        num_instances: instances ``0 .. num_instances - 1`` (``data_parallel_rank`` of their
            batches).
    """

    def __init__(self, num_instances: int) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances = num_instances
        # hash -> per instance, a bit per Place it holds the block in.
        self._places: dict[ExternalBlockHash, list[int]] = {}
        # hash -> announcers of a shared-storage copy (any instance can load it).
        self._shared: dict[ExternalBlockHash, set[int]] = {}
        # Block size per place, as the events say (the first one seen wins).
        self.block_sizes: dict[Place, int] = {}
        self.events_applied = 0
        self.unknown_media = 0

    @property
    def num_blocks(self) -> int:
        """Hashes known in some place."""
        return len(self._places.keys() | self._shared.keys())

    def apply(self, instance: int, batch: KVEventBatch) -> None:
        """Apply one instance's batch, event by event, in order."""
        for event in batch.events:
            self.events_applied += 1
            if isinstance(event, AllBlocksCleared):
                self.clear(instance)
                continue
            place = place_of(event.medium, event.locality)
            if place is None:
                self.unknown_media += 1
                continue
            if isinstance(event, BlockStored):
                self.block_sizes.setdefault(place, event.block_size)
                self._store(instance, place, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._remove(instance, place, event.block_hashes)

    def _store(self, instance: int, place: Place, hashes: Sequence[ExternalBlockHash]) -> None:
        if place is Place.SHARED_STORAGE:
            for h in hashes:
                self._shared.setdefault(h, set()).add(instance)
            return
        bit = 1 << place
        n = self.num_instances
        for h in hashes:
            per = self._places.get(h)
            if per is None:
                per = self._places[h] = [0] * n
            per[instance] |= bit

    def _remove(self, instance: int, place: Place, hashes: Sequence[ExternalBlockHash]) -> None:
        if place is Place.SHARED_STORAGE:
            for h in hashes:
                owners = self._shared.get(h)
                if owners is not None:
                    owners.discard(instance)
                    if not owners:
                        del self._shared[h]
            return
        mask = ~(1 << place)
        for h in hashes:
            per = self._places.get(h)
            if per is None:
                continue
            per[instance] &= mask
            if not any(per):
                del self._places[h]

    def clear(self, instance: int) -> None:
        """Forget everything ``instance`` announced (``AllBlocksCleared``, or its stream lost
        batches the replay buffer no longer had). Shared copies it announced stay loadable by
        the others only if another instance announced them too."""
        for h in [h for h, per in self._places.items() if per[instance]]:
            self._remove_all(h, instance)
        for h in [h for h, owners in self._shared.items() if instance in owners]:
            self._remove(instance, Place.SHARED_STORAGE, [h])

    def _remove_all(self, h: ExternalBlockHash, instance: int) -> None:
        per = self._places[h]
        per[instance] = 0
        if not any(per):
            del self._places[h]

    def match(
        self,
        block_hashes: Sequence[ExternalBlockHash],
        hash_block_size: int,
        on_gpu: Sequence[Container[ExternalBlockHash]] | None = None,
    ) -> list[PrefixMatch]:
        """Per instance, the tokens of the prompt's prefix it would serve from each place.

        Args:
            block_hashes: the prompt's chained hashes, one per full ``hash_block_size`` piece.
            hash_block_size: tokens per hashed piece; divides the block size of every place.
            on_gpu: per instance, hashed pieces to count as in its GPU cache besides those its
                events announced (a GPU block counts when the hash of its last piece is there;
                before any GPU event said the GPU's block size, per piece).

        Cost: O(pieces of the longest matched prefix x places x instances).
        """
        total = len(block_hashes)
        sizes = dict(self.block_sizes)
        if on_gpu is not None:
            sizes.setdefault(Place.GPU, hash_block_size)
        # Per place, hashed pieces per block (places never announced cannot serve).
        ratios = [
            (place, bs // hash_block_size)
            for place, bs in sorted(sizes.items())
            if bs >= hash_block_size and bs % hash_block_size == 0
        ]
        out: list[PrefixMatch] = []
        for i in range(self.num_instances):
            match = PrefixMatch()
            extra = on_gpu[i] if on_gpu is not None else ()
            bit_of = [(place, 1 << place, r) for place, r in ratios]
            for j in range(total):
                best: Place | None = None
                own = True
                for place, bit, r in bit_of:
                    last = (j // r + 1) * r - 1
                    if last >= total:
                        continue  # the block is not full in this prompt
                    h = block_hashes[last]
                    if place is Place.SHARED_STORAGE:
                        owners = self._shared.get(h)
                        if owners:
                            best, own = place, i in owners
                            break
                    else:
                        per = self._places.get(h)
                        if (per is not None and per[i] & bit) or (
                            place is Place.GPU and h in extra
                        ):
                            best = place
                            break
                if best is None:
                    break
                match.tokens[best] += hash_block_size
                if best is Place.SHARED_STORAGE and not own:
                    match.from_other += hash_block_size
            out.append(match)
        return out
