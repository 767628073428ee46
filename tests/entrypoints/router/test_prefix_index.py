# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``PrefixIndex``: block locations from events, and what each instance would serve."""

from __future__ import annotations

from tests.distributed.kv_event_helpers import block_stored
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVEventBatch,
)
from vllm.entrypoints.router.prefix_index import Place, PrefixIndex
from vllm.entrypoints.router.router import prompt_block_hashes
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

H = 16


def _hashes(tokens: list[int], piece: int = H) -> list[bytes]:
    return list(prompt_block_hashes(tokens, get_request_block_hasher(piece)))


def _batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))  # type: ignore[arg-type]


PROMPT = list(range(100))  # six full pieces and a partial one
HASHES = _hashes(PROMPT)


def test_an_instance_serves_its_prefix_gpu_first_then_its_tiers() -> None:
    index = PrefixIndex(2)
    index.apply(0, _batch(block_stored(HASHES[:2], "GPU"), block_stored(HASHES[:4], "CPU")))
    index.apply(0, _batch(block_stored(HASHES[:5], "STORAGE", "LOCAL")))
    m0, m1 = index.match(HASHES, H)
    assert m0.tokens == [32, 32, 16, 0] and m0.cached == 80
    assert m1.cached == 0  # instance 1 announced nothing


def test_the_shared_store_counts_for_every_instance() -> None:
    index = PrefixIndex(3)
    index.apply(1, _batch(block_stored(HASHES[:3], "STORAGE", "REMOTE")))
    index.apply(2, _batch(block_stored(HASHES[:1], "GPU")))
    m = index.match(HASHES, H)
    assert [x.tokens[Place.SHARED_STORAGE] for x in m] == [48, 48, 32]
    assert m[2].tokens[Place.GPU] == 16
    assert [x.from_other for x in m] == [48, 0, 32]  # instance 1 stored them itself


def test_a_prefix_ends_at_the_first_block_found_nowhere() -> None:
    index = PrefixIndex(1)
    index.apply(0, _batch(block_stored([HASHES[0], HASHES[2]], "CPU")))
    assert index.match(HASHES, H)[0].cached == 16


def test_removals_clears_and_unknown_media() -> None:
    index = PrefixIndex(2)
    index.apply(0, _batch(block_stored(HASHES[:3], "GPU"), block_stored(HASHES[:3], "CPU")))
    index.apply(1, _batch(block_stored(HASHES[:3], "STORAGE", "REMOTE")))
    index.apply(0, _batch(BlockRemoved(HASHES[1:3], "GPU")))
    assert index.match(HASHES, H)[0].tokens[:2] == [16, 32]
    index.apply(0, _batch(block_stored(HASHES[:1], "DISK")))
    assert index.unknown_media == 1
    index.apply(0, _batch(AllBlocksCleared()))
    # Instance 0's own copies are gone; instance 1's shared copy still serves it.
    assert index.match(HASHES, H)[0].tokens == [0, 0, 0, 48]
    index.apply(1, _batch(BlockRemoved(HASHES[:3], "STORAGE", locality="REMOTE")))
    assert index.num_blocks == 0


def test_blocks_larger_than_the_hashed_piece_count_whole() -> None:
    # 32-token CPU blocks named by the hash of their last 16-token piece.
    index = PrefixIndex(1)
    index.apply(0, _batch(block_stored([HASHES[1], HASHES[3]], "CPU", block_size=32)))
    assert index.match(HASHES, H)[0].tokens[Place.CPU] == 64
    assert index.match(HASHES[:3], H)[0].tokens[Place.CPU] == 32  # second block not full


def test_blocks_the_caller_knows_are_on_a_gpu_count_as_gpu() -> None:
    # The router's requests in flight: instance 1 holds the first three pieces, announced or not.
    index = PrefixIndex(2)
    in_flight = [set(), set(HASHES[:3])]
    m0, m1 = index.match(HASHES, H, in_flight)
    assert m0.cached == 0 and m1.tokens == [48, 0, 0, 0]
    # Beyond them, the instance's announced tiers go on serving the prefix.
    index.apply(1, _batch(block_stored(HASHES[:5], "CPU")))
    assert index.match(HASHES, H, in_flight)[1].tokens == [48, 32, 0, 0]
    # Once a GPU event said the GPU's blocks are 32 tokens, a block counts whole or not at all.
    index.apply(0, _batch(block_stored(HASHES[1:2], "GPU", block_size=32)))
    assert index.match(HASHES, H, in_flight)[1].tokens == [32, 48, 0, 0]
