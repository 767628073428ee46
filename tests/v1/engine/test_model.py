# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The model stand-in: KV bytes as a deterministic function of the token prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.engine.model import (
    KVLayout,
    StandInModel,
    allocate_group_kv_cache,
    block_digests,
    gather_blocks,
    kv_values,
    layer_planes,
    prefix_seeds,
    sample_token,
)


def test_prefix_seeds_follow_the_recurrence_and_continue() -> None:
    tokens = [5, 0, 31999, 7, 7]
    state = 0
    expected = []
    for t in tokens:
        state = (state * 0x9E3779B97F4A7C15 + t + 1) % (1 << 64)
        expected.append(state)
    seeds = prefix_seeds(tokens)
    assert [int(s) for s in seeds] == expected
    assert [int(s) for s in prefix_seeds(tokens, 2)] == expected[2:]
    assert [int(s) for s in prefix_seeds(tokens[3:], initial=expected[2])] == expected[3:]


def test_values_are_deterministic_finite_and_salted() -> None:
    seeds = prefix_seeds(list(range(10)))
    a = kv_values(seeds, 1, (2, 2, 2, 8), torch.float16)
    assert a.dtype == torch.int16 and a.shape == (10, 2, 2, 2, 8)
    assert torch.equal(a, kv_values(seeds, 1, (2, 2, 2, 8), torch.float16))
    assert not torch.equal(a, kv_values(seeds, 2, (2, 2, 2, 8), torch.float16))
    assert torch.isfinite(a.view(torch.float16)).all()
    b = kv_values(seeds, 1, (3,), torch.float32)
    assert b.dtype == torch.int32 and torch.isfinite(b.view(torch.float32)).all()
    assert 0 <= sample_token(int(seeds[-1]), 50) < 50


@pytest.mark.parametrize("layout", list(KVLayout))
def test_written_blocks_match_their_reference_and_a_flipped_byte_is_found(
    layout: KVLayout,
) -> None:
    group = allocate_group_kv_cache(0, 4, 6, 2, 2, 8, torch.bfloat16, layout)
    model = StandInModel(rank=1, groups=[group], vocab_size=100)
    tokens = list(range(50, 62))  # 12 tokens: blocks 0, 1, 2
    table = np.array([4, 0, 2])
    positions = np.arange(12)
    model.write(0, prefix_seeds(tokens), table[positions // 4], positions % 4)

    def matching(model: StandInModel, tokens: list[int]) -> list[bool]:
        expected = block_digests(model.reference_blocks(0, tokens, [0, 1, 2]))
        actual = block_digests(gather_blocks(group, table))
        return [a == b for a, b in zip(actual, expected, strict=True)]

    assert matching(model, tokens) == [True, True, True]
    # A changed token changes its block and every later one (the prefix), not earlier ones.
    assert matching(model, [*tokens[:5], 0, *tokens[6:]]) == [True, False, False]
    flat = group.tensors[0].view(torch.int8).reshape(-1)
    index = int(torch.nonzero(flat).flatten()[0])  # a written byte
    flat[index] ^= 1
    assert matching(model, tokens).count(False) == 1
    other_rank = StandInModel(rank=0, groups=[group], vocab_size=100)
    assert matching(other_rank, tokens) == [False, False, False]


@pytest.mark.parametrize("layout", list(KVLayout))
def test_host_kv_tensors_are_zeroed_and_start_on_a_page(layout: KVLayout) -> None:
    # Page-aligned like a GPU allocator's large blocks, so that the host copy path moves a
    # per-layer job as one flat copy: every layer's pages at one offset of a page.
    group = allocate_group_kv_cache(0, 16, 7, 3, 2, 8, torch.float16, layout)
    for tensor in group.tensors:
        assert tensor.data_ptr() % 4096 == 0
        assert tensor.is_contiguous() and tensor.dtype == torch.float16
        assert not tensor.any()
    assert group.tensors[0].shape[-3:] == (16, 2, 8)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_gather_blocks_reads_every_layout_alike(layout: KVLayout) -> None:
    caches = {
        lay: allocate_group_kv_cache(0, 4, 5, 3, 2, 8, torch.float16, lay) for lay in KVLayout
    }
    tokens = list(range(20))
    positions = np.arange(20)
    for cache in caches.values():
        StandInModel(0, [cache], 10).write(0, prefix_seeds(tokens), positions // 4, positions % 4)
    blocks = gather_blocks(caches[layout], [3, 1])
    assert blocks.shape == (2, 3, 2, 4, 2, 8)
    assert torch.equal(blocks, gather_blocks(caches[KVLayout.CROSS_LAYER], [3, 1]))
    for layer in range(3):
        key, value = layer_planes(caches[layout], layer)
        assert torch.equal(key[3], blocks[0, layer, 0]) and torch.equal(
            value[1], blocks[1, layer, 1]
        )
