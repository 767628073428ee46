# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The one size parser, and every place that takes a size agreeing with it."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from vllm.entrypoints.cli.option_values import parse_size as parse_size_flag
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.sizes import SIZE_FORMS, SizeError, parse_size
from vllm.v1.kv_offload.tiering.fs.config import FsTierConfig

ACCEPTED: list[tuple[Any, int]] = [
    (4096, 4096),
    ("4096", 4096),
    (4e9, 4 * 10**9),
    ("4e9", 4 * 10**9),
    ("8GB", 8 * 10**9),
    ("500MB", 500 * 10**6),
    ("2 kb", 2000),
    ("64MiB", 64 * 2**20),
    ("64 gib", 64 * 2**30),
    ("1T", 2**40),
    ("64M", 64 * 2**20),
    ("1.5GiB", 3 * 2**29),
    ("0.5KiB", 512),
    ("7B", 7),
    (2**62 + 1, 2**62 + 1),
    ("9007199254740993", 2**53 + 1),  # exact: a float would round it
    (2**63 - 1, 2**63 - 1),
]
REFUSED: list[Any] = [
    0,
    "0",
    -1,
    "-5",
    True,
    1.5,
    "1.3B",
    "12XB",
    "12 parsecs",
    "",
    "abc",
    "1e400",
    2**63,
    "8EiB",
    float("nan"),
    float("inf"),
    None,
    [1],
]


@pytest.mark.parametrize(("value", "expected"), ACCEPTED)
def test_accepted_forms(value: Any, expected: int) -> None:
    assert parse_size(value) == expected
    assert type(parse_size(value)) is int


@pytest.mark.parametrize("value", REFUSED)
def test_refused_values_quote_the_value_and_the_forms(value: Any) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert repr(value) in str(info.value) and SIZE_FORMS in str(info.value)


def test_zero_only_where_allowed() -> None:
    assert parse_size(0, allow_zero=True) == parse_size("0 GiB", allow_zero=True) == 0
    with pytest.raises(SizeError, match="at least 1"):
        parse_size("0GiB")
    with pytest.raises(SizeError, match="at least 0"):
        parse_size(-1, allow_zero=True)


def _cpu_bytes(value: Any) -> int:
    return OffloadingConfig.from_extra_config({"cpu_bytes_to_use": value}).cpu_bytes_to_use


def _fs_max_bytes(value: Any) -> int:
    max_bytes = FsTierConfig.from_kwargs(root_dir="/tmp", max_bytes=value).max_bytes
    assert max_bytes is not None
    return max_bytes


@pytest.mark.parametrize(("value", "expected"), ACCEPTED)
def test_config_keys_and_flags_accept_the_same_forms(value: Any, expected: int) -> None:
    assert _cpu_bytes(value) == _fs_max_bytes(value) == expected
    # A flag is always text.
    assert parse_size_flag(str(value) if not isinstance(value, float) else repr(value)) == expected


@pytest.mark.parametrize("value", REFUSED)
def test_config_keys_and_flags_refuse_the_same_values(value: Any) -> None:
    with pytest.raises(ValueError, match="cpu_bytes_to_use"):
        _cpu_bytes(value)
    if value is not None:  # max_bytes=None is the fs tier's "no bound"
        with pytest.raises(ValueError, match="max_bytes"):
            _fs_max_bytes(value)
    if isinstance(value, str):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
            parse_size_flag(value)
