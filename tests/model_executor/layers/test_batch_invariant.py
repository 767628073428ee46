# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The batch-invariance rules of ``batch_invariant``: a row's result is the same whatever rows
surround it, at 1 and 2 intra-op threads."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from vllm.model_executor.layers.batch_invariant import (
    MAX_REDUCTION,
    TILE_ROWS,
    linear,
    linear_by_columns,
    pad_rows,
    rms_norm,
    silu_and_mul,
    tree_sum,
)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _one_tile_at_a_time(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch.set_num_threads(1)
    return torch.cat([linear(pad_rows(x[i : i + 1]), w)[:1] for i in range(x.shape[0])])


@pytest.mark.parametrize("k", [64, 768, 3 * MAX_REDUCTION + 7])
def test_a_rows_product_does_not_depend_on_the_other_rows(k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(7 * TILE_ROWS, k, generator=gen)
    w = torch.randn(k, 80, generator=gen)
    torch.set_num_threads(threads)
    together = linear(x, w)
    for rows in (TILE_ROWS, 3 * TILE_ROWS):
        assert torch.equal(linear(x[:rows], w), together[:rows])
    assert torch.equal(together, _one_tile_at_a_time(x, w))


@pytest.mark.parametrize("k", [64, 3 * MAX_REDUCTION + 7])
def test_a_product_by_columns_does_not_depend_on_the_other_rows(k: int, threads: int) -> None:
    # The LM head's shape: a fixed table of many rows, the step's few rows as its columns.
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(3 * TILE_ROWS, k, generator=gen)
    table = torch.randn(1000, k, generator=gen)
    together = linear_by_columns(x, table)
    torch.testing.assert_close(together, x @ table.t(), rtol=1e-4, atol=1e-4)
    for rows in (TILE_ROWS, 2 * TILE_ROWS):
        assert torch.equal(linear_by_columns(x[:rows], table), together[:rows])
    alone = torch.cat(
        [linear_by_columns(pad_rows(x[i : i + 1]), table)[:1] for i in range(x.shape[0])]
    )
    assert torch.equal(alone, together)


@pytest.mark.parametrize("k", [16, 64, MAX_REDUCTION])
def test_a_products_column_does_not_depend_on_the_other_columns(k: int, threads: int) -> None:
    # The attention's shape: keys (a multiple of 16 rows) by the query columns, padded to at
    # least a tile of columns (MIN_QUERY_COLUMNS). Narrower products may take another kernel
    # (with MKL on AVX-512, up to 11 columns do), which is why the attention pads.
    gen = torch.Generator().manual_seed(k)
    keys = torch.randn(8 * TILE_ROWS, k, generator=gen)
    queries = torch.randn(k, 200, generator=gen)
    together = keys @ queries
    for columns in (TILE_ROWS, TILE_ROWS + 1, 2 * TILE_ROWS, 130):
        assert torch.equal(keys @ queries[:, :columns], together[:, :columns]), columns
        assert torch.equal((keys @ queries[:, -columns:])[:, -1], together[:, -1]), columns


def test_linear_refuses_a_partial_tile() -> None:
    with pytest.raises(AssertionError, match="whole number of tiles"):
        linear(torch.zeros(3, 4), torch.zeros(4, 2))


def test_pad_rows_pads_to_whole_tiles() -> None:
    x = torch.ones(17, 3)
    padded = pad_rows(x)
    assert padded.shape == (32, 3) and torch.equal(padded[:17], x) and not padded[17:].any()
    assert pad_rows(padded) is padded


def test_tree_sum_is_a_sum_and_padding_cannot_change_it(threads: int) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=gen)
    total = tree_sum(x, 1)
    assert torch.allclose(total, x.double().sum(1).float(), atol=1e-5)
    for pad in (27, 91):  # to 64 and to 128 elements
        padded = torch.cat([x, torch.full((5, pad), -0.0)], 1)
        assert torch.equal(tree_sum(padded, 1), total)
    # +0.0 padding would turn a -0.0 sum into +0.0; -0.0 padding keeps it.
    negative_zero = tree_sum(torch.full((1, 3), -0.0), 1)
    assert math.copysign(1.0, float(negative_zero[0])) == -1.0


def test_tree_sum_of_an_aligned_run_is_a_node_of_the_whole_tree() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, generator=gen)
    sparse = torch.full((3, 16), -0.0)
    sparse[:, 8:12] = x[:, 8:12]
    assert torch.equal(tree_sum(sparse, 1), tree_sum(x[:, 8:12], 1))


def test_rms_norm_and_silu_match_their_definitions(threads: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(33, 48, generator=gen)
    w = torch.rand(48, generator=gen)
    expected = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-5) * w
    assert torch.allclose(rms_norm(x, w, 1e-5), expected.float(), atol=1e-5)
    gate, up = x[:, :24], x[:, 24:]
    assert torch.allclose(silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-6)


def test_elementwise_results_do_not_depend_on_a_values_neighbours(threads: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4099, generator=gen) * 8
    whole = silu_and_mul(x, x), rms_norm(x.view(-1, 1), torch.ones(1), 1e-5)
    for lo, n in ((0, 1), (5, 3), (1000, 17), (4000, 99)):
        part = silu_and_mul(x[lo : lo + n].clone(), x[lo : lo + n].clone())
        assert torch.equal(part, whole[0][lo : lo + n])
        norm = rms_norm(x[lo : lo + n].clone().view(-1, 1), torch.ones(1), 1e-5)
        assert torch.equal(norm, whole[1][lo : lo + n])
