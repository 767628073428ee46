# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""vLLM's source conventions, checked over the tracked tree: an SPDX line on every source file and
one logger helper (``vllm.logger.init_logger``) for every module of the package, no side effect
inside an ``assert`` of production code, ``@override`` on the methods that override and on no
dunder, and few reads of private state by the tests, each with its reason."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vllm

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


# Tests assert behaviour through the public API; where none shows what a test must see, it reads
# private state, at most this many times (issue 24's bound; most are the layout of the policies'
# lists, the fs index and the managers' books, read by the one helper module of each).
MAX_PRIVATE_ACCESSES = 40
# ``vllm._custom_ops`` is upstream vLLM's own module path: importing it reads no private state.
_PUBLIC_UNDERSCORE_MODULES = frozenset(["_custom_ops"])


def _is_private(name: str) -> bool:
    return (
        name.startswith("_") and not name.endswith("__") and name not in _PUBLIC_UNDERSCORE_MODULES
    )


def private_accesses(source: str) -> list[tuple[int, str, bool]]:
    """Each ``obj._name`` (``obj`` not ``self``/``cls``) and each private name imported in
    ``source``: its line, the name, and whether a reason comes with it, a ``# private:`` comment
    on its line or opening its paragraph (the lines above it up to a blank one)."""
    lines = source.splitlines()

    def explained(lineno: int) -> bool:
        for line in reversed(lines[:lineno]):
            if not line.strip():
                return False
            if "# private:" in line:
                return True
        return False

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append((node.lineno, node.attr, explained(node.lineno)))
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append((node.lineno, alias.name, explained(node.lineno)))
    return sorted(found)


def test_tests_read_little_private_state_and_say_why() -> None:
    unexplained, total = [], 0
    for f in _tracked_sources():
        if f.startswith("tests/") and f.endswith(".py"):
            accesses = private_accesses((ROOT / f).read_text(encoding="utf-8"))
            total += len(accesses)
            unexplained += [f"{f}:{line} {name}" for line, name, ok in accesses if not ok]
    assert not unexplained, (
        "a test reads private state without a '# private: <why no public way exists>' comment "
        f"on the line or opening its paragraph: {unexplained}"
    )
    assert total <= MAX_PRIVATE_ACCESSES, (
        f"the tests read private state {total} times (at most {MAX_PRIVATE_ACCESSES}): assert "
        "through the public API instead"
    )


def test_the_private_access_check_finds_them() -> None:
    source = """
from vllm.x import _helper, public
from vllm import _custom_ops
self._mine, cls._ours, obj.__dict__, obj.public
obj._theirs

# private: why
a = obj._explained
b = obj._also_explained
c = obj._same_line  # private: why
"""
    assert private_accesses(source) == [
        (2, "_helper", False),
        (5, "_theirs", False),
        (8, "_explained", True),
        (9, "_also_explained", True),
        (10, "_same_line", True),
    ]


def _classes(owner: object, module: str) -> Iterator[type]:
    """The classes defined in ``module`` (``owner``: the module, then each class for the
    classes nested in it)."""
    for value in vars(owner).values():
        if inspect.isclass(value) and value.__module__ == module:
            yield value
            yield from _classes(value, module)


def _methods(cls: type) -> Iterator[tuple[str, Any, Any]]:
    """Each method written in ``cls``'s body: its name, what the class holds and the function
    (a staticmethod, classmethod or property unwrapped)."""
    for name, raw in vars(cls).items():
        func = raw.fget if isinstance(raw, property) else getattr(raw, "__func__", raw)
        if inspect.isfunction(func) and func.__qualname__ == f"{cls.__qualname__}.{name}":
            yield name, raw, func


def test_override_marks_the_methods_that_override_and_no_dunder() -> None:
    """``@override`` (``typing_extensions``) on every method of the package that overrides one of
    a base class (beyond ``object``), and on no dunder: ``__repr__`` or ``__len__`` override by
    definition, so the mark would say nothing there (mypy's ``explicit-override`` asks it of them
    too, which is why this check stands in its place)."""
    unmarked, dunders, checked = [], [], 0
    for info in pkgutil.walk_packages(vllm.__path__, "vllm."):
        spec = importlib.util.find_spec(info.name)
        if spec is None or not (spec.origin or "").endswith(".py"):
            continue  # the CUDA copy library: a shared object loaded with ctypes, not Python
        module = importlib.import_module(info.name)
        for cls in _classes(module, info.name):
            bases = [b for b in cls.__mro__[1:] if b is not object]
            for name, raw, func in _methods(cls):
                marked = getattr(raw, "__override__", False) or getattr(func, "__override__", False)
                where = f"{info.name}.{cls.__qualname__}.{name}"
                if name.startswith("__") and name.endswith("__"):
                    if marked:
                        dunders.append(where)
                elif any(name in vars(b) for b in bases):
                    checked += 1
                    if not marked:
                        unmarked.append(where)
    assert checked > 100, f"only {checked} overriding methods found: is the walk broken?"
    assert not unmarked, f"overriding methods without @override: {unmarked}"
    assert not dunders, f"@override on dunders (leave it off): {dunders}"
