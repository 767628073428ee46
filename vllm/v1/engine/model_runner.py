# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ModelRunner``: computes a worker rank's scheduled tokens over its GPU KV cache.

Two models (``EngineConfig.model``):

* ``TransformerModelRunner`` (``transformer``, the default): the Llama-architecture transformer of
  ``vllm/model_executor/models/llama.py``; attention reads K and V from the rank's paged KV cache
  through the block tables, so the bytes offloading stores and loads are what the model consumes.
* ``HashModelRunner`` (``hash``): the hash stand-in of ``model.py``, which computes almost
  nothing; for fast tests and fuzzing.

Both are deterministic and batch-invariant, so the engine's oracle (``verification.py``) can check
any block bit-exact against ``reference_blocks``, an independent computation that never touches
the engine's KV cache.

Ownership: a runner belongs to its ``Worker`` and is called from the engine thread only.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
from typing_extensions import override

from vllm.model_executor.layers.paged_attention import AttentionSeq, KVPlanes
from vllm.model_executor.models.llama import (
    ForwardBatch,
    GroupBatch,
    LlamaForCausalLM,
    get_preset,
)
from vllm.v1.engine.model import (
    U64,
    GroupKVCache,
    StandInModel,
    allocate_group_kv_cache,
    block_digests,
    gather_blocks,
    layer_planes,
    prefix_seeds,
)

RECOMPUTE_CHUNK = 512
"""Tokens per forward pass when ``TransformerModelRunner.reference_blocks`` recomputes a prefix
(any chunking gives the same bytes; this bounds the scratch activations)."""


class ModelKind(str, enum.Enum):
    """The models the engine can serve."""

    TRANSFORMER = "transformer"
    """The Llama-architecture transformer (``vllm/model_executor/models/llama.py``)."""
    HASH = "hash"
    """The hash stand-in (``vllm/v1/engine/model.py``): prefill costs almost nothing."""


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's part of a step on one rank.

    Attributes:
        req_id: the request.
        token_ids: its tokens known to the rank (at least ``end`` of them).
        start: first position computed this step (its KV before ``start`` is in the cache).
        end: one past the last position computed this step.
        block_ids: its block table in every KV-cache group.
        sample: ``end`` is its last known token: sample the next one.
    """

    req_id: str
    token_ids: Sequence[int]
    start: int
    end: int
    block_ids: Sequence[Sequence[int]]
    sample: bool


class ModelRunner(ABC):
    """Runs one rank's model over the rank's GPU KV cache.

    Args:
        kv_caches: the rank's KV tensors, one entry per KV-cache group.
    """

    def __init__(self, kv_caches: Sequence[GroupKVCache]) -> None:
        self.kv_caches = list(kv_caches)

    @abstractmethod
    def execute(self, seqs: Sequence[ScheduledSeq]) -> dict[str, int]:
        """Compute a step: write the KV of every scheduled token into its slot.

        Returns:
            The token sampled for each sequence with ``sample`` set, by request id.
        """

    def release(self, req_id: str) -> None:  # noqa: B027 (a documented no-op hook)
        """The request finished or was preempted: forget anything kept for it (no-op by
        default)."""

    @abstractmethod
    def reference_blocks(
        self, token_ids: Sequence[int], blocks: Mapping[int, Sequence[int]]
    ) -> dict[int, torch.Tensor]:
        """Recompute full blocks of a request independently (the engine's KV cache is not read
        or written).

        Args:
            token_ids: the request's tokens, at least to the end of the last block asked for.
            blocks: logical block indices per group.

        Returns:
            Per group, the blocks in the canonical shape of ``gather_blocks``: their digests are
            comparable with ``block_digests`` of the same blocks in the KV cache.
        """

    def block_digests(self, group: int, block_ids: Sequence[int]) -> list[bytes]:
        """Digests of GPU blocks of the rank's KV cache (see ``model.block_digests``)."""
        return block_digests(gather_blocks(self.kv_caches[group], block_ids))


