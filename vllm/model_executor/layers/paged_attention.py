# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Causal (optionally sliding-window) grouped-query attention over the engine's paged KV cache.

The KV of a sequence lives in GPU blocks of ``block_size`` tokens named by its block table; a
layer's cache is seen as two *planes*, ``key`` and ``value``, each ``[num_blocks, block_size,
kv_heads, head_dim]``: views of the engine's tensors in any of its layouts (``KVPlanes``), so the
attention reads exactly the bytes that offloading stores and loads.

A step first writes the new tokens' K and V into their slots (``write_kv``), then every query row
attends over the cache, its own row included. What depends only on the step's sequences (block
indices, masks, the reduction tree) is computed once per KV-cache group and step
(``AttentionMetadata.build``) and shared by the group's layers.

Batch invariance (see ``batch_invariant``): keys are cut into *chunks* of ``key_chunk_size(bs)``
tokens on a grid fixed at position 0. The scores of a query row against a chunk are products of
a 16-row multiple (the keys) by the query columns with a ``head_dim`` reduction; the row maximum
over all its keys is exact; a chunk's ``exp``-weighted values and its weight sum come out of
matmuls whose rows are the ``head_dim`` value elements and 16 rows of a one then zeros (appended
to the values in one product for long sequences, a second product for short ones), with a
chunk-long reduction. The chunks' partial sums
are then added in a fixed tree over *absolute* chunk indices (a chunk outside a sequence's range is
an exact ``-0.0`` leaf). So a row's output is a function of its query, its keys and values and its
position alone, whatever else the step computes: batched with other sequences, in a prefill chunk
of any length, or with its prefix loaded from a tier.

Cost: per layer and step the gathered K and V are read from the cache once (``index_select`` of
whole blocks) and widened to float32 once. For decodes and short chunks (few query columns per
key: the products are bound by reading the keys and values) the copy keeps the cache's own
token-major order and each KV head's products read it in place as a strided matrix (BLAS takes
the row stride), with no transposed copy. A long sequence's pieces share one copy laid out for
their products (heads outermost, values transposed with the weight-sum rows appended), which
pays off over their many query columns.

Keys a row must not see (later positions, outside the window, past a sequence's end, freed
blocks) get weight exactly 0; the values of keys past a sequence's end or in freed blocks are
zeroed first (in the gathered copy, as runs of keys), so stale bytes of a block's previous owner
(possibly not even finite) cannot turn ``0 * value`` into NaN.

Shapes: queries ``[N, heads, head_dim]`` float32 rows of the step (each sequence's rows
contiguous); the result has the same shape. Sequences of up to ``TILE_ROWS`` new tokens are
computed together (decodes in one batch, short chunks in another): their key chunks are gathered
one after another, each sequence's own chunks only, and the products are batched over the chunks,
so no sequence is padded to the longest. Longer ones are computed one at a time, in pieces of
``QUERY_PIECE`` rows that share one gather of the sequence's keys.

Threading: none of its own; tensors stay on the planes' device (CPU or CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.batch_invariant import MAX_REDUCTION, TILE_ROWS, tree_sum

MIN_KEY_CHUNK = 128
"""Tokens per key chunk at least; a chunk is a whole number of blocks and of 16 tokens
(``key_chunk_size``)."""
SUM_ROWS = 16
"""Rows that yield a chunk's weight sum: the first holds ones, the rest zeros (so a product's row
count stays a multiple of 16); appended to the transposed values of a long sequence, the left
operand of their own product for short ones."""
QUERY_PIECE = 128
"""Rows of a long sequence computed together (the rows of a piece share its keys)."""
MIN_QUERY_COLUMNS = TILE_ROWS
"""Query rows x query heads per KV head, at least (fewer rows are padded): a narrow matmul takes
another kernel whose columns differ from the same columns of a wider product. Measured: with
MKL on an AVX-512 CPU, products of up to 11 columns differ and those of 12 or more agree; on an
AVX2 CPU only 1 column differed. A whole tile of columns is the rule (``batch_invariant``)."""


