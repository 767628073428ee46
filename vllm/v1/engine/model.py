# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The GPU KV cache's layouts, and the hash model stand-in (``--model hash``).

The engine's default model is the transformer (``vllm/model_executor/models/llama.py``); this
stand-in computes almost nothing, for fast tests and fuzzing, and writes KV bytes that are a
deterministic function of the token prefix. A real model writes, for token position ``t``, K
and V vectors that depend on tokens ``0..t``. The stand-in does the same with a hash instead of
a transformer: the KV of position ``t`` in layer
``l`` of KV-cache group ``g`` on worker ``rank`` is a pseudo-random function of
``(prefix_seed(tokens[0..t]), rank, g, l, K|V)``. So:

* two requests with the same prefix write identical bytes into their blocks (prefix caching and
  offloading are transparent), and
* any block loaded from the CPU tier or disk can be checked bit-exact against what recomputation
  writes (``reference_blocks``), at the cost of a hash.

Sampling is deterministic too: the token after position ``t`` is a function of its prefix seed, so
a run with offloading must produce exactly the outputs of a run without it.

KV layouts (``H`` = KV heads per worker, ``D`` = head size, ``bs`` = the group's block size):

* ``per_layer``: one tensor per layer, ``[2, num_blocks, bs, H, D]`` (K/V planes first).
* ``per_layer_blocks_first``: one tensor per layer, ``[num_blocks, 2, bs, H, D]``.
* ``cross_layer``: one tensor per group, ``[num_blocks, num_layers, 2, bs, H, D]``: one block of
  every layer is contiguous.

Values are written through an integer view of the tensor (same item size), masked so that every
value is a finite float.

Devices: the KV tensors may live on any device (``allocate_group_kv_cache(device=...)``); on the
host each starts on a memory page, as a GPU allocator's large blocks start aligned. Values
are computed on the host (numpy) and moved explicitly to the KV cache's device before they are
written, with block and offset indices on that device too; ``gather_blocks`` gathers on the
device. So the stand-in never mixes devices in one torch operation, and its writes are ordered on
torch's current stream of that device, the stream the offload handlers treat as the model's
compute stream.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import xxhash

U64 = npt.NDArray[np.uint64]

_MASK64 = (1 << 64) - 1
_P = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_Q = pow(_P, -1, 1 << 64)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SAMPLE_SALT = 0x5A17_0F_5A3B1E


class KVLayout(str, enum.Enum):
    """Memory layout of the stand-in's GPU KV tensors (see the module docstring)."""

    PER_LAYER = "per_layer"
    PER_LAYER_BLOCKS_FIRST = "per_layer_blocks_first"
    CROSS_LAYER = "cross_layer"


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Masks that keep an IEEE value finite (top exponent bit and sign cleared).
_FINITE_MASK = {torch.float16: 0x3FFF, torch.bfloat16: 0x3FFF, torch.float32: 0x3FFFFFFF}


def splitmix64(x: U64) -> U64:
    """The splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


class _Powers:
    """Growing tables ``P^(j+1)`` and ``Q^j`` (mod 2**64) shared by every ``prefix_seeds`` call."""

    def __init__(self) -> None:
        self.p = np.zeros(0, dtype=np.uint64)
        self.q = np.zeros(0, dtype=np.uint64)

    def get(self, n: int) -> tuple[U64, U64]:
        if len(self.p) < n:
            size = max(n, 2 * len(self.p), 1024)
            with np.errstate(over="ignore"):
                self.p = np.cumprod(np.full(size, _P, dtype=np.uint64), dtype=np.uint64)
                q = np.full(size, _Q, dtype=np.uint64)
                q[0] = 1
                self.q = np.cumprod(q, dtype=np.uint64)
        return self.p[:n], self.q[:n]


_POWERS = _Powers()


def prefix_seeds(
    token_ids: Sequence[int] | npt.NDArray[np.integer], start: int = 0, initial: int = 0
) -> U64:
    """Rolling prefix hash of every position: ``s[t] = s[t-1] * P + token[t] + 1`` (mod 2**64).

    Args:
        token_ids: tokens ``0 .. n-1``.
        start: return only positions ``start .. n-1`` (the hash still covers the whole prefix).
        initial: ``s[-1]``: pass the seed of the position before ``token_ids[0]`` to continue a
            prefix hashed earlier (0 for a prefix starting at the first token).

    Returns:
        uint64 array of length ``n - start``. Two positions get the same seed exactly when their
        token prefixes are equal (up to 64-bit collisions).
    """
    x = np.asarray(token_ids, dtype=np.uint64)
    n = len(x)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    p_pow, q_pow = _POWERS.get(n)
    with np.errstate(over="ignore"):
        # s[j] = initial P^(j+1) + sum_{i<=j} x'[i] P^(j-i) = P^(j+1) (initial + Q cumsum(x' Q^i))
        acc = np.cumsum((x + np.uint64(1)) * q_pow, dtype=np.uint64)
        seeds = p_pow * (np.uint64(initial & _MASK64) + np.uint64(_Q) * acc)
    return seeds[start:]


def sample_token(seed: int, vocab_size: int) -> int:
    """The token the stand-in samples after a position whose prefix seed is ``seed``."""
    mixed = splitmix64(np.array([seed ^ _SAMPLE_SALT], dtype=np.uint64))
    return int(mixed[0] % np.uint64(vocab_size))


def kv_values(seeds: U64, salt: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The stand-in's KV values for positions with prefix seeds ``seeds``.

    Args:
        seeds: prefix seeds of ``n`` positions.
        salt: distinguishes worker rank and KV-cache group.
        shape: per-position shape of the values, e.g. ``(num_layers, 2, H, D)``.
        dtype: the KV dtype (float16, bfloat16 or float32).

    Returns:
        Integer tensor (the dtype's same-size integer view) of shape ``(n, *shape)``; its bits,
        reinterpreted as ``dtype``, are finite floats.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    elems = int(np.prod(shape))
    words = -(-elems * itemsize // 8)
    base = splitmix64(seeds ^ np.uint64(salt & _MASK64))
    lanes = np.arange(words, dtype=np.uint64) * np.uint64(0xD1B54A32D192ED03)
    mixed = splitmix64(base[:, None] ^ lanes[None, :])
    int_dtype = {2: np.int16, 4: np.int32}[itemsize]
    values = mixed.view(int_dtype)[:, :elems] & int_dtype(_FINITE_MASK[dtype])
    return torch.from_numpy(np.ascontiguousarray(values)).reshape(len(seeds), *shape)


@dataclass
class GroupKVCache:
    """The GPU KV tensors of one KV-cache group on one worker.

    Attributes:
        group_idx: the group.
        block_size: tokens per GPU block.
        num_blocks: blocks per tensor.
        layout: the tensors' layout.
        layer_names: the group's layers, in order.
        tensors: one tensor per layer (per-layer layouts) or a single tensor (cross-layer).
    """

    group_idx: int
    block_size: int
    num_blocks: int
    layout: KVLayout
    layer_names: list[str]
    tensors: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        """Layers of the group."""
        return len(self.layer_names)


def allocate_group_kv_cache(
    group_idx: int,
    block_size: int,
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    layout: KVLayout,
    device: torch.device | str = "cpu",
) -> GroupKVCache:
    """Allocate zeroed KV tensors of one group in ``layout`` (see the module docstring)."""
    names = [f"model.layers.g{group_idx}.{i}.attn" for i in range(num_layers)]
    tail = (block_size, num_kv_heads, head_size)
    if layout is KVLayout.CROSS_LAYER:
        shape: tuple[int, ...] = (num_blocks, num_layers, 2, *tail)
        tensors = [_zeros(shape, dtype, device)]
    else:
        planes_first = layout is KVLayout.PER_LAYER
        shape = (2, num_blocks, *tail) if planes_first else (num_blocks, 2, *tail)
        tensors = [_zeros(shape, dtype, device) for _ in names]
    return GroupKVCache(group_idx, block_size, num_blocks, layout, names, tensors)


# Host KV tensors start on a memory page, as a GPU allocator's large blocks start aligned: then
# every layer's pages lie at one offset of a page, and the host copy path moves a per-layer job
# as one flat copy (vllm/kv_copy/host_copy.py) instead of one per layer.
_HOST_ALIGNMENT = 4096


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor of ``shape`` on ``device``; on the host, starting on a page."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = torch.zeros(nbytes + _HOST_ALIGNMENT, dtype=torch.uint8)
    start = -raw.data_ptr() % _HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).view(shape)


class StandInModel:
    """Writes and checks the KV of one worker rank.

    Args:
        rank: the worker rank (part of every value, so ranks hold different bytes).
        groups: the rank's KV tensors, one entry per KV-cache group.
        vocab_size: sampled tokens are in ``[0, vocab_size)``.
    """

    def __init__(self, rank: int, groups: Sequence[GroupKVCache], vocab_size: int) -> None:
        self.rank = rank
        self.groups = list(groups)
        self.vocab_size = vocab_size
        self._views = [[_int_view(t) for t in g.tensors] for g in self.groups]

    def _salt(self, group_idx: int) -> int:
        return (self.rank + 1) * 0x100000001B3 + (group_idx + 1) * 0xCBF29CE484222325

    def _values(self, group: GroupKVCache, seeds: U64) -> torch.Tensor:
        t = group.tensors[0]
        shape = (group.num_layers, 2, t.shape[-2], t.shape[-1])
        return kv_values(seeds, self._salt(group.group_idx), shape, t.dtype)

    def write(
        self,
        group_idx: int,
        seeds: U64,
        block_ids: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
    ) -> None:
        """Write the KV of positions with prefix seeds ``seeds`` into (block, offset) slots.

        Enqueued on torch's current stream of the KV cache's device (asynchronous on a GPU).
        """
        if len(seeds) == 0:
            return
        group = self.groups[group_idx]
        device = group.tensors[0].device
        values = self._values(group, seeds).to(device)  # (n, L, 2, H, D)
        blk = _indices(block_ids, device)
        off = _indices(offsets, device)
        views = self._views[group_idx]
        if group.layout is KVLayout.CROSS_LAYER:
            views[0][blk, :, :, off] = values
        elif group.layout is KVLayout.PER_LAYER:
            for layer, view in enumerate(views):
                view[:, blk, off] = values[:, layer].transpose(0, 1)
        else:
            for layer, view in enumerate(views):
                view[blk, :, off] = values[:, layer]

    def reference_blocks(
        self, group_idx: int, token_ids: Sequence[int], indices: Sequence[int]
    ) -> torch.Tensor:
        """What recomputation writes into blocks ``indices`` of a request, without touching the
        KV cache: the canonical block tensor of ``gather_blocks`` (an integer view, on the host).

        Args:
            group_idx: the group.
            token_ids: the request's tokens, at least up to the end of the last block asked for.
            indices: logical block indices (full blocks).
        """
        group = self.groups[group_idx]
        bs = group.block_size
        end = (max(indices) + 1) * bs if indices else 0
        seeds = prefix_seeds(token_ids[:end])
        pos = (np.asarray(indices, dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
        values = self._values(group, seeds[pos])  # [n * bs, L, 2, H, D]
        values = values.view(len(indices), bs, *values.shape[1:])
        return values.permute(0, 2, 3, 1, 4, 5).contiguous()

    def sample(self, seed: int) -> int:
        """The token sampled after a position with prefix seed ``seed``."""
        return sample_token(seed, self.vocab_size)


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_INT_VIEW[tensor.element_size()])


def _indices(ids: npt.NDArray[np.int64], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 index tensor on ``device`` (the indexed tensor's device)."""
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)


