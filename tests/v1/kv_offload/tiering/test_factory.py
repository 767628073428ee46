# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``SecondaryTierFactory``: registry, lazy import, out-of-tree tiers, clear errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.v1.kv_offload.tiering.test_manager import MinimalTier, make_spec
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.config import SecondaryTierConfig
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TierJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory


class OutOfTreeTier(MinimalTier):
    """A tier living outside the package, selected as ``module:ClassName``, with an option of
    its own."""

    def __init__(self, *args: Any, color: str = "blue", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.color = color


class NotATier:
    pass


OUT_OF_TREE = f"{__name__}:OutOfTreeTier"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[memoryview, Any]]:
    region = SharedOffloadRegion("factory", 2, 16, directory=tmp_path, prefault=False)
    view = region.create_kv_memoryview()
    yield view, make_spec(tmp_path)
    region.cleanup()


def test_registered_types() -> None:
    assert {"example", "fs"} <= set(SecondaryTierFactory.known_tier_types())
    assert SecondaryTierFactory.get_tier_class("example") is ExampleSecondaryTierManager


def test_fs_type_resolves_to_the_filesystem_tier() -> None:
    cls = SecondaryTierFactory.get_tier_class("fs")
    assert cls.__name__ == "FileSystemSecondaryTier"
    assert cls.__module__ == "vllm.v1.kv_offload.tiering.fs.manager"


def test_create_from_dict_and_config(env: tuple[memoryview, Any]) -> None:
    view, spec = env
    raw = {"type": "example", "capacity_blocks": 4}
    tier = SecondaryTierFactory.create_secondary_tier(raw, view, spec)
    assert isinstance(tier, ExampleSecondaryTierManager)
    assert tier.tier_type == "example"
    assert raw == {"type": "example", "capacity_blocks": 4}, "the config dict was modified"
    tier2 = SecondaryTierFactory.create_secondary_tier(
        SecondaryTierConfig("example", {"capacity_blocks": 2}), view, spec
    )
    assert isinstance(tier2, ExampleSecondaryTierManager)
    for i in range(3):  # the argument reached the tier: it keeps 2 blocks
        tier2.submit_store(TierJob(i, [bytes([i]) * 8], np.array([0]), False, ReqContext("r")))
    assert tier2.get_num_blocks() == 2
    tier.shutdown()
    tier2.shutdown()


def test_out_of_tree_tier(env: tuple[memoryview, Any]) -> None:
    view, spec = env
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": OUT_OF_TREE, "color": "red"}, view, spec
    )
    assert isinstance(tier, OutOfTreeTier)
    assert tier.color == "red" and tier.tier_type == OUT_OF_TREE


def test_missing_type(env: tuple[memoryview, Any]) -> None:
    view, spec = env
    with pytest.raises(ValueError, match=r"'type'.*known types.*example"):
        SecondaryTierFactory.create_secondary_tier({"root_dir": "/x"}, view, spec)
    with pytest.raises(ValueError, match="'type'"):
        SecondaryTierFactory.create_secondary_tier({"type": ""}, view, spec)


def test_unknown_type_lists_known_ones(env: tuple[memoryview, Any]) -> None:
    view, spec = env
    with pytest.raises(ValueError, match=r"unknown secondary tier type 'nope'.*'example'.*'fs'"):
        SecondaryTierFactory.create_secondary_tier({"type": "nope"}, view, spec)


def test_bad_kwargs_name_the_tier(env: tuple[memoryview, Any]) -> None:
    view, spec = env
    with pytest.raises(ValueError, match=r"secondary tier 'example'.*bogus"):
        SecondaryTierFactory.create_secondary_tier({"type": "example", "bogus": 1}, view, spec)
    # A tier forwarding **kwargs to the base class: the base rejects the leftovers.
    with pytest.raises(ValueError, match=r"secondary tier '.*OutOfTreeTier'.*'bogus'"):
        SecondaryTierFactory.create_secondary_tier({"type": OUT_OF_TREE, "bogus": 1}, view, spec)


def test_tier_validation_errors_propagate(env: tuple[memoryview, Any]) -> None:
    view, spec = env
    with pytest.raises(ValueError, match="capacity_blocks"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "example", "capacity_blocks": 0}, view, spec
        )


@pytest.mark.parametrize(
    ("tier_type", "message"),
    [
        ("no_such_pkg.tiers:Tier", "cannot import module 'no_such_pkg.tiers'"),
        (f"{__name__}:Missing", "has no attribute 'Missing'"),
        (f"{__name__}:NotATier", "not a subclass of SecondaryTierManager"),
    ],
)
def test_bad_out_of_tree_paths(tier_type: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SecondaryTierFactory.get_tier_class(tier_type)


def test_register_tier_rejects_duplicates_and_bad_names() -> None:
    with pytest.raises(ValueError, match="already registered"):
        SecondaryTierFactory.register_tier("example", "x", "Y")
    with pytest.raises(ValueError, match="invalid"):
        SecondaryTierFactory.register_tier("a:b", "x", "Y")


def test_registered_tiers_import_lazily() -> None:
    SecondaryTierFactory.register_tier("lazy_test_tier", "no_such_module_xyz", "Tier")
    try:
        # Registering imported nothing; resolving does, and fails clearly.
        with pytest.raises(ValueError, match="no_such_module_xyz"):
            SecondaryTierFactory.get_tier_class("lazy_test_tier")
    finally:
        # private: the registry has no unregister (a tier type stays for the process): undo the
        # test's registration.
        del SecondaryTierFactory._registry["lazy_test_tier"]