class HashModelRunner(ModelRunner):
    """The hash stand-in (``StandInModel``) on one rank.

    Args:
        kv_caches: the rank's KV tensors.
        rank: the rank (part of every value, so ranks hold different bytes).
        vocab_size: sampled tokens are below this.
    """

    def __init__(self, kv_caches: Sequence[GroupKVCache], rank: int, vocab_size: int) -> None:
        super().__init__(kv_caches)
        self.model = StandInModel(rank, self.kv_caches, vocab_size)
        # Per request: (positions seeded, the prefix seed of the last one), so that a request
        # continuing where it stopped hashes only its new tokens.
        self._seeded: dict[str, tuple[int, int]] = {}

    @override
    def execute(self, seqs: Sequence[ScheduledSeq]) -> dict[str, int]:
        sampled: dict[str, int] = {}
        # The step's tokens are written in one call per group, as one forward pass would: a
        # decode step of many sequences then costs a dozen array calls, not a dozen per sequence.
        seeds_parts: list[U64] = []
        slots: list[tuple[list[npt.NDArray[np.int64]], list[npt.NDArray[np.int64]]]] = [
            ([], []) for _ in self.kv_caches
        ]
        for seq in seqs:
            upto, last = self._seeded.get(seq.req_id, (-1, 0))
            if upto != seq.start:
                # (Re)started at a prefix hit or after a load: seed from scratch once.
                seeds = prefix_seeds(seq.token_ids[: seq.end], seq.start)
            else:
                seeds = prefix_seeds(seq.token_ids[seq.start : seq.end], 0, initial=last)
            seeds_parts.append(seeds)
            positions = np.arange(seq.start, seq.end, dtype=np.int64)
            for (blocks, offsets), cache, table in zip(
                slots, self.kv_caches, seq.block_ids, strict=True
            ):
                bs = cache.block_size
                blocks.append(np.asarray(table, dtype=np.int64)[positions // bs])
                offsets.append(positions % bs)
            self._seeded[seq.req_id] = (seq.end, int(seeds[-1]))
            if seq.sample:
                sampled[seq.req_id] = self.model.sample(int(seeds[-1]))
        if seeds_parts:
            # Every (block, offset) slot is written once: a step computes each position once.
            all_seeds = np.concatenate(seeds_parts)
            for g, (blocks, offsets) in enumerate(slots):
                self.model.write(g, all_seeds, np.concatenate(blocks), np.concatenate(offsets))
        return sampled

    @override
    def release(self, req_id: str) -> None:
        self._seeded.pop(req_id, None)

    @override
    def reference_blocks(
        self, token_ids: Sequence[int], blocks: Mapping[int, Sequence[int]]
    ) -> dict[int, torch.Tensor]:
        return {g: self.model.reference_blocks(g, token_ids, idx) for g, idx in blocks.items()}


class TransformerModelRunner(ModelRunner):
    """The transformer on one rank (the engine runs it with one rank).

    Args:
        kv_caches: the rank's KV tensors; their geometry is the preset's.
        preset: the model's size (``vllm.model_executor.models.llama.PRESETS``).
        vocab_size: the vocabulary.
        seed: seeds the weights.
        sliding_windows: per group, its window or None; empty: full attention everywhere.
    """

    def __init__(
        self,
        kv_caches: Sequence[GroupKVCache],
        preset: str,
        vocab_size: int,
        seed: int,
        sliding_windows: Sequence[int | None] = (),
    ) -> None:
        super().__init__(kv_caches)
        first = self.kv_caches[0].tensors[0]
        self.model = LlamaForCausalLM(
            get_preset(preset), vocab_size, len(self.kv_caches), seed, first.device
        )
        self.sliding_windows = tuple(sliding_windows) or (None,) * len(self.kv_caches)
        self._planes = self._layer_planes(self.kv_caches)

    def _layer_planes(self, caches: Sequence[GroupKVCache]) -> list[KVPlanes]:
        planes = []
        for layer in range(self.model.num_layers):
            group, index = self.model.layer_group(layer)
            planes.append(KVPlanes(*layer_planes(caches[group], index)))
        return planes

    @override
    def execute(self, seqs: Sequence[ScheduledSeq]) -> dict[str, int]:
        if not seqs:
            return {}
        hidden = self.model.forward(self.build_batch(seqs), self._planes, self.sliding_windows)
        tokens = self.model.sample(self.model.compute_logits(hidden))
        return dict(zip((s.req_id for s in seqs if s.sample), tokens, strict=True))

    def build_batch(self, seqs: Sequence[ScheduledSeq]) -> ForwardBatch:
        """The model's input for ``seqs`` (rows in their order, on the model's device)."""
        device = self.model.device
        token_ids: list[int] = []
        positions: list[np.ndarray] = []
        group_seqs: list[list[AttentionSeq]] = [[] for _ in self.kv_caches]
        slots: list[tuple[list[np.ndarray], list[np.ndarray]]] = [([], []) for _ in self.kv_caches]
        sample_rows: list[int] = []
        row = 0
        for seq in seqs:
            pos = np.arange(seq.start, seq.end, dtype=np.int64)
            token_ids.extend(seq.token_ids[seq.start : seq.end])
            positions.append(pos)
            for g, cache in enumerate(self.kv_caches):
                table = np.asarray(seq.block_ids[g], dtype=np.int64)
                bs = cache.block_size
                slots[g][0].append(table[pos // bs])
                slots[g][1].append(pos % bs)
                group_seqs[g].append(AttentionSeq(row, seq.start, seq.end, seq.block_ids[g]))
            row += seq.end - seq.start
            if seq.sample:
                sample_rows.append(row - 1)

        def dev(parts: list[np.ndarray]) -> torch.Tensor:
            return torch.from_numpy(np.concatenate(parts)).to(device)

        return ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=dev(positions),
            max_position=max(s.end for s in seqs),
            groups=[
                GroupBatch(gs, dev(blocks), dev(offsets))
                for gs, (blocks, offsets) in zip(group_seqs, slots, strict=True)
            ],
            sample_rows=sample_rows,
        )

    @override
    def reference_blocks(
        self, token_ids: Sequence[int], blocks: Mapping[int, Sequence[int]]
    ) -> dict[int, torch.Tensor]:
        wanted = {g: list(idx) for g, idx in blocks.items() if idx}
        if not wanted:
            return {g: self._empty(g) for g in blocks}
        end = max((max(idx) + 1) * self.kv_caches[g].block_size for g, idx in wanted.items())
        scratch = [
            allocate_group_kv_cache(
                c.group_idx,
                c.block_size,
                -(-end // c.block_size),
                c.num_layers,
                c.tensors[0].shape[-2],
                c.tensors[0].shape[-1],
                c.tensors[0].dtype,
                c.layout,
                c.tensors[0].device,
            )
            for c in self.kv_caches
        ]
        planes = self._layer_planes(scratch)
        tables = [list(range(c.num_blocks)) for c in scratch]
        for lo in range(0, end, RECOMPUTE_CHUNK):
            seq = ScheduledSeq(
                "reference", token_ids, lo, min(lo + RECOMPUTE_CHUNK, end), tables, False
            )
            self.model.forward(self.build_batch([seq]), planes, self.sliding_windows)
        return {
            g: gather_blocks(scratch[g], blocks[g]).cpu() if blocks[g] else self._empty(g)
            for g in blocks
        }

    def _empty(self, group: int) -> torch.Tensor:
        return gather_blocks(self.kv_caches[group], []).cpu()
