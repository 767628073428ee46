# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A layout-independent description of a worker's GPU KV caches, for the transfer handlers.

Whatever the attention backend's layout, the handlers see the KV cache as a list of *canonical
tensors*: each one addresses blocks by GPU block id, block ``b`` being ``page_size_bytes``
contiguous bytes at ``ptr + b * row_stride_bytes`` (an int8 ``(num_blocks, page_size_bytes)``
view with stride ``(row_stride_bytes, 1)``). Layouts map to canonical tensors as follows
(``B`` = num_blocks, ``T`` = block_size in tokens, ``H`` = num_kv_heads, ``D`` = head_dim,
``L`` = num_layers, ``e`` = element size in bytes):

* ``KVCacheLayout.KV_FIRST``: one ``[2, B, T, H, D]`` tensor per layer -> two canonical tensors
  per layer (K plane, V plane), each ``(B, T*H*D*e)`` with row stride ``T*H*D*e``.
* ``KVCacheLayout.BLOCKS_FIRST``: one ``[B, 2, T, H, D]`` tensor per layer -> one canonical
  tensor per layer, ``(B, 2*T*H*D*e)``.
* ``KVCacheLayout.CROSS_LAYER``: one ``[B, L, 2, T, H, D]`` tensor (any shape whose per-block part
  is contiguous) in which one block of every layer is contiguous -> one canonical tensor
  ``(B, L*2*T*H*D*e)``: a block is one large page, which is what makes transfers fast.

KV-cache groups (hybrid models) refer to canonical tensors through ``CanonicalKVCacheRef``s, with
the group's *unpadded* page size: only those bytes of each page are moved for that group.

