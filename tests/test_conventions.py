# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""vLLM's source conventions, checked over the tracked tree: an SPDX line on every source file and
one logger helper (``vllm.logger.init_logger``) for every module of the package."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SUFFIXES = (".py", ".sh", ".cu", ".cuh", ".cpp", ".h", ".hpp")
SOURCE_DIRS = ("vllm/", "tests/", "benchmarks/", "csrc/")


def _tracked_sources() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"needs a git checkout of the repository to list its files: {e}")
    return [
        f
        for f in out.split()
        if f.startswith(SOURCE_DIRS) and f.endswith(SOURCE_SUFFIXES) and (ROOT / f).is_file()
    ]


def test_every_source_file_starts_with_an_spdx_line() -> None:
    missing = []
    for f in _tracked_sources():
        head = (ROOT / f).read_text(encoding="utf-8").splitlines()[:3]
        if not any("SPDX-License-Identifier: Apache-2.0" in line for line in head):
            missing.append(f)
    assert not missing, f"no SPDX-License-Identifier line in the first 3 lines of {missing}"


def test_package_modules_log_through_init_logger() -> None:
    direct = []
    for f in _tracked_sources():
        if f.startswith("vllm/") and f.endswith(".py") and f != "vllm/logger.py":
            text = (ROOT / f).read_text(encoding="utf-8")
            if re.search(r"logging\.getLogger\(", text):
                direct.append(f)
    assert not direct, (
        f"use vllm.logger.init_logger(__name__) instead of logging.getLogger in {direct}"
    )
