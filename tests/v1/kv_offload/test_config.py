# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``kv_connector_extra_config`` parsing: defaults, valid forms and clear errors."""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.config import (
    OffloadingConfig,
    SecondaryTierConfig,
    parse_offloading_config,
)
from vllm.v1.kv_offload.sizes import SIZE_FORMS

ALL_KEYS = (
    "cpu_bytes_to_use",
    "block_size",
    "eviction_policy",
    "spec_name",
    "spec_module_path",
    "secondary_tiers",
    "shared_region_dir",
    "shared_region_join_timeout_s",
    "offload_prompt_only",
    "store_threshold",
    "max_tracker_size",
    "copy_dma_min_chunk_bytes",
    "load_guard",
)


def _parse(**extra: Any) -> OffloadingConfig:
    return OffloadingConfig.from_extra_config({"cpu_bytes_to_use": 1 << 30, **extra})


def _bad(key: str, value: Any, allowed: str, **extra: Any) -> None:
    """Parsing ``key=value`` fails with a message naming the key, the value and ``allowed``."""
    with pytest.raises(ValueError) as info:
        _parse(**{key: value}, **extra)
    message = str(info.value)
    assert repr(key) in message, message
    assert repr(value) in message, message
    assert allowed in message, message


def test_defaults() -> None:
    cfg = OffloadingConfig.from_extra_config({"cpu_bytes_to_use": 4096})
    assert cfg == OffloadingConfig(
        cpu_bytes_to_use=4096,
        block_size=None,
        eviction_policy="lru",
        spec_name="CPUOffloadingSpec",
        spec_module_path=None,
        secondary_tiers=(),
        shared_region_dir="/dev/shm",
        shared_region_join_timeout_s=30.0,
        offload_prompt_only=False,
        store_threshold=0,
        max_tracker_size=64_000,
        copy_dma_min_chunk_bytes=(1 << 20, 1 << 20),
        load_guard=True,
    )
    assert OffloadingConfig.allowed_keys() == ALL_KEYS
    assert parse_offloading_config({"cpu_bytes_to_use": 4096}) == cfg


def test_frozen() -> None:
    cfg = _parse()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cpu_bytes_to_use = 1  # type: ignore[misc]


def test_full_valid_config() -> None:
    extra = {
        "cpu_bytes_to_use": 4e9,
        "block_size": 64,
        "eviction_policy": "arc",
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [
            {"type": "fs", "root_dir": "/mnt/kv", "n_read_threads": 4},
            {"type": "example", "custom_param": {"nested": [1, 2]}},
        ],
        "shared_region_dir": "/tmp/regions",
        "shared_region_join_timeout_s": 5,
        "offload_prompt_only": True,
    }
    cfg = OffloadingConfig.from_extra_config(extra)
    assert cfg.cpu_bytes_to_use == 4_000_000_000
    assert type(cfg.cpu_bytes_to_use) is int
    assert cfg.block_size == 64
    assert cfg.eviction_policy == "arc"
    assert cfg.spec_name == "TieringOffloadingSpec"
    assert cfg.shared_region_dir == "/tmp/regions"
    assert cfg.shared_region_join_timeout_s == 5.0
    assert type(cfg.shared_region_join_timeout_s) is float
    assert cfg.offload_prompt_only is True
    assert cfg.secondary_tiers == (
        SecondaryTierConfig("fs", {"root_dir": "/mnt/kv", "n_read_threads": 4}),
        SecondaryTierConfig("example", {"custom_param": {"nested": [1, 2]}}),
    )
    assert cfg.secondary_tiers[0].to_dict() == extra["secondary_tiers"][0]  # type: ignore[index]


def test_secondary_tiers_are_isolated_and_immutable() -> None:
    tiers: list[dict[str, Any]] = [{"type": "example", "custom_param": {"nested": [1]}}]
    cfg = _parse(secondary_tiers=tiers)
    # Later mutation of the input does not leak in.
    tiers[0]["custom_param"]["nested"].append(2)
    tiers[0]["extra"] = 1
    tier = cfg.secondary_tiers[0]
    assert dict(tier.kwargs) == {"custom_param": {"nested": [1]}}
    with pytest.raises(TypeError):
        tier.kwargs["x"] = 1  # type: ignore[index]
    # to_dict hands out a fresh copy each time.
    copy = tier.to_dict()
    copy["custom_param"]["nested"].append(3)
    assert tier.to_dict() == {"type": "example", "custom_param": {"nested": [1]}}
    assert isinstance(cfg.secondary_tiers, tuple)