Every canonical tensor records where its memory is: the ordinal of its CUDA device, or None for
host memory (the CPU-only setup, where the "GPU" KV cache is a CPU tensor). A worker's tensors are
all on one device, which the transfer handlers then run on.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class KVCacheLayout(enum.Enum):
    """GPU KV-cache layouts that ``build_canonical_kv_caches`` understands (see module doc)."""

    KV_FIRST = "kv_first"
    """Per layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""

    BLOCKS_FIRST = "blocks_first"
    """Per layer ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``."""

    CROSS_LAYER = "cross_layer"
    """One tensor ``[num_blocks, ...]``: a block of every layer contiguous."""


@dataclass(frozen=True, eq=False)
class CanonicalKVCacheTensor:
    """Block-indexed KV memory: block ``b`` is ``[ptr + b*row_stride_bytes, +page_size_bytes)``.

    Attributes:
        ptr: address of block 0 (memory of CUDA device ``device_index``, else host memory).
        num_blocks: number of blocks (GPU block ids are ``0 .. num_blocks-1``).
        page_size_bytes: bytes of one block's page, padding included.
        row_stride_bytes: bytes from block ``b`` to ``b + 1`` (``>= page_size_bytes``).
        device_index: the CUDA device ordinal of the memory (CUDA copy path), or None for host
            memory (torch path, e.g. the CPU-only setup where the "GPU" KV cache is a CPU tensor).
        tensor: the int8 ``(num_blocks, page_size_bytes)`` view, stride ``(row_stride_bytes, 1)``,
            when built from a tensor; None for raw memory. Keeps the memory alive.
        owner: keeps raw memory alive (e.g. a test's device buffer); not used otherwise.

    Raises:
        ValueError: a null address, no blocks, overlapping pages or a negative device index.
    """

    ptr: int
    num_blocks: int
    page_size_bytes: int
    row_stride_bytes: int
    device_index: int | None
    tensor: torch.Tensor | None = None
    owner: object | None = None

    def __post_init__(self) -> None:
        if self.ptr <= 0:
            raise ValueError(f"ptr={self.ptr} must be a non-null address")
        if self.device_index is not None and self.device_index < 0:
            raise ValueError(f"device_index={self.device_index} must be >= 0 (or None for host)")
        if self.num_blocks < 1 or self.page_size_bytes < 1:
            raise ValueError(
                f"num_blocks={self.num_blocks} and page_size_bytes={self.page_size_bytes} must "
                "be >= 1"
            )
        if self.num_blocks > 1 and self.row_stride_bytes < self.page_size_bytes:
            raise ValueError(
                f"row_stride_bytes={self.row_stride_bytes} < page_size_bytes="
                f"{self.page_size_bytes}: pages of consecutive blocks would overlap"
            )

    @classmethod
    def from_tensor(cls, view: torch.Tensor) -> CanonicalKVCacheTensor:
        """Wrap an int8 ``(num_blocks, page_size_bytes)`` view with stride ``(row_stride, 1)``.

        Raises:
            ValueError: wrong dtype, rank or strides, or memory that is neither host nor CUDA.
        """
        if view.device.type not in ("cpu", "cuda"):
            raise ValueError(f"KV caches must be CPU or CUDA tensors, got {view.device}")
        if view.dtype != torch.int8 or view.dim() != 2:
            raise ValueError(
                "expected an int8 (num_blocks, page_bytes) view, got "
                f"{view.dtype} {tuple(view.shape)}"
            )
        if view.stride(1) != 1 and view.shape[1] > 1:
            raise ValueError(f"pages must be contiguous, got strides {view.stride()}")
        return cls(
            ptr=view.data_ptr(),
            num_blocks=int(view.shape[0]),
            page_size_bytes=int(view.shape[1]),
            row_stride_bytes=int(view.stride(0)),
            # A CUDA tensor always has a concrete index (torch resolves "cuda" when allocating).
            device_index=None if view.device.type == "cpu" else view.device.index,
            tensor=view,
        )

    @property
    def on_device(self) -> bool:
        """Whether the memory is CUDA device memory (else host memory)."""
        return self.device_index is not None

    @property
    def end_ptr(self) -> int:
        """One past the last byte any block's page covers."""
        return self.ptr + (self.num_blocks - 1) * self.row_stride_bytes + self.page_size_bytes

    def __repr__(self) -> str:
        where = "host" if self.device_index is None else f"cuda:{self.device_index}"
        return (
            f"CanonicalKVCacheTensor({where} {self.ptr:#x}, num_blocks={self.num_blocks}, "
            f"page={self.page_size_bytes}, stride={self.row_stride_bytes})"
        )


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """A KV-cache group's use of one canonical tensor.

    Attributes:
        tensor_idx: index into ``CanonicalKVCaches.tensors``.
        page_size_bytes: the group's unpadded page size: the first ``page_size_bytes`` of each of
            the tensor's pages are this group's data (``<= tensor.page_size_bytes``).
    """

    tensor_idx: int
    page_size_bytes: int


@dataclass(frozen=True, eq=False)
class CanonicalKVCaches:
    """The canonical tensors of a worker's KV cache and, per KV-cache group, the ones it uses.

    Attributes:
        tensors: canonical tensors; pairwise disjoint, all on one CUDA device or all on the host.
        group_data_refs: ``group_data_refs[g]`` lists the tensors (with unpadded page sizes) that
            hold group ``g``'s data; a block of group ``g`` is moved by moving its page in each.
    """

    tensors: tuple[CanonicalKVCacheTensor, ...]
    group_data_refs: tuple[tuple[CanonicalKVCacheRef, ...], ...]

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ValueError("at least one canonical tensor is required")
        if not self.group_data_refs:
            raise ValueError("at least one KV-cache group is required")
        places = {t.device_index for t in self.tensors}
        if len(places) != 1:
            names = sorted("host" if d is None else f"cuda:{d}" for d in places)
            raise ValueError(
                f"canonical tensors must all be on one device or all on the host, got {names}"
            )
        ordered = sorted(self.tensors, key=lambda t: t.ptr)
        for a, b in itertools.pairwise(ordered):
            if b.ptr < a.end_ptr:
                raise ValueError(f"canonical tensors {a!r} and {b!r} overlap")
        for g, refs in enumerate(self.group_data_refs):
            if not refs:
                raise ValueError(f"KV-cache group {g} refers to no tensor")
            seen: set[int] = set()
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(self.tensors):
                    raise ValueError(f"group {g}: tensor_idx={ref.tensor_idx} is out of range")
                if ref.tensor_idx in seen:
                    raise ValueError(f"group {g} refers to tensor {ref.tensor_idx} twice")
                seen.add(ref.tensor_idx)
                page = self.tensors[ref.tensor_idx].page_size_bytes
                if not 0 < ref.page_size_bytes <= page:
                    raise ValueError(
                        f"group {g}: page_size_bytes={ref.page_size_bytes} must be in "
                        f"(0, {page}] for tensor {ref.tensor_idx}"
                    )

    @property
    def num_groups(self) -> int:
        return len(self.group_data_refs)

    @property
    def device_index(self) -> int | None:
        """The CUDA device ordinal of every tensor, or None for host memory (torch copy path)."""
        return self.tensors[0].device_index

    @property
    def on_device(self) -> bool:
        """Whether the KV cache is GPU memory (else host memory: the torch copy path)."""
        return self.device_index is not None


def as_block_rows(t: torch.Tensor) -> torch.Tensor:
    """View ``t`` (dim 0 = blocks) as int8 ``(t.shape[0], bytes per block)``, without copying.

    Raises:
        ValueError: the per-block part of ``t`` (dims 1..) is not contiguous.
    """
    if t.dim() < 1 or t.numel() == 0:
        raise ValueError(f"expected a non-empty tensor with a block dimension, got {t.shape}")
    per_block = t[0] if t.dim() > 1 else t[:1]
    if t.dim() > 1 and not per_block.is_contiguous():
        raise ValueError(f"the per-block part of shape {tuple(t.shape)} is not contiguous")
    nbytes = per_block.numel() * t.element_size() if t.dim() > 1 else t.element_size()
    storage = torch.empty(0, dtype=torch.int8, device=t.device).set_(t.untyped_storage())
    return torch.as_strided(
        storage,
        (t.shape[0], nbytes),
        (t.stride(0) * t.element_size(), 1),
        t.storage_offset() * t.element_size(),
    )


def canonicalize_layer(t: torch.Tensor, layout: KVCacheLayout) -> list[torch.Tensor]:
    """The canonical int8 views of one KV-cache tensor in ``layout`` (see the module docstring).

    Raises:
        ValueError: the tensor does not have the layout's shape or contiguity.
    """
    if layout is KVCacheLayout.KV_FIRST:
        if t.dim() < 2 or t.shape[0] != 2:
            raise ValueError(f"KV_FIRST expects [2, num_blocks, ...], got {tuple(t.shape)}")
        return [as_block_rows(t[0]), as_block_rows(t[1])]
    if layout is KVCacheLayout.BLOCKS_FIRST:
        if t.dim() < 2 or t.shape[1] != 2:
            raise ValueError(f"BLOCKS_FIRST expects [num_blocks, 2, ...], got {tuple(t.shape)}")
        return [as_block_rows(t)]
    return [as_block_rows(t)]


def build_canonical_kv_caches(
    kv_caches: Sequence[torch.Tensor],
    layout: KVCacheLayout,
    layer_groups: Sequence[Sequence[int]] | None = None,
    group_page_bytes: Sequence[int | None] | None = None,
) -> CanonicalKVCaches:
    """Canonicalise a worker's KV-cache tensors.

    Args:
        kv_caches: per-layer tensors (``KV_FIRST`` / ``BLOCKS_FIRST``), or exactly one tensor for
            ``CROSS_LAYER``. Layers aliasing the same memory must be passed once.
        layout: the layout of ``kv_caches``.
        layer_groups: ``layer_groups[g]`` = indices (into ``kv_caches``) of group ``g``'s layers;
            default: one group with every layer. Ignored for ``CROSS_LAYER`` except for its
            length (every group uses the single tensor).
        group_page_bytes: per group, the unpadded bytes of each canonical page it uses (None:
            the whole page).

    Raises:
        ValueError: shapes or groups that do not fit ``layout``.
    """
    if layout is KVCacheLayout.CROSS_LAYER and len(kv_caches) != 1:
        raise ValueError(f"CROSS_LAYER expects exactly one tensor, got {len(kv_caches)}")
    groups = (
        [list(range(len(kv_caches)))]
        if layer_groups is None
        else [list(layers) for layers in layer_groups]
    )
    if group_page_bytes is not None and len(group_page_bytes) != len(groups):
        raise ValueError(
            f"group_page_bytes needs {len(groups)} entries, got {len(group_page_bytes)}"
        )
    views: list[torch.Tensor] = []
    per_layer: list[list[int]] = []
    for t in kv_caches:
        layer_views = canonicalize_layer(t, layout)
        per_layer.append(list(range(len(views), len(views) + len(layer_views))))
        views += layer_views
    tensors = tuple(CanonicalKVCacheTensor.from_tensor(v) for v in views)
    refs: list[tuple[CanonicalKVCacheRef, ...]] = []
    for g, layers in enumerate(groups):
        if layout is KVCacheLayout.CROSS_LAYER:
            layers = [0]
        wanted = None if group_page_bytes is None else group_page_bytes[g]
        group_refs = []
        for layer in layers:
            if not 0 <= layer < len(kv_caches):
                raise ValueError(f"group {g}: layer {layer} is out of range")
            for idx in per_layer[layer]:
                page = tensors[idx].page_size_bytes
                group_refs.append(CanonicalKVCacheRef(idx, page if wanted is None else wanted))
        refs.append(tuple(group_refs))
    return CanonicalKVCaches(tensors, tuple(refs))
