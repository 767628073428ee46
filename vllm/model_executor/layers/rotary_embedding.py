# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Llama's rotary position embedding (the GPT-NeoX form: the two halves of a head rotate as
pairs ``(x[i], x[i + D/2])``).

The cosine/sine table is computed per element with Python's ``math`` in float64 and rounded to
float32, so an entry is a function of its position alone: engines with tables of different
lengths (or grown at different times) hold the same values, as batch invariance needs. It grows in
steps of ``TABLE_STEP`` positions as longer sequences arrive.

Ownership: one instance per model, used by the thread that runs the model.
"""

from __future__ import annotations

import math

import torch

TABLE_STEP = 1024
"""Positions the table grows by."""


class RotaryEmbedding:
    """Rotates query and key heads by their positions.

    Args:
        head_dim: elements per head (even).
        base: the RoPE base (``rope_theta``).
        device: where the table and the rotated tensors live.
    """

    def __init__(self, head_dim: int, base: float, device: torch.device | str) -> None:
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {head_dim}")
        self.head_dim = head_dim
        self.device = torch.device(device)
        self._inv_freq = [base ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]
        self._cos = torch.empty(0, head_dim // 2, device=self.device)
        self._sin = torch.empty(0, head_dim // 2, device=self.device)

    def _ensure(self, num_positions: int) -> None:
        have = self._cos.shape[0]
        if num_positions <= have:
            return
        want = -(-num_positions // TABLE_STEP) * TABLE_STEP
        angles = [[pos * f for f in self._inv_freq] for pos in range(have, want)]
        cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
        sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
        self._cos = torch.cat([self._cos, cos.to(torch.float32).to(self.device)])
        self._sin = torch.cat([self._sin, sin.to(torch.float32).to(self.device)])

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, max_position: int) -> torch.Tensor:
        """Rotate ``x`` (``[N, heads, head_dim]``) by ``positions`` (``[N]``, int64, on the
        table's device, all below ``max_position``)."""
        self._ensure(max_position)
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
