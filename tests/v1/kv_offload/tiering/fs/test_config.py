# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the filesystem tier's config parsing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.tiering.fs.config import FsTierConfig, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        (4e9, 4_000_000_000),
        ("64GiB", 64 << 30),
        ("64 gib", 64 << 30),
        ("500MB", 500_000_000),
        ("1T", 1 << 40),
        ("1.5KiB", 1536),
        ("123", 123),
    ],
)
def test_sizes(value: Any, expected: int) -> None:
    assert parse_size("max_bytes", value) == expected


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "1.3B", "12 parsecs", "", None, [1]])
def test_bad_sizes_name_the_key(value: Any) -> None:
    with pytest.raises(ValueError, match="'max_bytes'"):
        parse_size("max_bytes", value)


def test_zero_is_allowed_where_asked() -> None:
    assert parse_size("min_free_bytes", 0, allow_zero=True) == 0


def test_defaults_and_root_normalisation(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    config = FsTierConfig.from_kwargs(root_dir=tmp_path / "link" / ".." / "link")
    assert config.root_dir == str((tmp_path / "real").resolve())
    threads = min(8, max(2, os.cpu_count() or 2))  # the host's CPUs, from 2 to 8
    assert (config.n_read_threads, config.n_write_threads) == (threads, threads)
    assert config.max_bytes is None and config.min_free_bytes is None
    assert config.o_direct == "auto" and config.enable_events is False
    assert os.path.isabs(FsTierConfig.from_kwargs(root_dir="relative/dir").root_dir)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("reconcile_interval_s", 0),
        ("reconcile_interval_s", float("inf")),
        ("reconcile_interval_s", "1"),
        ("reconcile_batch", 0),
        ("reconcile_batch", 2.0),
        ("max_read_failures", 0),
        ("max_read_failures", True),
        ("stale_tmp_age_s", -1),
    ],
)
def test_reliability_keys_are_validated(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"'{key}'"):
        FsTierConfig.from_kwargs(root_dir="/tmp/x", **{key: value})


def test_reliability_key_defaults() -> None:
    config = FsTierConfig.from_kwargs(root_dir="/tmp/x")
    assert (config.reconcile_interval_s, config.reconcile_batch) == (1.0, 1024)
    assert config.max_read_failures == 3
