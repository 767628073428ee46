# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A decoder-only transformer of the Llama architecture, with seeded weights and named sizes.

Architecture (as Llama 2/3): token embedding; per layer ``x += o_proj(attn(rope(q), rope(k), v))``
on ``rms_norm(x)`` with grouped-query attention, then ``x += down(silu(gate) * up)`` on
``rms_norm(x)`` (SwiGLU); a final RMSNorm and an LM head tied to the embedding. Sampling is
greedy (the first maximal logit), so outputs are a function of the prompt.

Weights are drawn at construction from a ``torch.Generator`` seeded with ``seed`` (on the host,
then moved to the device), so every engine with the same preset, vocabulary, groups and seed holds
the same model; nothing is downloaded. Compute is float32; K and V are stored in the KV cache's
dtype and read back from it, so a token's own attention uses the bytes later tokens (and
offloading) see.

KV-cache groups: with ``num_groups`` groups (the hybrid stand-in has a full-attention group and a
sliding-window group), the model has ``num_layers * num_groups`` layers; layer ``i`` belongs to
group ``i % num_groups`` as that group's layer ``i // num_groups`` (interleaved, as Gemma-3-style
models alternate local and global layers).

Every operation is batch-invariant (``layers/batch_invariant.py``, ``layers/paged_attention.py``):
a token's KV and logits are bit-identical whatever batch, prefill chunking or tier its prefix came
from.

Ownership: a model belongs to the thread that runs ``forward`` (the engine's worker); it holds no
state between calls besides its weights and the rotary table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.batch_invariant import (
    linear,
    linear_by_columns,
    pad_rows,
    rms_norm,
    silu_and_mul,
)
from vllm.model_executor.layers.paged_attention import (
    AttentionMetadata,
    AttentionSeq,
    KVPlanes,
    paged_attention,
    write_kv,
)
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.models.llama_config import (
    DEFAULT_PRESET,
    PRESETS,
    LlamaConfig,
    get_preset,
)

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "ForwardBatch",
    "GroupBatch",
    "LlamaConfig",
    "LlamaForCausalLM",
    "get_preset",
]