def key_chunk_size(block_size: int) -> int:
    """Tokens per key chunk for blocks of ``block_size`` tokens: the smallest common multiple of
    the block size and ``TILE_ROWS`` that is at least ``MIN_KEY_CHUNK``.

    Raises:
        ValueError: that is longer than one matmul may reduce (``MAX_REDUCTION``).
    """
    unit = math.lcm(block_size, TILE_ROWS)
    chunk = unit * -(-MIN_KEY_CHUNK // unit)
    if chunk > MAX_REDUCTION:
        raise ValueError(
            f"blocks of {block_size} tokens make key chunks of {chunk} tokens; the transformer's "
            f"attention reduces at most {MAX_REDUCTION} at once"
        )
    return chunk


@dataclass(frozen=True)
class KVPlanes:
    """The K and V of one attention layer in the paged cache.

    Attributes:
        key: ``[num_blocks, block_size, kv_heads, head_dim]`` (a view of the engine's tensor).
        value: same shape as ``key``.
    """

    key: torch.Tensor
    value: torch.Tensor


@dataclass(frozen=True)
class AttentionSeq:
    """One sequence's part of a step.

    Attributes:
        row_start: index of its first row in the step's queries.
        start: position of its first new token (rows ``row_start ..`` are positions ``start ..``).
        end: one past its last new token; keys ``[0, end)`` are in the cache.
        block_table: GPU block ids of its blocks ``0, 1, ...`` (at least ``ceil(end / bs)``); a
            negative id is a block the engine freed (only ever outside a sliding window).
    """

    row_start: int
    start: int
    end: int
    block_table: Sequence[int]

    @property
    def num_rows(self) -> int:
        """New tokens (query rows)."""
        return self.end - self.start


def write_kv(
    planes: KVPlanes,
    block_ids: torch.Tensor,
    offsets: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Write new tokens' K and V (``[n, kv_heads, head_dim]``, cast to the cache's dtype) into
    slots ``(block_ids[i], offsets[i])`` (int64 tensors on the planes' device)."""
    planes.key[block_ids, offsets] = key.to(planes.key.dtype)
    planes.value[block_ids, offsets] = value.to(planes.value.dtype)


@dataclass(frozen=True)
class _Piece:
    """Query rows computed together against a run of the batch's gathered key chunks."""

    rows: int  # query rows per sequence (shorter ones padded)
    first_chunk: int  # the run of gathered chunks [first_chunk, first_chunk + num_chunks)
    num_chunks: int
    slots: int  # leaves of the reduction tree (a power of two >= num_chunks)
    query_index: torch.Tensor  # [S * rows] rows of the step's queries (padding: a real row)
    out_rows: torch.Tensor  # [n] rows of the step written back
    out_from: torch.Tensor  # [n] their index in the piece's [S * rows] results
    hidden: torch.Tensor  # [S, 1, chunks, chunk, rows * group]: weight exactly 0
    leaves: list[tuple[int, int, int]] | None  # (seq, first leaf, chunks) if not 0..chunks


@dataclass(frozen=True)
class _Batch:
    """Sequences whose keys are gathered together, and the pieces of rows attending to them."""

    num_seqs: int
    num_chunks: int  # key chunks gathered per sequence
    blocks: torch.Tensor  # [S * num_chunks * blocks per chunk] block ids to gather
    # (seq, first key, end key) of gathered keys past the end or in freed blocks: their values
    # are zeroed in the gathered copy
    zeroed: Sequence[tuple[int, int, int]]
    pieces: Sequence[_Piece]


@dataclass(frozen=True)
class _ChunkBatch:
    """Short sequences whose key chunks are gathered one after another, each sequence's own
    chunks only (none padded to the longest), and whose products are batched over the chunks."""

    num_seqs: int
    rows: int  # query rows per sequence (shorter ones padded)
    slots: int  # leaves of each sequence's reduction tree (a power of two)
    blocks: torch.Tensor  # [C * blocks per chunk] block ids to gather
    zeroed: Sequence[tuple[int, int]]  # [first, end) of gathered keys whose values are zeroed
    chunk_seq: torch.Tensor  # [C] the sequence of each gathered chunk
    leaf: torch.Tensor  # [C] its leaf in the flattened trees, seq * slots + chunk % slots
    hidden: torch.Tensor  # [C, 1, chunk, rows * group]: weight exactly 0
    query_index: torch.Tensor  # [S * rows] rows of the step's queries (padding: a real row)
    out_rows: torch.Tensor  # [n] rows of the step written back
    out_from: torch.Tensor  # [n] their index in the batch's [S * rows] results


@dataclass(frozen=True)
class AttentionMetadata:
    """What the attention of one KV-cache group needs about a step, shared by its layers.

    Build it with ``AttentionMetadata.build``.
    """

    short_batches: Sequence[_ChunkBatch]  # sequences of up to TILE_ROWS new tokens
    batches: Sequence[_Batch]  # each longer sequence, in pieces
    block_size: int
    chunk: int
    group: int  # query heads per KV head
    num_heads: int

    @property
    def num_kv_heads(self) -> int:
        """KV heads (each shared by ``group`` query heads)."""
        return self.num_heads // self.group

    @classmethod
    def build(
        cls,
        seqs: Sequence[AttentionSeq],
        block_size: int,
        sliding_window: int | None,
        num_heads: int,
        num_kv_heads: int,
        device: torch.device,
    ) -> AttentionMetadata:
        """Plan the attention of ``seqs`` (disjoint row ranges of the step).

        Args:
            seqs: the step's sequences in this group.
            block_size: tokens per block of the group.
            sliding_window: a row at position ``p`` sees keys ``[p - W + 1, p]``; None:
                ``[0, p]``.
            num_heads: query heads.
            num_kv_heads: KV heads (``num_heads`` is a multiple).
            device: the planes' device.
        """
        group = num_heads // num_kv_heads
        chunk = key_chunk_size(block_size)
        min_rows = -(-MIN_QUERY_COLUMNS // group)
        batches = []
        # Short sequences are gathered chunk by chunk, each only as far as its own keys reach
        # (a row's result is the same in any such batch): decodes together, short chunks
        # together (their rows are padded to the longest, and to MIN_QUERY_COLUMNS columns).
        decodes = [s for s in seqs if s.num_rows == 1]
        chunks = [s for s in seqs if 1 < s.num_rows <= TILE_ROWS]
        short_batches: list[_ChunkBatch] = []
        for members in (decodes, chunks):
            if members:
                rows = max(min_rows, *(s.num_rows for s in members))
                short_batches.append(
                    _plan_chunks(members, rows, block_size, chunk, sliding_window, group, device)
                )
        for s in seqs:
            if s.num_rows <= TILE_ROWS:
                continue
            # A long sequence in pieces of QUERY_PIECE rows: a piece's rows see no key after
            # its end, so it needs fewer chunks; every piece reads the one gather of its keys.
            pieces = []
            for lo in range(0, s.num_rows, QUERY_PIECE):
                n = min(QUERY_PIECE, s.num_rows - lo)
                start = s.start + lo
                piece = AttentionSeq(s.row_start + lo, start, start + n, s.block_table)
                # A short last piece is padded to the columns a product needs.
                pieces.append(([piece], max(n, min_rows)))
            batches.append(_plan([s], pieces, block_size, chunk, sliding_window, group, device))
        return cls(short_batches, batches, block_size, chunk, group, num_heads)


def _chunks(seq: AttentionSeq, chunk: int, window: int | None) -> tuple[int, int]:
    """The absolute key chunks ``[first, end)`` the rows of ``seq`` see."""
    first = 0 if window is None else max(0, seq.start - window + 1)
    return first // chunk, -(-seq.end // chunk)


def _plan(
    seqs: Sequence[AttentionSeq],
    pieces: Sequence[tuple[Sequence[AttentionSeq], int]],
    bs: int,
    chunk: int,
    window: int | None,
    group: int,
    device: torch.device,
) -> _Batch:
    """Gather plan of ``seqs`` and the plans of ``pieces``: ``(rows of every sequence, rows per
    sequence)``, each piece's sequences matching ``seqs`` one to one."""
    num_seqs = len(seqs)
    spans = [_chunks(s, chunk, window) for s in seqs]
    c0 = [lo for lo, _ in spans]
    num_chunks = max(hi - lo for lo, hi in spans)
    per_chunk = chunk // bs
    nblk = num_chunks * per_chunk
    table = torch.full((num_seqs, nblk), -1, dtype=torch.int64)
    zeroed: list[tuple[int, int, int]] = []
    for i, s in enumerate(seqs):
        ids = list(s.block_table[c0[i] * per_chunk : -(-s.end // bs)])
        if ids:
            table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        # Runs of freed blocks, then everything from the sequence's end on.
        j = 0
        while j < len(ids):
            if ids[j] >= 0:
                j += 1
                continue
            run = j
            while j < len(ids) and ids[j] < 0:
                j += 1
            zeroed.append((i, run * bs, j * bs))
        past = s.end - c0[i] * chunk
        if past < nblk * bs:
            zeroed.append((i, past, nblk * bs))
    kpos = torch.tensor(c0, dtype=torch.int64).unsqueeze(1) * chunk + torch.arange(nblk * bs)
    ends = torch.tensor([s.end for s in seqs], dtype=torch.int64).unsqueeze(1)
    absent = (kpos >= ends) | (table.repeat_interleave(bs, dim=1) < 0)
    return _Batch(
        num_seqs=num_seqs,
        num_chunks=num_chunks,
        blocks=table.clamp(min=0).reshape(-1).to(device),
        zeroed=zeroed,
        pieces=[
            _plan_piece(p, rows, c0, kpos, absent, chunk, window, group, device)
            for p, rows in pieces
        ],
    )


def _plan_chunks(
    seqs: Sequence[AttentionSeq],
    rows: int,
    bs: int,
    chunk: int,
    window: int | None,
    group: int,
    device: torch.device,
) -> _ChunkBatch:
    """Gather plan of short ``seqs`` (at most ``rows`` new tokens each), chunk by chunk."""
    per_chunk = chunk // bs
    spans = [_chunks(s, chunk, window) for s in seqs]
    level = 0  # the aligned tree node holding every sequence's chunks, as in _plan_piece
    for lo, hi in spans:
        while lo >> level != (hi - 1) >> level:
            level += 1
    slots = 1 << level
    ids: list[int] = []
    chunk_seq: list[int] = []
    chunk_abs: list[int] = []
    zeroed: list[tuple[int, int]] = []
    for i, (s, (lo, hi)) in enumerate(zip(seqs, spans, strict=True)):
        first = len(chunk_abs) * chunk  # gathered key index of the sequence's first key
        table = list(s.block_table[lo * per_chunk : -(-s.end // bs)])
        table += [-1] * ((hi - lo) * per_chunk - len(table))
        ids += table
        chunk_seq += [i] * (hi - lo)
        chunk_abs += range(lo, hi)
        for j, block in enumerate(table):
            if block < 0:  # a freed block, or one past the sequence's end
                zeroed.append((first + j * bs, first + (j + 1) * bs))
        past = s.end - lo * chunk  # keys past the end, in the last block
        if past % bs:
            zeroed.append((first + past, first + -(-past // bs) * bs))
    seq_of = torch.tensor(chunk_seq, dtype=torch.int64)
    kpos = torch.tensor(chunk_abs, dtype=torch.int64).unsqueeze(1) * chunk + torch.arange(chunk)
    ends = torch.tensor([s.end for s in seqs], dtype=torch.int64)[seq_of].unsqueeze(1)
    table_t = torch.tensor(ids, dtype=torch.int64)
    absent = (kpos >= ends) | (table_t.view(-1, per_chunk).repeat_interleave(bs, dim=1) < 0)
    # Query positions per row; padding rows repeat the first row's (their output is dropped).
    starts = torch.tensor([s.start for s in seqs], dtype=torch.int64).unsqueeze(1)
    num_new = torch.tensor([s.num_rows for s in seqs], dtype=torch.int64).unsqueeze(1)
    real = torch.arange(rows) < num_new
    qpos = torch.where(real, starts + torch.arange(rows), starts)[seq_of]  # [C, rows]
    hidden = kpos.unsqueeze(2) > qpos.unsqueeze(1)  # [C, chunk, rows]
    if window is not None:
        hidden |= kpos.unsqueeze(2) <= qpos.unsqueeze(1) - window
    hidden |= absent.unsqueeze(2)
    hidden = hidden.repeat_interleave(group, dim=2).unsqueeze(1)
    row_start = torch.tensor([s.row_start for s in seqs], dtype=torch.int64).unsqueeze(1)
    query_index = torch.where(real, row_start + torch.arange(rows), row_start).reshape(-1)
    flat_real = real.reshape(-1)
    leaf = seq_of * slots + torch.tensor(chunk_abs, dtype=torch.int64) % slots
    return _ChunkBatch(
        num_seqs=len(seqs),
        rows=rows,
        slots=slots,
        blocks=table_t.clamp(min=0).to(device),
        zeroed=zeroed,
        chunk_seq=seq_of.to(device),
        leaf=leaf.to(device),
        hidden=hidden.to(device),
        query_index=query_index.to(device),
        out_rows=query_index[flat_real].to(device),
        out_from=torch.nonzero(flat_real).flatten().to(device),
    )


def _plan_piece(
    seqs: Sequence[AttentionSeq],
    rows: int,
    c0: Sequence[int],
    kpos: torch.Tensor,
    absent: torch.Tensor,
    chunk: int,
    window: int | None,
    group: int,
    device: torch.device,
) -> _Piece:
    num_seqs = len(seqs)
    spans = [_chunks(s, chunk, window) for s in seqs]
    # Gathered chunk j of sequence i is absolute chunk c0[i] + j; the piece uses the run
    # [first, first + num_chunks) of them (the same run for every sequence of the piece).
    first = min(lo - base for (lo, _), base in zip(spans, c0, strict=True))
    num_chunks = max(hi - base for (_, hi), base in zip(spans, c0, strict=True)) - first
    # The aligned tree node holding the piece's chunks: the smallest power-of-two-aligned run
    # of absolute chunk indices covering every sequence's.
    level = 0
    for base, (_, hi) in zip(c0, spans, strict=True):
        lo = base + first
        while lo >> level != (hi - 1) >> level:
            level += 1
    slots = 1 << level
    leaves = []
    for i, (base, (_, hi)) in enumerate(zip(c0, spans, strict=True)):
        lo = base + first
        leaves.append((i, lo - lo // slots * slots, hi - lo))
    aligned = slots == num_chunks and all(f == 0 and n == num_chunks for _, f, n in leaves)

    keys = slice(first * chunk, (first + num_chunks) * chunk)
    piece_kpos, piece_absent = kpos[:, keys], absent[:, keys]
    # Query positions per row; padding rows repeat the first row's (their output is dropped).
    starts = torch.tensor([s.start for s in seqs], dtype=torch.int64).unsqueeze(1)
    num_new = torch.tensor([s.num_rows for s in seqs], dtype=torch.int64).unsqueeze(1)
    real = torch.arange(rows) < num_new
    qpos = torch.where(real, starts + torch.arange(rows), starts)
    hidden = piece_kpos.unsqueeze(2) > qpos.unsqueeze(1)  # [S, keys, rows]
    if window is not None:
        hidden |= piece_kpos.unsqueeze(2) <= qpos.unsqueeze(1) - window
    hidden |= piece_absent.unsqueeze(2)
    hidden = hidden.repeat_interleave(group, dim=2).view(num_seqs, 1, num_chunks, chunk, -1)

    row_start = torch.tensor([s.row_start for s in seqs], dtype=torch.int64).unsqueeze(1)
    query_index = torch.where(real, row_start + torch.arange(rows), row_start).reshape(-1)
    flat_real = real.reshape(-1)
    return _Piece(
        rows=rows,
        first_chunk=first,
        num_chunks=num_chunks,
        slots=slots,
        query_index=query_index.to(device),
        out_rows=query_index[flat_real].to(device),
        out_from=torch.nonzero(flat_real).flatten().to(device),
        hidden=hidden.to(device),
        leaves=None if aligned else leaves,
    )


_SUM_ROWS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _sum_rows(device: torch.device, chunk: int) -> torch.Tensor:
    """``[SUM_ROWS, chunk]``: a row of ones, then zeros (the weight sum's left operand)."""
    rows = _SUM_ROWS.get((device, chunk))
    if rows is None:
        rows = _SUM_ROWS[(device, chunk)] = torch.zeros(SUM_ROWS, chunk, device=device)
        rows[0] = 1.0
    return rows


def paged_attention(
    query: torch.Tensor, planes: KVPlanes, metadata: AttentionMetadata
) -> torch.Tensor:
    """Attention of every sequence's new rows over its cached keys (see the module docstring).

    Args:
        query: ``[N, heads, head_dim]`` float32, already rotated (not yet scaled).
        planes: the layer's cache, with the new tokens' K and V written.
        metadata: the step's plan for this layer's group.

    Returns:
        ``[N, heads, head_dim]`` float32; rows outside every sequence are zero.
    """
    out = torch.zeros_like(query)
    for short in metadata.short_batches:
        _attend_chunks(query, out, planes, metadata, short)
    for batch in metadata.batches:
        _attend(query, out, planes, metadata, batch)
    return out


def _query_columns(
    query: torch.Tensor, index: torch.Tensor, s: int, rows: int, group: int
) -> torch.Tensor:
    """The scaled queries of ``s`` sequences of ``rows`` rows each (``index``: their step rows,
    padding rows repeated) as ``[S, Hkv, D, rows * group]``: a KV head's query heads' rows are
    the columns of its products."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = num_heads // group
    q = query[index] * (1.0 / math.sqrt(head_dim))
    q = q.view(s, rows, kv_heads, group, head_dim).permute(0, 2, 4, 1, 3)
    return q.reshape(s, kv_heads, head_dim, rows * group)


def _write_rows(
    out: torch.Tensor,
    attended: torch.Tensor,
    rows: int,
    group: int,
    out_rows: torch.Tensor,
    out_from: torch.Tensor,
) -> None:
    """Write ``attended`` ``[S, Hkv, D, rows * group]`` back as the step's rows ``out_rows`` of
    ``out`` ``[N, heads, D]`` (``out_from``: their positions among the ``S * rows``)."""
    s, kv_heads, head_dim = attended.shape[0], attended.shape[1], attended.shape[2]
    attended = attended.reshape(s, kv_heads, head_dim, rows, group).permute(0, 3, 1, 4, 2)
    out[out_rows] = attended.reshape(s * rows, kv_heads * group, head_dim)[out_from]


def _attend_chunks(
    query: torch.Tensor,
    out: torch.Tensor,
    planes: KVPlanes,
    meta: AttentionMetadata,
    b: _ChunkBatch,
) -> None:
    head_dim, kv_heads = query.shape[2], meta.num_kv_heads
    s, chunk, m = b.num_seqs, meta.chunk, b.rows * meta.group
    # Keys and values [C, chunk, Hkv, D], float32, in the cache's token-major order.
    shape = (-1, chunk, kv_heads, head_dim)
    k = planes.key.index_select(0, b.blocks).view(shape).to(torch.float32)
    v = planes.value.index_select(0, b.blocks).view(shape).to(torch.float32)
    flat = v.view(-1, kv_heads, head_dim)
    for lo, hi in b.zeroed:
        flat[lo:hi] = 0
    # Queries [S, Hkv, D, m], then each chunk's sequence's [C, Hkv, D, m].
    q = _query_columns(query, b.query_index, s, b.rows, meta.group).index_select(0, b.chunk_seq)
    # Scores [C, Hkv, chunk, m]: per KV head a chunk's keys (a strided view) are the matmul's
    # rows, its sequence's query rows the columns. The row maximum over all of a sequence's
    # chunks (exact in any order), then weights exactly 0 where hidden.
    scores = torch.stack([torch.matmul(k[:, :, h], q[:, h]) for h in range(kv_heads)], dim=1)
    scores = scores.masked_fill_(b.hidden, -math.inf)
    chunk_max = scores.amax(dim=2)  # [C, Hkv, m]
    row_max = chunk_max.new_full((s, kv_heads, m), -math.inf)
    row_max.scatter_reduce_(0, b.chunk_seq.view(-1, 1, 1).expand_as(chunk_max), chunk_max, "amax")
    weights = scores.sub_(row_max.index_select(0, b.chunk_seq).unsqueeze(2)).exp_()
    # Per chunk [C, Hkv, D + 1, m]: the weighted values and in row D the weight sum, as in
    # _attend_piece; then each sequence's chunks at their leaves of its tree.
    sum_rows = _sum_rows(query.device, chunk)
    heads = []
    for h in range(kv_heads):
        w = weights[:, h]  # [C, chunk, m]
        sums = torch.matmul(sum_rows, w)[:, :1]  # [C, 1, m]
        heads.append(torch.cat([torch.matmul(v[:, :, h].transpose(1, 2), w), sums], dim=1))
    partial = torch.stack(heads, dim=1)
    tree = partial.new_full((s * b.slots, kv_heads, head_dim + 1, m), -0.0)
    tree.index_copy_(0, b.leaf, partial)
    total = tree_sum(tree.view(s, b.slots, kv_heads, head_dim + 1, m), 1)  # [S, Hkv, D + 1, m]
    attended = total[:, :, :head_dim] / total[:, :, head_dim:]
    # [S, Hkv, D, rows, group] -> [S * rows, heads, D]
    _write_rows(out, attended, b.rows, meta.group, b.out_rows, b.out_from)


def _attend(
    query: torch.Tensor,
    out: torch.Tensor,
    planes: KVPlanes,
    meta: AttentionMetadata,
    b: _Batch,
) -> None:
    head_dim, kv_heads = query.shape[2], meta.num_kv_heads
    s, chunk, nch = b.num_seqs, meta.chunk, b.num_chunks
    # Keys [S, Hkv, chunks * chunk, D] and values, transposed, with the weight-sum rows
    # [S, Hkv, chunks, D + SUM_ROWS, chunk], float32: every piece of a long sequence reads
    # them, so they are laid out once for one product per piece and head group.
    keys = planes.key.index_select(0, b.blocks).view(s, nch, chunk, kv_heads, head_dim)
    values = planes.value.index_select(0, b.blocks).view(s, nch * chunk, kv_heads, head_dim)
    for i, lo, hi in b.zeroed:
        values[i, lo:hi] = 0
    k = torch.empty(s, kv_heads, nch * chunk, head_dim, dtype=torch.float32, device=query.device)
    k.view(s, kv_heads, nch, chunk, head_dim).copy_(keys.permute(0, 3, 1, 2, 4))
    v = torch.empty(
        s, kv_heads, nch, head_dim + SUM_ROWS, chunk, dtype=torch.float32, device=query.device
    )
    v[:, :, :, :head_dim].copy_(
        values.view(s, nch, chunk, kv_heads, head_dim).permute(0, 3, 1, 4, 2)
    )
    v[:, :, :, head_dim:].copy_(
        _sum_rows(query.device, chunk).expand(s, kv_heads, nch, SUM_ROWS, chunk)
    )
    for piece in b.pieces:
        lo, n = piece.first_chunk, piece.num_chunks
        _attend_piece(
            query, out, k[:, :, lo * chunk : (lo + n) * chunk], v[:, :, lo : lo + n], meta, piece
        )


def _attend_piece(
    query: torch.Tensor,
    out: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: AttentionMetadata,
    p: _Piece,
) -> None:
    head_dim = query.shape[2]
    s, kv_heads, nch = v.shape[0], v.shape[1], v.shape[2]
    m = p.rows * meta.group
    # Queries [S, Hkv, D, m]: the rows of a KV head's query heads next to each other.
    q = _query_columns(query, p.query_index, s, p.rows, meta.group)

    # Scores [S, Hkv, chunks, chunk, m]: keys are the matmul's rows (a multiple of 16), query
    # rows its columns. Weights exp(score - row max), exactly 0 where hidden.
    scores = torch.matmul(k, q).view(s, kv_heads, nch, meta.chunk, m)
    scores = scores.masked_fill_(p.hidden, -math.inf)
    row_max = scores.amax(dim=(2, 3), keepdim=True)
    weights = scores.sub_(row_max).exp_()
    # Per chunk [S, Hkv, chunks, D + SUM_ROWS, m]: the weighted values, and in row D the chunk's
    # weight sum (values and the ones row are the matmul's rows, queries its columns).
    partial = torch.matmul(v, weights)
    if p.leaves is not None:
        # Chunk j of sequence i is leaf ``first + j`` of its tree; other leaves are -0.0.
        tree = partial.new_full((s, kv_heads, p.slots, head_dim + SUM_ROWS, m), -0.0)
        for i, first, n in p.leaves:
            tree[i, :, first : first + n] = partial[i, :, :n]
        partial = tree
    total = tree_sum(partial, 2)  # [S, Hkv, D + SUM_ROWS, m]
    attended = total[:, :, :head_dim] / total[:, :, head_dim : head_dim + 1]
    # [S, Hkv, D, rows, group] -> [S * rows, heads, D]
    _write_rows(out, attended, p.rows, meta.group, p.out_rows, p.out_from)