def test_tuple_of_tiers_and_empty_list() -> None:
    assert _parse(secondary_tiers=()).secondary_tiers == ()
    assert _parse(secondary_tiers=[]).secondary_tiers == ()
    assert _parse(secondary_tiers=({"type": "fs"},)).secondary_tiers == (SecondaryTierConfig("fs"),)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1),
        (4096, 4096),
        (4e9, 4 * 10**9),
        (2.0**40, 2**40),
        (10**15, 10**15),
        (2**60 + 1, 2**60 + 1),  # kept exact, not rounded through a float
        # The forms of the one size parser, as the fs tier's max_bytes and the CLI take them.
        ("8GB", 8 * 10**9),
        ("20GiB", 20 * 2**30),
        ("4e9", 4 * 10**9),
        ("1.5 KiB", 1536),
        ("64M", 64 * 2**20),
    ],
)
def test_cpu_bytes_valid(value: Any, expected: int) -> None:
    cfg = OffloadingConfig.from_extra_config({"cpu_bytes_to_use": value})
    assert cfg.cpu_bytes_to_use == expected
    assert type(cfg.cpu_bytes_to_use) is int


@pytest.mark.parametrize(
    "value",
    [0, -1, 0.0, 4.5, True, False, "0", "1.3B", "8 parsecs", "", None, float("nan"), [1]],
)
def test_cpu_bytes_invalid(value: Any) -> None:
    _bad("cpu_bytes_to_use", value, SIZE_FORMS)


def test_cpu_bytes_required() -> None:
    for extra in ({}, None, {"block_size": 16}):
        with pytest.raises(ValueError, match=r"missing required key 'cpu_bytes_to_use'.*64MiB"):
            OffloadingConfig.from_extra_config(extra)


@pytest.mark.parametrize("value", [1, 16, 256, 32.0, None])
def test_block_size_valid(value: Any) -> None:
    assert _parse(block_size=value).block_size == value


@pytest.mark.parametrize("value", [0, -16, 1.5, True, "16"])
def test_block_size_invalid(value: Any) -> None:
    _bad("block_size", value, "an integer > 0")


@pytest.mark.parametrize(
    "value", ["lru", "arc", "my_pkg.policies:MyPolicy", "mod:Cls", "a.b.c:_Private"]
)
def test_eviction_policy_valid(value: str) -> None:
    assert _parse(eviction_policy=value).eviction_policy == value


@pytest.mark.parametrize(
    "value",
    ["LRU", "fifo", "", "pkg.mod", "pkg.mod:", ":Cls", "pkg..mod:Cls", "pkg.mod:Cls.Inner", 1],
)
def test_eviction_policy_invalid(value: Any) -> None:
    _bad("eviction_policy", value, "one of ['lru', 'arc'] or an out-of-tree policy")


def test_spec_name_builtin_and_custom() -> None:
    assert _parse(spec_name="CPUOffloadingSpec").spec_module_path is None
    cfg = _parse(spec_name="MySpec", spec_module_path="my_pkg.specs")
    assert (cfg.spec_name, cfg.spec_module_path) == ("MySpec", "my_pkg.specs")
    # A module path may also point at a builtin name's replacement.
    assert _parse(spec_name="CPUOffloadingSpec", spec_module_path="x").spec_module_path == "x"


def test_spec_name_unknown_without_module_path() -> None:
    _bad("spec_name", "MySpec", "or any class name when 'spec_module_path' is given")


@pytest.mark.parametrize("value", ["", "my.Spec", "1Spec", None, 3])
def test_spec_name_invalid_syntax(value: Any) -> None:
    allowed = "one of ['CPUOffloadingSpec', 'TieringOffloadingSpec']"
    _bad("spec_name", value, allowed, spec_module_path="pkg")


@pytest.mark.parametrize("value", ["", "pkg/mod", "pkg.", "pkg mod", 3, ["pkg"]])
def test_spec_module_path_invalid(value: Any) -> None:
    _bad("spec_module_path", value, "a dotted module path")


@pytest.mark.parametrize(
    ("value", "bad_key", "bad_value"),
    [
        ("fs", "secondary_tiers", "fs"),
        ({"type": "fs"}, "secondary_tiers", {"type": "fs"}),
        (None, "secondary_tiers", None),
        (["fs"], "secondary_tiers[0]", "fs"),
        ([{"type": "fs"}, {"root_dir": "/x"}], "secondary_tiers[1]", {"root_dir": "/x"}),
        ([{"type": ""}], "secondary_tiers[0]", {"type": ""}),
        ([{"type": 3}], "secondary_tiers[0]", {"type": 3}),
    ],
)
def test_secondary_tiers_invalid(value: Any, bad_key: str, bad_value: Any) -> None:
    with pytest.raises(ValueError) as info:
        _parse(secondary_tiers=value)
    message = str(info.value)
    assert f"[{bad_key!r}]={bad_value!r}" in message, message
    assert "a list of dicts, each with a non-empty string 'type' key" in message


