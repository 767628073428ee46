# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Registry of the CPU tier's cache policies, resolved by name.

Built-in names are ``"lru"`` and ``"arc"``. Other policies are either registered by name with
``register_cache_policy`` or given directly as ``"package.module:ClassName"``. Modules are
imported lazily, on the first ``create_cache_policy`` that needs them.
"""

from __future__ import annotations

import importlib

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

_MODULE_PATH_SEPARATOR = ":"

# name -> (module path, class name)
_CACHE_POLICIES: dict[str, tuple[str, str]] = {
    "lru": ("vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy"),
    "arc": ("vllm.v1.kv_offload.cpu.policies.arc", "ARCCachePolicy"),
}


def registered_cache_policies() -> list[str]:
    """Return the registered policy names, sorted."""
    return sorted(_CACHE_POLICIES)


def register_cache_policy(name: str, module_path: str, class_name: str) -> None:
    """Register policy ``name`` as class ``class_name`` of module ``module_path``.

    The module is not imported until a policy of that name is created.

    Raises:
        ValueError: if ``name`` is empty, contains ``":"`` (reserved for the module-path form),
            is already registered, or if ``module_path`` or ``class_name`` is empty.
    """
    if not name or _MODULE_PATH_SEPARATOR in name:
        raise ValueError(
            f"invalid cache policy name {name!r}: it must be non-empty and contain no "
            f"{_MODULE_PATH_SEPARATOR!r}"
        )
    if not module_path or not class_name:
        raise ValueError(
            f"cache policy {name!r} needs a module path and a class name, "
            f"got {module_path!r} and {class_name!r}"
        )
    if name in _CACHE_POLICIES:
        module, cls = _CACHE_POLICIES[name]
        raise ValueError(f"cache policy {name!r} is already registered (as {module}:{cls})")
    _CACHE_POLICIES[name] = (module_path, class_name)


def _resolve(name: str) -> tuple[str, str]:
    registered = _CACHE_POLICIES.get(name)
    if registered is not None:
        return registered
    module_path, sep, class_name = name.partition(_MODULE_PATH_SEPARATOR)
    if sep and module_path and class_name:
        return module_path, class_name
    raise ValueError(
        f"unknown cache policy {name!r}: expected one of {registered_cache_policies()} "
        f"or an out-of-tree policy given as 'package.module:ClassName'"
    )


def load_cache_policy_class(name: str) -> type[CachePolicy]:
    """Resolve ``name`` (registered name or ``"package.module:ClassName"``) to its class.

    Raises:
        ValueError: if the name is unknown, or its module or class cannot be found.
        TypeError: if the name resolves to something that is not a ``CachePolicy`` subclass.
    """
    module_path, class_name = _resolve(name)
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"cache policy {name!r}: cannot import module {module_path!r}: {e}") from e
    try:
        cls = getattr(module, class_name)
    except AttributeError as e:
        raise ValueError(
            f"cache policy {name!r}: module {module_path!r} has no attribute {class_name!r}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise TypeError(
            f"cache policy {name!r}: {module_path}:{class_name} is {cls!r}, "
            f"not a subclass of {CachePolicy.__module__}.{CachePolicy.__qualname__}"
        )
    return cls


def create_cache_policy(name: str, cache_capacity: int) -> CachePolicy:
    """Create an empty policy of kind ``name`` for a cache of ``cache_capacity`` blocks.

    Args:
        name: a registered name (``"lru"``, ``"arc"``, or one added with
            ``register_cache_policy``) or an out-of-tree policy as ``"package.module:ClassName"``.
        cache_capacity: number of blocks of the cache, ``>= 1``.

    Raises:
        ValueError: if the name does not resolve, or ``cache_capacity < 1``.
        TypeError: if the name resolves to a class that is not a ``CachePolicy`` subclass.
    """
    return load_cache_policy_class(name)(cache_capacity)
