# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""vLLM's source conventions, checked over the tracked tree: an SPDX line on every source file and
one logger helper (``vllm.logger.init_logger``) for every module of the package, and no side effect
inside an ``assert`` of production code."""

from __future__ import annotations

import ast
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


# Methods that change their object (or the world): an ``assert`` calling one loses the change
# under ``python -O``, which strips asserts.
_MUTATORS = frozenset(
    [
        "acquire",
        "add",
        "append",
        "appendleft",
        "clear",
        "close",
        "discard",
        "extend",
        "extendleft",
        "get_nowait",
        "insert",
        "move_to_end",
        "pop",
        "popitem",
        "popleft",
        "put",
        "put_nowait",
        "release",
        "remove",
        "send",
        "set",
        "setdefault",
        "sort",
        "update",
        "write",
    ]
)


def _side_effects(node: ast.AST) -> list[str]:
    """What in an assert's expression changes state: walrus targets, mutating method calls,
    ``next()``."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.NamedExpr):
            found.append(f"{ast.unparse(sub.target)} :=")
        elif isinstance(sub, ast.Call):
            func = sub.func
            if isinstance(func, ast.Attribute) and func.attr in _MUTATORS:
                found.append(f".{func.attr}()")
            elif isinstance(func, ast.Name) and func.id == "next":
                found.append("next()")
    return found


def test_no_side_effects_in_asserts() -> None:
    """Production code (the package and the benchmarks) keeps asserts free of side effects.

    Tests are exempt: pytest never runs them under ``-O``, and asserting what a call returned
    is what a test does.
    """
    offenders = []
    for f in _tracked_sources():
        if not (f.startswith(("vllm/", "benchmarks/")) and f.endswith(".py")):
            continue
        tree = ast.parse((ROOT / f).read_text(encoding="utf-8"), filename=f)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                effects = _side_effects(node)
                if effects:
                    offenders.append(f"{f}:{node.lineno} ({', '.join(effects)})")
    assert not offenders, f"side effects inside an assert (lost under python -O): {offenders}"


def test_the_side_effect_check_finds_them() -> None:
    """The check above flags what it must and passes what it must."""
    flagged = [
        "assert jobs.pop(job_id) is job",
        "assert (n := count()) > 0",
        "assert next(it) == 1",
        "assert queue.get_nowait() is None, f'{items.append(1)}'",
    ]
    clean = ["assert jobs.get(job_id) is job", "assert len(keys) == n", "assert key not in seen"]
    for source in flagged:
        assert _side_effects(ast.parse(source).body[0]), source
    for source in clean:
        assert not _side_effects(ast.parse(source).body[0]), source