def test_secondary_tier_config_direct() -> None:
    with pytest.raises(ValueError, match="'type' must be a non-empty string"):
        SecondaryTierConfig("")
    with pytest.raises(ValueError, match="must not contain 'type'"):
        SecondaryTierConfig("fs", {"type": "obj"})


def test_shared_region_dir_pathlike(tmp_path: Path) -> None:
    assert _parse(shared_region_dir=tmp_path).shared_region_dir == str(tmp_path)


@pytest.mark.parametrize("value", ["", None, 3])
def test_shared_region_dir_invalid(value: Any) -> None:
    _bad("shared_region_dir", value, "a non-empty directory path")


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "30"])
def test_join_timeout_invalid(value: Any) -> None:
    _bad("shared_region_join_timeout_s", value, "a finite number of seconds > 0")


@pytest.mark.parametrize("value", [1, "false", None])
def test_load_guard_invalid(value: Any) -> None:
    _bad("load_guard", value, "true or false")


@pytest.mark.parametrize("value", [1, 0, "true", None])
def test_offload_prompt_only_invalid(value: Any) -> None:
    _bad("offload_prompt_only", value, "true or false")


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (1, 1), (2, 2), (3.0, 3)])
def test_store_threshold_valid(value: Any, expected: int) -> None:
    cfg = _parse(store_threshold=value, max_tracker_size=1e3)
    assert cfg.store_threshold == expected and type(cfg.store_threshold) is int
    assert cfg.max_tracker_size == 1000 and type(cfg.max_tracker_size) is int


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None, float("inf")])
def test_store_threshold_invalid(value: Any) -> None:
    _bad("store_threshold", value, "an integer >= 0")


@pytest.mark.parametrize("value", [0, -5, 2.5, False, "64000", None])
def test_max_tracker_size_invalid(value: Any) -> None:
    _bad("max_tracker_size", value, "an integer > 0")


def test_unknown_key_with_suggestion() -> None:
    with pytest.raises(ValueError) as info:
        _parse(eviction_polcy="lru")
    message = str(info.value)
    assert "unknown key(s) 'eviction_polcy' (did you mean 'eviction_policy'?)" in message
    assert "allowed keys: " + ", ".join(ALL_KEYS) in message


def test_unknown_keys_without_suggestion() -> None:
    with pytest.raises(ValueError) as info:
        extra: dict[Any, Any] = {"cpu_bytes_to_use": 1, "zzz": 1, 7: 2}
        OffloadingConfig.from_extra_config(extra)
    message = str(info.value)
    assert "unknown key(s) 'zzz', 7;" in message
    assert "did you mean" not in message
    assert "cpu_bytes_to_use, block_size" in message


@pytest.mark.parametrize("value", [["cpu_bytes_to_use"], "cpu_bytes_to_use=1", 3])
def test_non_mapping_input(value: Any) -> None:
    expected = f"must be a mapping (a JSON object), got {type(value).__name__}"
    with pytest.raises(TypeError, match=re.escape(expected)):
        OffloadingConfig.from_extra_config(value)


def test_any_mapping_accepted() -> None:
    cfg = OffloadingConfig.from_extra_config(OrderedDict(cpu_bytes_to_use=8, block_size=16))
    assert (cfg.cpu_bytes_to_use, cfg.block_size) == (8, 16)


def test_direct_construction_validates() -> None:
    with pytest.raises(ValueError, match=r"\['eviction_policy'\]='fifo'"):
        OffloadingConfig(cpu_bytes_to_use=1, eviction_policy="fifo")
    cfg = OffloadingConfig(cpu_bytes_to_use=2e3, secondary_tiers=[{"type": "fs"}])  # type: ignore[arg-type]
    assert cfg.cpu_bytes_to_use == 2000
    assert cfg.secondary_tiers == (SecondaryTierConfig("fs"),)
    # The parsed form round-trips through the constructor unchanged.
    assert dataclasses.replace(cfg) == cfg


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("256KiB", (256 << 10, 256 << 10)),
        (0, (0, 0)),
        ({"load": "64KiB"}, (1 << 20, 64 << 10)),
        ({"store": 4096, "load": "2MiB"}, (4096, 2 << 20)),
        ((4096, 8192), (4096, 8192)),
    ],
)
def test_copy_dma_min_chunk_bytes_valid(value: Any, expected: tuple[int, int]) -> None:
    assert _parse(copy_dma_min_chunk_bytes=value).copy_dma_min_chunk_bytes == expected


@pytest.mark.parametrize("value", [-1, "big", True, {}, {"stor": 1}, {"load": "x"}, [1, 2]])
def test_copy_dma_min_chunk_bytes_invalid(value: Any) -> None:
    with pytest.raises(ValueError, match="copy_dma_min_chunk_bytes"):
        _parse(copy_dma_min_chunk_bytes=value)
