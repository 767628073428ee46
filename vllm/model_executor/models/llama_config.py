# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The transformer's sizes: ``LlamaConfig`` and its named presets (no torch import, so that the
command line can list and describe them before it loads the engine)."""

from __future__ import annotations

from dataclasses import dataclass


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

DEFAULT_PRESET = "small"
"""The preset of ``vllm-kv-offload run`` (``docs/benchmarks.md`` has what the default run costs
with it)."""


def get_preset(name: str) -> LlamaConfig:
    """The preset called ``name``.

    Raises:
        ValueError: no such preset (the message lists them).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}") from None