@dataclass(frozen=True)
class GroupBatch:
    """One KV-cache group's view of a step.

    Attributes:
        seqs: the sequences (their rows and block tables in this group).
        slot_blocks: ``[N]`` int64 on the model's device: the block of each new token.
        slot_offsets: ``[N]`` int64 on the model's device: its offset in the block.
    """

    seqs: Sequence[AttentionSeq]
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    """What one forward pass computes.

    Attributes:
        token_ids: ``[N]`` int64 on the model's device: the new tokens, each sequence's together.
        positions: ``[N]`` int64 on the model's device.
        max_position: one past the largest position.
        groups: one entry per KV-cache group.
        sample_rows: rows whose next token is sampled, in the order results are returned.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    max_position: int
    groups: Sequence[GroupBatch]
    sample_rows: Sequence[int]


@dataclass
class _LayerWeights:
    attn_norm: torch.Tensor  # [d]
    qkv: torch.Tensor  # [d, (heads + 2 kv_heads) * head_dim]
    o: torch.Tensor  # [heads * head_dim, d]
    mlp_norm: torch.Tensor  # [d]
    gate_up: torch.Tensor  # [d, 2 * intermediate]
    down: torch.Tensor  # [intermediate, d]


class LlamaForCausalLM:
    """The transformer (see the module docstring).

    Args:
        config: the preset.
        vocab_size: tokens are below this.
        num_groups: KV-cache groups (layers = ``config.num_layers * num_groups``).
        seed: seeds the weights.
        device: where weights and activations live.
    """

    def __init__(
        self,
        config: LlamaConfig,
        vocab_size: int,
        num_groups: int = 1,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.num_groups = num_groups
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(seed)
        d, hd = config.hidden_size, config.head_dim
        q, kv = config.num_heads * hd, config.num_kv_heads * hd

        def weight(fan_in: int, fan_out: int) -> torch.Tensor:
            w = torch.randn(fan_in, fan_out, generator=gen) / math.sqrt(fan_in)
            return w.to(self.device)

        def norm() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(d, generator=gen)).to(self.device)

        self.embed = torch.randn(vocab_size, d, generator=gen).to(self.device)
        self.layers = [
            _LayerWeights(
                attn_norm=norm(),
                qkv=weight(d, q + 2 * kv),
                o=weight(q, d),
                mlp_norm=norm(),
                gate_up=weight(d, 2 * config.intermediate_size),
                down=weight(config.intermediate_size, d),
            )
            for _ in range(config.num_layers * num_groups)
        ]
        self.final_norm = norm()
        self.rotary = RotaryEmbedding(hd, config.rope_theta, self.device)

    @property
    def num_layers(self) -> int:
        """Layers of the model (every group's)."""
        return len(self.layers)

    def layer_group(self, layer: int) -> tuple[int, int]:
        """``(group, index in the group)`` of model layer ``layer``."""
        return layer % self.num_groups, layer // self.num_groups

    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: Sequence[KVPlanes],
        sliding_windows: Sequence[int | None],
    ) -> torch.Tensor:
        """Compute the step: write every new token's K and V into the cache.

        Args:
            batch: the step.
            kv_caches: the paged cache of every model layer, in layer order.
            sliding_windows: per group, its window in tokens or None (full attention).

        Returns:
            ``[len(batch.sample_rows), hidden_size]``: the final hidden states of the rows to
            sample (``compute_logits`` turns them into logits).
        """
        cfg = self.config
        n = batch.token_ids.shape[0]
        hd, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        ff = cfg.intermediate_size
        positions = batch.positions
        metadata = [
            AttentionMetadata.build(
                gb.seqs,
                kv_caches[g].key.shape[1],
                sliding_windows[g],
                heads,
                kv_heads,
                self.device,
            )
            for g, gb in enumerate(batch.groups)
        ]
        x = pad_rows(self.embed[batch.token_ids])
        for i, (w, planes) in enumerate(zip(self.layers, kv_caches, strict=True)):
            group = self.layer_group(i)[0]
            gb = batch.groups[group]
            h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
            qkv = linear(h, w.qkv)[:n]
            q = qkv[:, : heads * hd].reshape(n, heads, hd)
            k = qkv[:, heads * hd : (heads + kv_heads) * hd].reshape(n, kv_heads, hd)
            v = qkv[:, (heads + kv_heads) * hd :].reshape(n, kv_heads, hd)
            q = self.rotary(q, positions, batch.max_position)
            k = self.rotary(k, positions, batch.max_position)
            write_kv(planes, gb.slot_blocks, gb.slot_offsets, k, v)
            attn = paged_attention(q, planes, metadata[group])
            x = x + linear(pad_rows(attn.reshape(n, heads * hd)), w.o)
            h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
            gate_up = linear(h, w.gate_up)
            x = x + linear(silu_and_mul(gate_up[:, :ff], gate_up[:, ff:]), w.down)
        rows = torch.tensor(list(batch.sample_rows), dtype=torch.int64, device=self.device)
        return x[rows]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` of final hidden states ``[n, hidden_size]``."""
        h = rms_norm(pad_rows(hidden), self.final_norm, self.config.rms_norm_eps)
        # The vocabulary's rows are the product's rows (``linear_by_columns``): the tied
        # embedding is streamed once per step, the few sampled rows are its columns.
        return linear_by_columns(h, self.embed)[: hidden.shape[0]]

    @staticmethod
    def sample(logits: torch.Tensor) -> list[int]:
        """Greedy sampling: the first maximal logit of each row."""
        if logits.shape[0] == 0:
            return []
        return [int(t) for t in logits.argmax(dim=-1).cpu()]
