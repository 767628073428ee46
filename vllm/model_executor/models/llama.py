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


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of one preset.

    Attributes:
        name: the preset's name.
        num_layers: layers per KV-cache group.
        hidden_size: ``d_model``.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention: ``num_heads`` is a multiple).
        head_dim: elements per head.
        intermediate_size: the SwiGLU MLP's hidden width.
        rope_theta: the rotary embedding's base.
        rms_norm_eps: RMSNorm's epsilon.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"preset {self.name!r}: {self.num_heads} heads is not a multiple of "
                f"{self.num_kv_heads} KV heads"
            )

    def num_parameters(self, vocab_size: int, num_groups: int = 1) -> int:
        """Parameters of the model with this vocabulary and number of KV-cache groups (the LM
        head is the embedding)."""
        d, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        per_layer = 2 * d + d * (q + 2 * kv) + q * d + 3 * d * self.intermediate_size
        return vocab_size * d + d + self.num_layers * num_groups * per_layer

    def kv_bytes_per_token(self, itemsize: int, num_groups: int = 1) -> int:
        """Bytes of K and V one token occupies in the KV cache (every layer)."""
        return 2 * self.num_layers * num_groups * self.num_kv_heads * self.head_dim * itemsize


PRESETS: dict[str, LlamaConfig] = {
    p.name: p
    for p in (
        # The tests' model: a few thousand tokens per second of CPU prefill are not its point.
        LlamaConfig("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate_size=128),
        # The KV geometry of the presets below is the hash stand-in's default (8 layers x 2 KV
        # heads x 64, 4 KiB per token in float16): the tiers' default sizes fit all of them.
        LlamaConfig("small", num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2,
                    head_dim=64, intermediate_size=768),
        LlamaConfig("medium", num_layers=8, hidden_size=384, num_heads=6, num_kv_heads=2,
                    head_dim=64, intermediate_size=1024),
        LlamaConfig("base", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=2,
                    head_dim=64, intermediate_size=1536),
    )
}  # fmt: skip
"""The named sizes, smallest first (``docs/model.md`` has their costs)."""


def get_preset(name: str) -> LlamaConfig:
    """The preset called ``name``.

    Raises:
        ValueError: no such preset (the message lists them).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None


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
        self.lm_head = self.embed.t()  # tied: [d, vocab]
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
        return linear(h, self.lm_head)[: hidden.shape[0]]

    @staticmethod
    def sample(logits: torch.Tensor) -> list[int]:
        """Greedy sampling: the first maximal logit of each row."""
        if logits.shape[0] == 0:
            return []
        return [int(t) for t in logits.argmax(dim=-1).cpu()]
