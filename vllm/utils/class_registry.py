# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``LazyClassRegistry``: classes registered by name, imported on first use.

Registries of pluggable classes (KV connectors; any other kind a factory picks by name) keep a
``module path + class name`` per name, so that registering imports nothing, and check that what
they import subclasses the kind's base class.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class LazyClassRegistry(Generic[T]):
    """Subclasses of ``base`` by name (single-threaded registration, at import time).

    Args:
        base: the class every registered or loaded class must subclass (typed ``type`` rather
            than ``type[T]``: the base of a plugin kind is usually abstract, which mypy refuses
            there).
        what: the kind's name in error messages (e.g. ``"KV connector"``).
    """

    def __init__(self, base: type, what: str) -> None:
        self.base = base
        self.what = what
        self._entries: dict[str, tuple[str, str]] = {}

    def register(self, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name``; nothing is imported yet.

        Raises:
            ValueError: ``name`` is already registered.
        """
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered")
        self._entries[name] = (module_path, class_name)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> type[T] | None:
        """The class registered under ``name`` (imported now), or None if none is.

        Raises:
            ImportError: its module cannot be imported.
            ValueError: as ``load``.
        """
        entry = self._entries.get(name)
        return None if entry is None else self.load(*entry)

    def load(self, module_path: str, class_name: str) -> type[T]:
        """Import ``module_path`` and return its ``class_name``.

        Raises:
            ImportError: the module cannot be imported.
            ValueError: it has no such attribute, or that is not a subclass of ``base``.
        """
        cls = getattr(importlib.import_module(module_path), class_name, None)
        if cls is None:
            raise ValueError(f"module {module_path!r} has no {self.what} {class_name!r}")
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise ValueError(
                f"{module_path}.{class_name} is not a subclass of {self.base.__name__}"
            )
        return cast("type[T]", cls)
