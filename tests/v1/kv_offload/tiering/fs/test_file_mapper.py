# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the on-disk layout: run digests, path components, and that no key escapes the root."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath, FileMapper
from vllm.v1.kv_offload.tiering.run_identity import run_fields_from_spec, sanitize_model_name

from .conftest import ROW_BYTES, make_spec

ROOT = "/kv/root"


def _mapper(**run_overrides: Any) -> FileMapper:
    spec = make_spec(**run_overrides)
    return FileMapper(ROOT, run_fields_from_spec(spec, spec.row_bytes))


def test_equal_runs_share_a_directory() -> None:
    a, b = _mapper(), _mapper(instance_id="another-instance")  # the instance id changes no byte
    assert a.rank_dir_name == b.rank_dir_name and a.run_digest == b.run_digest
    assert a.rank_dir_name == f"{a.base_name}_r0"


@pytest.mark.parametrize(
    "overrides",
    [
        {"model_name": "org/other-model"},
        {"dtype": "bfloat16"},
        {"kv_layout": "layer_major"},
        {"num_layers": 3},
        {"num_kv_heads": 8},
        {"head_size": 128},
        {"gpu_block_sizes": (32,)},
        {"gpu_block_sizes": (16, 16)},
        {"gpu_kv_bytes_per_block": ROW_BYTES // 2},
        {"tensor_parallel_size": 2, "gpu_kv_bytes_per_block": ROW_BYTES // 2},
        {"pipeline_parallel_size": 2, "gpu_kv_bytes_per_block": ROW_BYTES // 2},
    ],
)
def test_every_byte_changing_field_changes_the_directory(overrides: dict[str, Any]) -> None:
    assert _mapper(**overrides).rank_dir_name != _mapper().rank_dir_name


@pytest.mark.parametrize(
    ("windows_a", "windows_b"),
    [
        ((), (None, 32)),
        ((None, None), (None, 32)),
        ((None, 32), (None, 64)),
        ((None, 32), (32, None)),
    ],
)
def test_runs_differing_only_in_a_sliding_window_use_different_directories(
    windows_a: tuple[int | None, ...], windows_b: tuple[int | None, ...]
) -> None:
    # A window changes what every later layer computes, hence the bytes of a block.
    a = _mapper(gpu_block_sizes=(16, 16), sliding_windows=windows_a)
    b = _mapper(gpu_block_sizes=(16, 16), sliding_windows=windows_b)
    assert a.rank_dir_name != b.rank_dir_name and a.run_digest != b.run_digest


@pytest.mark.parametrize(
    ("overrides", "digest"),
    [
        ({}, "a2c6160f3d055d81d1e0908b4ab4db80fdd14c78958de823a396d994cd941328"),
        (
            {"gpu_block_sizes": (16, 16)},
            "14c84bb69e4442576c3b2ee1c8bda9d62044c9adbcb7797f9a815b58252532c2",
        ),
        (
            {"gpu_block_sizes": (16, 16), "sliding_windows": (None, None)},
            "14c84bb69e4442576c3b2ee1c8bda9d62044c9adbcb7797f9a815b58252532c2",
        ),
    ],
    ids=["one_group", "two_groups", "two_groups_no_window"],
)
def test_full_attention_runs_keep_their_digest(overrides: dict[str, Any], digest: str) -> None:
    # Pinned to the digests of the layout that predates sliding windows: existing fs caches of
    # full-attention runs stay warm. A deliberate layout change updates these values (and the
    # format version or the fields, so old files are not misread).
    mapper = _mapper(**overrides)
    assert mapper.run_digest.hex() == digest
    assert mapper.rank_dir_name == f"org_test-model_{digest[:16]}_r0"
    assert "sliding_windows" not in mapper.run_fields


def test_per_group_rows_are_part_of_the_identity_of_multi_group_runs_only() -> None:
    # Page rounding gives both layouts the same row_bytes here: the field tells them apart.
    two = {"gpu_block_sizes": (16, 16), "gpu_kv_bytes_per_block": ROW_BYTES - 100}
    shared = _mapper(**two)
    per_group = _mapper(**two, group_kv_bytes_per_block=(ROW_BYTES - 150, 50))
    assert shared.run_fields["row_bytes"] == per_group.run_fields["row_bytes"]
    assert "row_layout" not in shared.run_fields
    assert per_group.run_fields["row_layout"] == "per_group"
    assert per_group.run_digest != shared.run_digest
    assert per_group.rank_dir_name != shared.rank_dir_name
    # One group: its identity is the one it had before rows could be laid out per group.
    one = _mapper(group_kv_bytes_per_block=(ROW_BYTES,))
    assert "row_layout" not in one.run_fields and one.run_digest == _mapper().run_digest


def test_offloaded_block_size_changes_the_directory() -> None:
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    base = make_spec(gpu_kv_bytes_per_block=ROW_BYTES // 2)
    bigger = CPUOffloadingSpec(
        OffloadingConfig(cpu_bytes_to_use=16 * ROW_BYTES, block_size=32), base.run
    )
    assert bigger.row_bytes == base.row_bytes * 2
    a = FileMapper(ROOT, run_fields_from_spec(base, base.row_bytes))
    b = FileMapper(ROOT, run_fields_from_spec(bigger, bigger.row_bytes))
    assert a.rank_dir_name != b.rank_dir_name


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("meta-llama/Llama-3.1-8B", "meta-llama_Llama-3.1-8B"),
        ("../../etc/passwd", "_.._etc_passwd"),
        ("..", "model"),
        ("", "model"),
        ("a" * 200, "a" * 64),
        ("名前 with spaces", "___with_spaces"),
    ],
)
def test_model_names_are_sanitised(model: str, expected: str) -> None:
    assert sanitize_model_name(model) == expected


def test_block_path_of_a_typical_key() -> None:
    block_hash = bytes.fromhex("abcdef" + "00" * 29)
    path = FileMapper.block_path(make_offload_key(block_hash, 12))
    assert path == BlockPath("abc", "de_g12", block_hash.hex() + ".bin")
    assert path.rel == f"abc/de_g12/{block_hash.hex()}.bin"
    assert FileMapper.parse_block_path(path.dir1, path.dir2, path.name) == (
        make_offload_key(block_hash, 12),
        12,
    )


@pytest.mark.parametrize(
    "parts",
    [
        ("abc", "de_g1", "abcfee.bin"),  # name does not match its directories
        ("abc", "de_g01", "abcdef.bin"),  # non-canonical group
        ("abc", "de_g1", "abcdef.tmp"),
        ("ABC", "de_g1", "ABCdef.bin"),
        ("abc", "de_g1", "abcde.bin"),  # odd number of hex digits
        ("abc", "de_g99999999999", "abcdef.bin"),  # group out of range
        ("abc", "de_g1", "zabcdef.bin"),  # digested names are 64 hex digits
    ],
)
def test_foreign_names_do_not_parse(parts: tuple[str, str, str]) -> None:
    assert FileMapper.parse_block_path(*parts) is None


@given(
    block_hash=st.binary(min_size=1, max_size=200),
    group=st.integers(0, 2**32 - 1),
    model=st.text(max_size=80),
)
def test_no_key_or_model_name_leaves_the_root(block_hash: bytes, group: int, model: str) -> None:
    fields = run_fields_from_spec(make_spec(), ROW_BYTES)
    fields["model_name"] = model
    mapper = FileMapper(ROOT, fields)
    key = make_offload_key(block_hash, group)
    path = mapper.block_path(key)
    full = os.path.normpath(os.path.join(ROOT, mapper.rank_dir_name, path.rel))
    assert os.path.commonpath([full, ROOT]) == ROOT
    assert full.count("/") == ROOT.count("/") + 4  # rank dir / hhh / hh_gN / name
    assert all(c not in part for part in (path.dir1, path.dir2, path.name) for c in "/\0")
    assert mapper.rank_dir_name not in (".", "..") and "/" not in mapper.rank_dir_name
    assert len(path.name) <= 255
    parsed = FileMapper.parse_block_path(path.dir1, path.dir2, path.name)
    assert parsed is not None
    recovered, parsed_group = parsed
    assert parsed_group == group
    assert recovered == (key if 3 <= len(block_hash) <= 64 else None)
