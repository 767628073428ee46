# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the start-up scan over a real rank directory."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.fs import scan as scan_module
from vllm.v1.kv_offload.tiering.fs.capacity import CapacityIndex, FileRemover, RankFiles
from vllm.v1.kv_offload.tiering.fs.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.meters import Counters
from vllm.v1.kv_offload.tiering.fs.scan import RankDirWalker, ScanStats
from vllm.v1.kv_offload.tiering.run_identity import run_fields_from_spec

from .conftest import ROW_BYTES, Primary, TierFactory, key_of, load, make_spec, store
from .tier_state import block_file, check_index, lru_keys

FILE_SIZE = HEADER_SIZE + ROW_BYTES


def _scan(rank_dir: str, stop: threading.Event | None = None) -> tuple[CapacityIndex, ScanStats]:
    """Scan ``rank_dir`` alone (no slots) into a new index, as the tests' run."""
    index = CapacityIndex(max_bytes=None)
    # The mapper's root is unused by the walker; its run digest is the one every block header of
    # the tests' run carries (docs/fs_tier.md: the run's identity).
    mapper = FileMapper(rank_dir, run_fields_from_spec(make_spec(), ROW_BYTES))
    fd = os.open(rank_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        files = RankFiles(fd, mapper, index, Counters(), ROW_BYTES, slots=None)
        walker = RankDirWalker(files, FileRemover(files), stale_tmp_age_s=600)
        stats = walker.scan(stop or threading.Event())
    finally:
        os.close(fd)
    check_index(index)
    return index, stats


def test_scan_indexes_block_files_and_ignores_foreign_ones(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier()
    digested = make_offload_key(b"\x07", 2)  # key recovered from the header
    keys = [key_of(1), key_of(2, group=5), digested]
    assert store(tier, primary, keys, [0, 1, 2])
    rank = Path(tier.rank_dir)
    # Foreign entries: not counted, not deleted.
    (rank / "README").write_text("hello")
    (rank / "abc").mkdir(exist_ok=True)
    (rank / "abc" / "notes_g1").mkdir()
    (rank / "abc" / "notes_g1" / "x.bin").write_bytes(b"x")
    misplaced = rank / "fff" / "ff_g0"
    misplaced.mkdir(parents=True)
    source = Path(block_file(tier, keys[0]))
    shutil.copyfile(source, misplaced / source.name)  # valid bytes, wrong directory
    # A well-named symlink is not a block file.
    leaf = Path(block_file(tier, keys[1])).parent
    (leaf / f"{leaf.parent.name}{leaf.name[:2]}00000000.bin").symlink_to(source)
    index, stats = _scan(tier.rank_dir)
    assert stats.completed and stats.blocks == 3 and stats.bytes == 3 * FILE_SIZE
    assert sorted(lru_keys(index)) == sorted(keys)
    assert (rank / "README").exists() and (misplaced).exists()


def test_scan_deletes_unreadable_digested_files(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier()
    digested = make_offload_key(b"\x07", 0)
    assert store(tier, primary, [digested], [0])
    path = Path(block_file(tier, digested))
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    index, stats = _scan(tier.rank_dir)
    assert stats.invalid_removed == 1 and stats.blocks == 0 and len(index) == 0
    assert not path.exists()


def test_scan_keeps_a_good_file_renamed_over_a_corrupt_one(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    digested = make_offload_key(b"\x07", 0)
    assert store(tier, primary, [digested], [0])
    path = Path(block_file(tier, digested))
    good = path.with_name("good.copy")
    shutil.copyfile(path, good)
    with open(path, "r+b") as f:
        f.write(b"garbage!")
    real_read_header_key = scan_module.read_header_key

    def read_then_replace(*args: Any, **kwargs: Any) -> bytes:
        """The header read fails; then a writer renames a good file into place."""
        try:
            return real_read_header_key(*args, **kwargs)
        finally:
            os.replace(good, path)

    monkeypatch.setattr(scan_module, "read_header_key", read_then_replace)
    _, stats = _scan(tier.rank_dir)
    assert stats.invalid_removed == 0
    assert path.exists(), "the good file renamed over the corrupt one survives"
    assert load(tier, primary, [digested], [1]) and primary.holds(1, digested)


def test_scan_stops_when_asked(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier()
    assert store(tier, primary, [key_of(i) for i in range(3)], [0, 1, 2])
    stop = threading.Event()
    stop.set()
    index, stats = _scan(tier.rank_dir, stop)
    assert not stats.completed and len(index) == 0
