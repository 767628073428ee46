# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the canonical KV-cache description used by the transfer handlers."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.kv_offload.worker.canonical import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    KVCacheLayout,
    as_block_rows,
    build_canonical_kv_caches,
    canonicalize_layer,
)

NB, T, H, D = 6, 4, 2, 8


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8).flatten()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_kv_first_splits_planes_into_block_rows(dtype: torch.dtype) -> None:
    t = torch.arange(2 * NB * T * H * D).to(dtype).view(2, NB, T, H, D)
    k, v = canonicalize_layer(t, KVCacheLayout.KV_FIRST)
    page = T * H * D * t.element_size()
    assert k.shape == v.shape == (NB, page) and k.stride() == (page, 1)
    for b in range(NB):
        assert torch.equal(k[b], _bytes(t[0, b])) and torch.equal(v[b], _bytes(t[1, b]))
    k[2].fill_(0)  # a view, not a copy
    assert not t[0, 2].any()


def test_blocks_first_and_cross_layer_are_one_tensor() -> None:
    t = torch.randn(NB, 2, T, H, D, dtype=torch.float16)
    [rows] = canonicalize_layer(t, KVCacheLayout.BLOCKS_FIRST)
    assert rows.shape == (NB, 2 * T * H * D * 2)
    assert torch.equal(rows[3], _bytes(t[3]))
    cross = torch.randn(NB, 5, 2, T, H, D, dtype=torch.bfloat16)
    kv = build_canonical_kv_caches([cross], KVCacheLayout.CROSS_LAYER, [[0], [0]])
    assert len(kv.tensors) == 1 and kv.num_groups == 2
    assert kv.tensors[0].page_size_bytes == 5 * 2 * T * H * D * 2
    assert kv.group_data_refs[1] == (CanonicalKVCacheRef(0, kv.tensors[0].page_size_bytes),)


def test_strided_block_dimension_is_kept() -> None:
    # Blocks that are not adjacent in memory (a slice of a larger pool) keep their stride.
    pool = torch.randn(2 * NB, 2, T, H, D)
    t = pool[::2]
    [rows] = canonicalize_layer(t, KVCacheLayout.BLOCKS_FIRST)
    assert rows.stride(0) == 2 * rows.shape[1]
    assert torch.equal(rows[4], _bytes(pool[8]))


def test_layouts_and_contiguity_are_checked() -> None:
    with pytest.raises(ValueError, match="KV_FIRST"):
        canonicalize_layer(torch.zeros(NB, 2, T), KVCacheLayout.KV_FIRST)
    with pytest.raises(ValueError, match="BLOCKS_FIRST"):
        canonicalize_layer(torch.zeros(2, NB, T), KVCacheLayout.BLOCKS_FIRST)
    with pytest.raises(ValueError, match="not contiguous"):
        as_block_rows(torch.zeros(NB, T, H).transpose(1, 2))
    with pytest.raises(ValueError, match="exactly one"):
        build_canonical_kv_caches([torch.zeros(NB, 4)] * 2, KVCacheLayout.CROSS_LAYER)


def test_groups_and_unpadded_pages() -> None:
    layers = [torch.zeros(2, NB, T, H, D, dtype=torch.float16) for _ in range(3)]
    kv = build_canonical_kv_caches(layers, KVCacheLayout.KV_FIRST, [[0, 2], [1]], [None, 100])
    assert len(kv.tensors) == 6
    assert [r.tensor_idx for r in kv.group_data_refs[0]] == [0, 1, 4, 5]
    assert [(r.tensor_idx, r.page_size_bytes) for r in kv.group_data_refs[1]] == [
        (2, 100),
        (3, 100),
    ]
    assert not kv.on_device and kv.device_index is None
    with pytest.raises(ValueError, match="page_size_bytes"):
        build_canonical_kv_caches(layers, KVCacheLayout.KV_FIRST, [[0]], [10**6])
    with pytest.raises(ValueError, match="out of range"):
        build_canonical_kv_caches(layers, KVCacheLayout.KV_FIRST, [[3]])


def test_canonical_caches_validate_tensors_and_refs() -> None:
    a = CanonicalKVCacheTensor(0x1000, 4, 64, 64, device_index=None)
    b = CanonicalKVCacheTensor(0x1000 + 200, 4, 64, 64, device_index=None)
    c = CanonicalKVCacheTensor(0x9000, 4, 64, 64, device_index=0)
    d = CanonicalKVCacheTensor(0x20000, 4, 64, 64, device_index=1)
    ok = CanonicalKVCaches((a,), ((CanonicalKVCacheRef(0, 64),),))
    assert ok.num_groups == 1
    with pytest.raises(ValueError, match="overlap"):
        CanonicalKVCaches((a, b), ((CanonicalKVCacheRef(0, 64),),))
    with pytest.raises(
        ValueError, match=r"one device or all on the host, got \['cuda:0', 'host'\]"
    ):
        CanonicalKVCaches((a, c), ((CanonicalKVCacheRef(0, 64),),))
    with pytest.raises(ValueError, match=r"got \['cuda:0', 'cuda:1'\]"):
        CanonicalKVCaches((c, d), ((CanonicalKVCacheRef(0, 64),),))
    on_gpu = CanonicalKVCaches((c,), ((CanonicalKVCacheRef(0, 64),),))
    assert on_gpu.device_index == 0 and on_gpu.on_device and "cuda:0" in repr(c)
    with pytest.raises(ValueError, match="device_index"):
        CanonicalKVCacheTensor(0x9000, 4, 64, 64, device_index=-1)
    with pytest.raises(ValueError, match="out of range"):
        CanonicalKVCaches((a,), ((CanonicalKVCacheRef(1, 64),),))
    with pytest.raises(ValueError, match="twice"):
        CanonicalKVCaches((a,), ((CanonicalKVCacheRef(0, 64), CanonicalKVCacheRef(0, 32)),))
    with pytest.raises(ValueError, match="no tensor"):
        CanonicalKVCaches((a,), ((),))
    with pytest.raises(ValueError, match="overlap"):
        CanonicalKVCacheTensor(0x1000, 4, 64, 32, device_index=None)
    with pytest.raises(ValueError, match="int8"):
        CanonicalKVCacheTensor.from_tensor(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="CPU or CUDA"):
        CanonicalKVCacheTensor.from_tensor(torch.zeros(4, 4, dtype=torch.int8, device="meta"))
