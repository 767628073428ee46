# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the core abstractions in vllm/v1/kv_offload/base.py."""

from __future__ import annotations

import inspect
from collections.abc import Collection

import numpy as np
import pytest
from typing_extensions import override

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)


def test_offload_key_round_trip() -> None:
    key = make_offload_key(b"\x01\x02\x03", 7)
    assert key == b"\x01\x02\x03\x00\x00\x00\x07"
    assert get_offload_block_hash(key) == b"\x01\x02\x03"
    assert get_offload_group_idx(key) == 7
    big = make_offload_key(b"h" * 32, 2**32 - 1)
    assert get_offload_group_idx(big) == 2**32 - 1
    assert get_offload_block_hash(big) == b"h" * 32


@pytest.mark.parametrize("group_idx", [-1, 2**32])
def test_offload_key_rejects_out_of_range_group(group_idx: int) -> None:
    with pytest.raises(ValueError, match="group_idx"):
        make_offload_key(b"abc", group_idx)


def test_offload_key_rejects_empty_hash() -> None:
    with pytest.raises(ValueError, match="block_hash"):
        make_offload_key(b"", 0)


def test_req_context_identity_semantics() -> None:
    a = ReqContext("r1")
    b = ReqContext("r1")
    assert a != b and a == a
    assert len({a, b}) == 2
    assert a.kv_transfer_params is None


def test_request_offloading_context_default_policy() -> None:
    assert RequestOffloadingContext().policy is OffloadPolicy.BLOCK_LEVEL
    assert OffloadPolicy("request_level") is OffloadPolicy.REQUEST_LEVEL


class _Spec(BlockIDsLoadStoreSpec):
    @staticmethod
    @override
    def medium() -> str:
        return "TEST"


def test_block_ids_spec_normalises_to_int64() -> None:
    spec = _Spec([3, 1, 2])
    assert spec.block_ids.dtype == np.int64
    assert spec.block_ids.flags.c_contiguous
    assert spec.block_ids.tolist() == [3, 1, 2]
    assert _Spec(np.array([5], dtype=np.int32)).block_ids.dtype == np.int64
    assert _Spec([]).block_ids.shape == (0,)
    assert repr(spec) == "_Spec([3, 1, 2])"


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([[1, 2]], "1-D"),
        ([1.5], "integers"),
        ([True], "integers"),
        ([0, -1], "non-negative"),
        ([*range(100), -1], "non-negative"),  # longer than the Python-min fast path
        ([2**63], "below 2\\*\\*63"),  # a uint64 array: int64 would wrap it negative
        (np.array([2**64 - 1], dtype=np.uint64), "below 2\\*\\*63"),
        ([2**64], "integers"),  # beyond uint64: an object array
    ],
)
def test_block_ids_spec_rejects_bad_ids(ids: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _Spec(ids)  # type: ignore[arg-type]


def test_gpu_spec_validation() -> None:
    spec = GPULoadStoreSpec([4, 5, 6, 7, 8], group_sizes=[3, 2], block_indices=[0, 4])
    assert spec.medium() == "GPU"
    assert spec.group_sizes == (3, 2)
    assert spec.block_indices == (0, 4)
    assert "group_sizes=[3, 2]" in repr(spec)
    with pytest.raises(ValueError, match="sum"):
        GPULoadStoreSpec([1, 2], group_sizes=[3], block_indices=[0])
    with pytest.raises(ValueError, match="one entry per KV-cache group"):
        GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0, 0])
    with pytest.raises(ValueError, match="block_indices must be non-negative"):
        GPULoadStoreSpec([1], group_sizes=[1], block_indices=[-1])
    with pytest.raises(ValueError, match="group_sizes must be non-negative"):
        GPULoadStoreSpec([1], group_sizes=[2, -1], block_indices=[0, 0])


def test_load_store_spec_is_abstract() -> None:
    with pytest.raises(TypeError):
        LoadStoreSpec()  # type: ignore[abstract]


class _MinimalManager(OffloadingManager):
    """Implements only the abstract primitives, so every optional hook is the base default."""

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return False

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return _Spec([])

    @override
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return PrepareStoreOutput([], _Spec([]), [])

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


def test_manager_abstract_primitives() -> None:
    abstract = OffloadingManager.__abstractmethods__
    assert abstract == {"lookup", "prepare_load", "prepare_store", "on_new_request"}


def test_manager_optional_hooks_are_no_ops() -> None:
    manager = _MinimalManager()
    ctx = ReqContext("r")
    key = make_offload_key(b"k", 0)
    assert manager.touch([key], ctx) is None
    assert manager.complete_load([key], ctx) is None
    assert manager.complete_store([key], ctx) is None
    assert manager.complete_store([key], ctx, success=False) is None
    assert manager.on_request_finished(ctx) is None
    assert list(manager.take_events()) == []
    assert manager.on_schedule_end() is None
    assert manager.has_pending_work() is False
    assert manager.reset_cache() is None
    assert manager.get_stats() is None
    assert manager.shutdown() is None


class _ScriptedLookups(_MinimalManager):
    """``lookup`` answers from a script and logs the keys it was asked."""

    def __init__(self, answers: dict[OffloadKey, bool | None]) -> None:
        self.answers = answers
        self.asked: list[OffloadKey] = []

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        self.asked.append(key)
        return self.answers.get(key, False)


def test_lookup_prefix_default_is_lookup_up_to_the_first_false() -> None:
    a, b, c, d = (make_offload_key(bytes([i + 1]), 0) for i in range(4))
    manager = _ScriptedLookups({a: True, b: None, d: True})
    ctx = ReqContext("r")
    assert manager.lookup_prefix([a, b, c, d], ctx) == [True, None, False]
    assert manager.asked == [a, b, c]  # nothing after the first False
    assert manager.lookup_prefix(iter([a, b]), ctx) == [True, None]  # any iterable, read once
    assert manager.lookup_prefix([], ctx) == []
    manager.asked.clear()
    for bad in ([a, "b"], a):
        with pytest.raises(TypeError, match="lookup_prefix"):
            manager.lookup_prefix(bad, ctx)  # type: ignore[arg-type]
    assert manager.asked == []  # refused before any lookup


def test_on_schedule_end_takes_no_arguments() -> None:
    params = inspect.signature(OffloadingManager.on_schedule_end).parameters
    assert list(params) == ["self"]
    assert "only drains" in (OffloadingManager.take_events.__doc__ or "").lower()
