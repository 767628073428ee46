# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the cache-policy factory: built-ins, registration and out-of-tree module paths."""

from __future__ import annotations

from collections.abc import Collection, Iterator

import pytest
from typing_extensions import override

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies import factory
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy
from vllm.v1.kv_offload.cpu.policies.factory import (
    create_cache_policy,
    load_cache_policy_class,
    register_cache_policy,
    registered_cache_policies,
)
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

THIS_MODULE = __name__


class FIFOTestPolicy(CachePolicy):
    """Out-of-tree test policy: first in, first out; ignores the evictability hooks.

    Deliberately naive (evict scans everything): it only has to be obviously right.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.blocks: dict[OffloadKey, BlockStatus] = {}

    @override
    def get(self, key: OffloadKey) -> BlockStatus | None:
        return self.blocks.get(key)

    @override
    def insert(self, key: OffloadKey, block: BlockStatus) -> None:
        self.blocks[key] = block

    @override
    def remove(self, key: OffloadKey) -> None:
        del self.blocks[key]

    @override
    def touch(self, keys: Collection[OffloadKey]) -> None:
        pass

    @override
    def evict(
        self, n: int, protected: Collection[OffloadKey]
    ) -> list[tuple[OffloadKey, BlockStatus]] | None:
        victims = [
            (key, block)
            for key, block in self.blocks.items()
            if block.ref_cnt == 0 and key not in protected
        ][:n]
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self.blocks[key]
        return victims

    @override
    def clear(self) -> None:
        self.blocks.clear()

    @override
    def items(self) -> Iterator[tuple[OffloadKey, BlockStatus]]:
        return iter(list(self.blocks.items()))

    @override
    def __len__(self) -> int:
        return len(self.blocks)


class NotAPolicy:
    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity


NOT_A_CLASS = 42


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give each test its own copy of the registry so registrations do not leak."""
    # private: the registry has no unregister: the test registers into a copy it throws away.
    monkeypatch.setattr(factory, "_CACHE_POLICIES", dict(factory._CACHE_POLICIES))


def test_builtins() -> None:
    assert registered_cache_policies() == ["arc", "lru"]
    lru = create_cache_policy("lru", 16)
    arc = create_cache_policy("arc", 16)
    assert type(lru) is LRUCachePolicy
    assert type(arc) is ARCCachePolicy
    assert lru.cache_capacity == 16 and arc.cache_capacity == 16


def test_capacity_is_validated() -> None:
    with pytest.raises(ValueError, match="cache_capacity"):
        create_cache_policy("lru", 0)


def test_out_of_tree_module_path() -> None:
    policy = create_cache_policy(f"{THIS_MODULE}:FIFOTestPolicy", 4)
    assert type(policy) is FIFOTestPolicy
    assert load_cache_policy_class(f"{THIS_MODULE}:FIFOTestPolicy") is FIFOTestPolicy


def test_out_of_tree_policy_drives_the_manager() -> None:
    ctx = ReqContext("r")
    keys = [make_offload_key(bytes([i + 1]), 0) for i in range(4)]
    manager = CPUOffloadingManager(2, cache_policy=f"{THIS_MODULE}:FIFOTestPolicy")
    out = manager.prepare_store(keys[:2], ctx)
    assert out is not None and out.keys_to_store == keys[:2]
    manager.complete_store(keys[:2], ctx)
    manager.prepare_load(keys[:1], ctx)  # pins keys[0]: FIFO must skip it
    out = manager.prepare_store(keys[2:3], ctx)
    assert out is not None and out.evicted_keys == [keys[1]]
    assert manager.prepare_store(keys[3:], ctx) is None  # keys[0] pinned, keys[2] in flight


def test_registered_name() -> None:
    register_cache_policy("fifo-test", THIS_MODULE, "FIFOTestPolicy")
    assert "fifo-test" in registered_cache_policies()
    assert type(create_cache_policy("fifo-test", 3)) is FIFOTestPolicy


def test_registration_is_lazy() -> None:
    register_cache_policy("lazy", "no_such_package_for_tests.policies", "Whatever")
    with pytest.raises(ValueError, match="cannot import module 'no_such_package_for_tests"):
        create_cache_policy("lazy", 3)


def test_duplicate_registration() -> None:
    register_cache_policy("fifo-test", THIS_MODULE, "FIFOTestPolicy")
    with pytest.raises(ValueError, match="'fifo-test' is already registered"):
        register_cache_policy("fifo-test", THIS_MODULE, "FIFOTestPolicy")
    with pytest.raises(ValueError, match="'lru' is already registered"):
        register_cache_policy("lru", THIS_MODULE, "FIFOTestPolicy")


@pytest.mark.parametrize(
    ("name", "module_path", "class_name"),
    [("", "m", "C"), ("a:b", "m", "C"), ("x", "", "C"), ("x", "m", "")],
)
def test_invalid_registration(name: str, module_path: str, class_name: str) -> None:
    with pytest.raises(ValueError, match="cache policy"):
        register_cache_policy(name, module_path, class_name)


def test_unknown_name_lists_known_names_and_module_form() -> None:
    with pytest.raises(ValueError) as info:
        create_cache_policy("mru", 8)
    message = str(info.value)
    assert "'mru'" in message
    assert "['arc', 'lru']" in message
    assert "package.module:ClassName" in message


@pytest.mark.parametrize("name", [":Cls", "module:", ":"])
def test_incomplete_module_path_is_unknown(name: str) -> None:
    with pytest.raises(ValueError, match="unknown cache policy"):
        create_cache_policy(name, 8)


def test_missing_class() -> None:
    with pytest.raises(ValueError, match="has no attribute 'NoSuchPolicy'"):
        create_cache_policy(f"{THIS_MODULE}:NoSuchPolicy", 8)


@pytest.mark.parametrize("attr", ["NotAPolicy", "NOT_A_CLASS", "BlockStatus"])
def test_not_a_cache_policy_subclass(attr: str) -> None:
    with pytest.raises(TypeError, match=r"not a subclass of .*CachePolicy"):
        create_cache_policy(f"{THIS_MODULE}:{attr}", 8)


def test_manager_rejects_unknown_policy() -> None:
    with pytest.raises(ValueError, match="unknown cache policy 'nope'"):
        CPUOffloadingManager(8, cache_policy="nope")
