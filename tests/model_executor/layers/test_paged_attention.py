# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The paged attention layer alone: a plain softmax reference, stale bytes, batch invariance."""

from __future__ import annotations

import math

import pytest
import torch

from vllm.model_executor.layers.paged_attention import (
    AttentionMetadata,
    AttentionSeq,
    KVPlanes,
    paged_attention,
)

BS, HEADS, KV_HEADS, DIM = 16, 4, 2, 16
CPU = torch.device("cpu")


def _planes(num_blocks: int, fill: float) -> KVPlanes:
    shape = (num_blocks, BS, KV_HEADS, DIM)
    return KVPlanes(torch.full(shape, fill).half(), torch.full(shape, fill).half())


def _write(planes: KVPlanes, table: list[int], length: int, seed: int) -> None:
    """Random K and V for positions ``[0, length)`` of a sequence with block table ``table``."""
    g = torch.Generator().manual_seed(seed)
    for pos in range(length):
        block = table[pos // BS]
        if block >= 0:
            planes.key[block, pos % BS] = torch.randn(KV_HEADS, DIM, generator=g).half()
            planes.value[block, pos % BS] = torch.randn(KV_HEADS, DIM, generator=g).half()


def _reference(
    query: torch.Tensor, planes: KVPlanes, seq: AttentionSeq, window: int | None
) -> torch.Tensor:
    """Softmax attention of ``seq``'s rows written out plainly (float64)."""
    rows = []
    for r in range(seq.num_rows):
        pos = seq.start + r
        first = 0 if window is None else max(0, pos - window + 1)
        ks = torch.stack(
            [planes.key[seq.block_table[p // BS], p % BS] for p in range(first, pos + 1)]
        )
        vs = torch.stack(
            [planes.value[seq.block_table[p // BS], p % BS] for p in range(first, pos + 1)]
        )
        heads = []
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            q = query[seq.row_start + r, h].double()
            scores = ks[:, kv].double() @ q / math.sqrt(DIM)
            heads.append(torch.softmax(scores, 0) @ vs[:, kv].double())
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def _run(seqs: list[AttentionSeq], planes: KVPlanes, query: torch.Tensor, window: int | None):
    meta = AttentionMetadata.build(seqs, BS, window, HEADS, KV_HEADS, CPU)
    return paged_attention(query, planes, meta)


@pytest.mark.parametrize("window", [None, 40], ids=["full-attention", "sliding-window"])
def test_a_mixed_step_matches_a_plain_softmax_and_ignores_stale_bytes(window: int | None) -> None:
    # Stale bytes everywhere the sequences did not write: NaN, as a previous owner's garbage
    # may be. A decode far into its sequence (with a block before its window freed when the
    # window is on), a short chunk and a long prefill chunk in one step.
    planes = _planes(64, math.nan)
    decode_table = list(range(0, 12))
    if window is not None:
        decode_table[0] = -1  # freed by the engine: outside every row's window
    chunk_table, long_table = list(range(20, 24)), list(range(30, 50))
    _write(planes, decode_table, 170, seed=1)
    _write(planes, chunk_table, 50, seed=2)
    _write(planes, long_table, 300, seed=3)
    seqs = [
        AttentionSeq(0, 169, 170, decode_table),
        AttentionSeq(1, 40, 50, chunk_table),
        AttentionSeq(11, 100, 300, long_table),
    ]
    query = torch.randn(211, HEADS, DIM, generator=torch.Generator().manual_seed(4))
    out = _run(seqs, planes, query, window)
    assert torch.isfinite(out).all()
    for seq in seqs:
        got = out[seq.row_start : seq.row_start + seq.num_rows].double()
        torch.testing.assert_close(
            got, _reference(query, planes, seq, window), atol=1e-5, rtol=1e-4
        )


def test_a_rows_result_does_not_depend_on_the_rest_of_the_step() -> None:
    planes = _planes(96, 0.0)
    tables = [list(range(i * 12, (i + 1) * 12)) for i in range(8)]
    lengths = [190, 33, 17, 150, 64, 129, 8, 100]
    for i, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        _write(planes, table, n, seed=10 + i)
    query = torch.randn(1, HEADS, DIM, generator=torch.Generator().manual_seed(5))
    alone = _run([AttentionSeq(0, 189, 190, tables[0])], planes, query, None)
    # The same row among decodes and short chunks of other lengths, in another row position.
    rows = [query.new_zeros(0, HEADS, DIM)]
    seqs, row = [], 0
    for i in range(1, 8):
        n = 1 if i % 2 else 9
        seqs.append(AttentionSeq(row, lengths[i] - n, lengths[i], tables[i]))
        rows.append(torch.randn(n, HEADS, DIM, generator=torch.Generator().manual_seed(20 + i)))
        row += n
    seqs.append(AttentionSeq(row, 189, 190, tables[0]))
    rows.append(query)
    batched = _run(seqs, planes, torch.cat(rows), None)
    assert torch.equal(batched[row], alone[0])
