# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Batch-invariant primitives: the result a row gets is a function of that row alone.

Floating-point sums depend on their order, and a library kernel picks the order from the shapes it
is called with (blocking, vector width, how many threads share a reduction). A token whose KV came
out differently in another batch, another prefill chunking or after its prefix was loaded from a
tier would make the engine's bit-exact oracle useless, so the transformer is built only from the
operations below, each used under a rule that keeps a row's result independent of its batch:

* **Whole tiles.** Every matmul has a row count that is a multiple of ``TILE_ROWS`` (callers pad
  with ``pad_rows``) and at least ``TILE_ROWS`` columns (the attention pads its query columns).
  Measured on this project's CPUs (torch 2.13 with MKL, float32, 1 and 2 intra-op threads, an
  AVX2 and an AVX-512 machine): with a multiple of 16 rows, every element of ``A @ B`` equals the
  same element computed in a 16-row tile, for any number of rows; with 16 columns or more, each
  column equals the same column of a wider product. Narrower products take other kernels: a
  1-row product differs, and on the AVX-512 machine products of up to 11 columns differ from
  wider ones (on the AVX2 machine only 1 column did). The tests check both rules on the machine
  that runs them.
* **Fixed rows, the step's rows as columns.** A product whose rows are the same in every call
  (the LM head's vocabulary, ``linear_by_columns``) may take the step's rows, a multiple of 16,
  as its columns: with the step's rows as the narrow side the weight is streamed once (1.45x
  faster for 16 rows).
* **Bounded reductions.** A matmul's reduction dimension is at most ``MAX_REDUCTION``: ``linear``
  splits a longer one into chunks summed in chunk order. Measured: from 1,024 reduction elements
  on, a 16-row product with 2 threads splits the reduction between the threads and differs from
  the 1-thread result; at 768 and below it never did.
* **Tree sums.** Every other reduction (RMSNorm's mean of squares, softmax denominators, attention
  over key chunks) is ``tree_sum``: pairwise sums of adjacent elements in a fixed binary tree,
  built from elementwise additions, which are exact per element whatever a kernel's
  vectorisation or threading. Padding with ``-0.0`` (the exact additive identity: ``x + -0.0 ==
  x`` for every ``x``, ``+0.0`` included) to a power of two does not change the result, so the
  padded length of a reduction cannot leak into it.
* **Elementwise functions** are products, quotients, square roots and ``exp``, which torch
  computes alike in its vectorised loop body and its tail (measured: no difference on 300,000
  values at any offset and length). SiLU is written as ``x / (1 + exp(-x))``: torch's fused
  ``sigmoid``/``silu`` differ between the two (1,348 of 20,000 values).

Maxima (``amax``, ``argmax``) are exact in any order. ``tests/model_executor`` checks each rule
and the whole model at 1 and 2 intra-op threads.
"""

from __future__ import annotations

import torch

TILE_ROWS = 16
"""Rows of a matmul tile: every matmul's row count is a multiple of this."""
MAX_REDUCTION = 512
"""The longest reduction one matmul performs (longer ones are chunked in order)."""


def pad_rows(x: torch.Tensor, multiple: int = TILE_ROWS) -> torch.Tensor:
    """``x`` with zero rows appended (dim 0) up to a multiple of ``multiple`` (``x`` if none)."""
    pad = -x.shape[0] % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` with the reduction chunked (see the module docstring).

    Args:
        x: ``[M, K]`` with ``M`` a multiple of ``TILE_ROWS``.
        weight: ``[K, N]``.

    Returns:
        ``[M, N]``; row ``i`` depends on ``x[i]`` and ``weight`` only.
    """
    assert x.shape[0] % TILE_ROWS == 0, f"{x.shape[0]} rows is not a whole number of tiles"
    k = weight.shape[0]
    out = x[:, :MAX_REDUCTION] @ weight[:MAX_REDUCTION]
    for lo in range(MAX_REDUCTION, k, MAX_REDUCTION):
        out = out + x[:, lo : lo + MAX_REDUCTION] @ weight[lo : lo + MAX_REDUCTION]
    return out


def linear_by_columns(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x @ table.T`` as ``(table @ x.T).T``, the reduction chunked as in ``linear``.

    Args:
        x: ``[M, K]`` with ``M`` a multiple of ``TILE_ROWS`` (the product's columns: at least 2).
        table: ``[N, K]``, the same in every call (its rows are the product's rows).

    Returns:
        ``[M, N]`` (a transposed view); row ``i`` depends on ``x[i]`` and ``table`` only.
    """
    assert x.shape[0] % TILE_ROWS == 0, f"{x.shape[0]} rows is not a whole number of tiles"
    k = table.shape[1]
    out = table[:, :MAX_REDUCTION] @ x[:, :MAX_REDUCTION].t()
    for lo in range(MAX_REDUCTION, k, MAX_REDUCTION):
        out = out + table[:, lo : lo + MAX_REDUCTION] @ x[:, lo : lo + MAX_REDUCTION].t()
    return out.t()


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over ``dim`` as a fixed tree of pairwise sums of adjacent elements.

    The length is padded with ``-0.0`` to the next power of two; since that padding is exact,
    the sum of ``n`` elements is the same whatever power of two ``>= n`` it was padded to, and the
    sum over an aligned run of ``2**k`` elements is a node of every larger tree (the paged
    attention relies on both).

    Args:
        x: any floating tensor.
        dim: the dimension to sum over (removed from the result).
    """
    dim = dim % x.ndim
    n = x.shape[dim]
    size = 1 << max(n - 1, 0).bit_length()
    if size != n:
        shape = list(x.shape)
        shape[dim] = size - n
        x = torch.cat([x, x.new_full(shape, -0.0)], dim)
    while size > 1:
        size //= 2
        pairs = x.unflatten(dim, (size, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: ``x / sqrt(mean(x**2) + eps) * weight``."""
    mean_square = tree_sum(x * x, -1) / x.shape[-1]
    return x * torch.rsqrt(mean_square + eps).unsqueeze(-1) * weight


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``, with ``silu(x) = x / (1 + exp(-x))``."""
    return gate / (1.0 + torch.exp(-gate)) * up