def gather_blocks(group: GroupKVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """Copies of GPU blocks in one canonical shape, whatever the layout.

    Returns:
        ``[n, num_layers, 2, block_size, H, D]`` (K/V planes in dim 2) on the cache's device, in
        the cache's dtype; it shares no memory with the cache.
    """
    tensors = group.tensors
    idx = _indices(np.asarray(block_ids, dtype=np.int64), tensors[0].device)
    if group.layout is KVLayout.CROSS_LAYER:
        return tensors[0][idx]
    if group.layout is KVLayout.PER_LAYER:
        return torch.stack([t[:, idx] for t in tensors]).permute(2, 0, 1, 3, 4, 5).contiguous()
    return torch.stack([t[idx] for t in tensors], dim=1)


def layer_planes(group: GroupKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the K and V planes of one layer of the group, each ``[num_blocks, block_size,
    H, D]``, whatever the layout (writes through them land in the group's tensors)."""
    if group.layout is KVLayout.CROSS_LAYER:
        t = group.tensors[0]
        return t[:, layer, 0], t[:, layer, 1]
    t = group.tensors[layer]
    if group.layout is KVLayout.PER_LAYER:
        return t[0], t[1]
    return t[:, 0], t[:, 1]


def block_digests(blocks: torch.Tensor) -> list[bytes]:
    """A 128-bit digest (xxh3) of each block's bytes (dim 0 of ``blocks``, any dtype/device).

    Equal blocks have equal digests; a changed byte changes the digest (up to 2**-128).
    """
    host = blocks.detach().contiguous().cpu()
    rows = host.view(torch.uint8).reshape(host.shape[0], -1).numpy()
    return [xxhash.xxh3_128_digest(row) for row in rows]


class ModelStandIn(str, enum.Enum):
    """The model stand-ins the engine can serve (their KV-cache groups)."""

    STANDARD = "standard"
    """One KV-cache group with full attention."""
    HYBRID = "hybrid"
    """Two groups, as in Gemma-3- or Llama-4-style models: full attention (group 0) and
    sliding-window attention (group 1)."""


def hybrid_stand_in(
    block_size: int, sliding_window: int, swa_block_size: int | None = None
) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """``(gpu_block_sizes, sliding_windows)`` of the hybrid stand-in's two KV-cache groups.

    Args:
        block_size: tokens per GPU block of the full-attention group.
        sliding_window: the SWA group's window in tokens.
        swa_block_size: tokens per GPU block of the SWA group (default: ``block_size``).
    """
    return (block_size, swa_block_size or block_size), (None, sliding_window)
