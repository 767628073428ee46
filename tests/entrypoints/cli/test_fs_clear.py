# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run --fs-clear`` (fs_clear.py): only what the fs tier wrote goes."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm.entrypoints.cli.fs_clear import clear_fs_root
from vllm.entrypoints.cli.main import main

from .test_run import run_tiny


def test_fs_clear_deletes_only_what_the_tier_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "fs"
    code, doc = run_tiny(tmp_path, "r1")
    assert code == 0
    written = doc["runs"]["offload"]["fs_tier"]["bytes_at_end"]
    assert written > 0
    # Things of the user's that happen to be in the root stay.
    (root / "notes.txt").write_text("mine")
    (root / "photos").mkdir()
    (root / "photos" / "a.bin").write_bytes(b"x")
    (root / "photos_r0").mkdir()  # a name like a block directory, but of no run
    run_dirs = sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())
    assert len(run_dirs) == 1
    capsys.readouterr()
    assert main(["run", "--fs-root", str(root), "--fs-clear"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("vllm-kv-offload: removed 1 run directory (")
    assert f"of the fs tier from {root}" in out
    left = sorted(p.name for p in root.iterdir())
    assert left == ["notes.txt", "photos", "photos_r0"]
    assert (root / "photos" / "a.bin").read_bytes() == b"x"
    # Clearing again finds nothing; the next run starts cold.
    assert main(["run", "--fs-root", str(root), "--fs-clear"]) == 0
    assert "removed 0 run directories (0 B)" in capsys.readouterr().out
    code, doc = run_tiny(tmp_path, "r2")
    assert doc["runs"]["offload"]["fs_tier"]["warm_start"] is False


def test_fs_clear_counts_each_block_file_once(tmp_path: Path) -> None:
    # A block file has a second name (its slot's hard link): the bytes freed are the files', not
    # twice them. Beyond the block files only the small metadata files (config.json, writers/).
    code, doc = run_tiny(tmp_path, "r1")
    assert code == 0
    written = doc["runs"]["offload"]["fs_tier"]["bytes_at_end"]
    runs, removed = clear_fs_root(tmp_path / "fs")
    assert runs == 1
    assert written <= removed < written + 64 * 1024
