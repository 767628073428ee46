# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Create secondary tiers from their config entries.

Tiers are registered by type name and imported lazily, so that a tier's dependencies are only
needed when a config actually uses it. A type that is not registered may name an out-of-tree
class directly as ``"package.module:ClassName"``.

Example config entry (``secondary_tiers`` in ``kv_connector_extra_config``)::

    {"type": "fs", "root_dir": "/mnt/kv"}            # a registered tier
    {"type": "my_pkg.tiers:RedisTier", "url": "..."} # an out-of-tree tier
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.v1.kv_offload.config import SecondaryTierConfig
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import OffloadingSpec


def _import_class(module_path: str, class_name: str, tier_type: str) -> type[SecondaryTierManager]:
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        # Only a missing module *named by the config* is a config error; a missing dependency
        # of an existing tier module propagates as is.
        if e.name is None or not (e.name == module_path or module_path.startswith(e.name + ".")):
            raise
        raise ValueError(
            f"secondary tier {tier_type!r}: cannot import module {module_path!r} ({e})"
        ) from e
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(
            f"secondary tier {tier_type!r}: module {module_path!r} has no attribute {class_name!r}"
        )
    if not (isinstance(cls, type) and issubclass(cls, SecondaryTierManager)):
        raise ValueError(
            f"secondary tier {tier_type!r}: {module_path}.{class_name} is not a subclass of "
            "SecondaryTierManager"
        )
    return cls


class SecondaryTierFactory:
    """Registry of secondary-tier classes, keyed by tier type, imported on first use."""

    _registry: ClassVar[dict[str, Callable[[], type[SecondaryTierManager]]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``tier_type`` (imported lazily).

        Raises:
            ValueError: ``tier_type`` is already registered, or contains ``":"`` (reserved for
                out-of-tree ``"package.module:ClassName"`` types).
        """
        if tier_type in cls._registry:
            raise ValueError(f"secondary tier type {tier_type!r} is already registered")
        if ":" in tier_type or not tier_type:
            raise ValueError(f"invalid secondary tier type name {tier_type!r}")

        def loader() -> type[SecondaryTierManager]:
            return _import_class(module_path, class_name, tier_type)

        cls._registry[tier_type] = loader

    @classmethod
    def known_tier_types(cls) -> list[str]:
        """The registered tier types, sorted."""
        return sorted(cls._registry)

    @classmethod
    def get_tier_class(cls, tier_type: str) -> type[SecondaryTierManager]:
        """Resolve a tier type (registered name or ``"package.module:ClassName"``) to its class.

        Raises:
            ValueError: unknown type (the message lists the registered ones), or an out-of-tree
                path that cannot be imported or is not a ``SecondaryTierManager``.
        """
        loader = cls._registry.get(tier_type)
        if loader is not None:
            return loader()
        module_path, sep, class_name = tier_type.partition(":")
        if sep and module_path and class_name:
            return _import_class(module_path, class_name, tier_type)
        raise ValueError(
            f"unknown secondary tier type {tier_type!r}; known types: "
            f"{cls.known_tier_types()} (or an out-of-tree 'package.module:ClassName')"
        )

    @classmethod
    def create_secondary_tier(
        cls,
        tier_config: SecondaryTierConfig | Mapping[str, Any],
        primary_kv_view: memoryview,
        offloading_spec: OffloadingSpec,
    ) -> SecondaryTierManager:
        """Build one tier from its config entry.

        Args:
            tier_config: a ``SecondaryTierConfig``, or a mapping ``{"type": ..., **kwargs}``
                (not modified).
            primary_kv_view: the primary tier's rows, format ``"B"``, shape
                ``(num_primary_blocks, row_bytes)``; lent to the tier until its ``shutdown()``.
            offloading_spec: the run's spec.

        Raises:
            ValueError: missing or unknown type, or kwargs the tier does not accept (naming the
                tier). Errors raised by the tier's constructor itself propagate unchanged.
        """
        if isinstance(tier_config, SecondaryTierConfig):
            tier_type: Any = tier_config.type
            kwargs = dict(tier_config.kwargs)
        else:
            kwargs = dict(tier_config)
            tier_type = kwargs.pop("type", None)
        if not isinstance(tier_type, str) or not tier_type:
            raise ValueError(
                f"secondary tier config needs a non-empty string 'type' (known types: "
                f"{cls.known_tier_types()}), got {tier_config!r}"
            )
        tier_cls = cls.get_tier_class(tier_type)
        try:
            inspect.signature(tier_cls).bind(
                offloading_spec=offloading_spec,
                primary_kv_view=primary_kv_view,
                tier_type=tier_type,
                **kwargs,
            )
        except TypeError as e:
            raise ValueError(
                f"invalid config for secondary tier {tier_type!r} ({tier_cls.__qualname__}): {e}; "
                f"got kwargs {sorted(kwargs)}"
            ) from e
        return tier_cls(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            **kwargs,
        )


SecondaryTierFactory.register_tier(
    "example", "vllm.v1.kv_offload.tiering.example.manager", "ExampleSecondaryTierManager"
)
SecondaryTierFactory.register_tier(
    "fs", "vllm.v1.kv_offload.tiering.fs.manager", "FileSystemSecondaryTier"
)
SecondaryTierFactory.register_tier(
    "redis", "vllm.v1.kv_offload.tiering.redis.manager", "RedisSecondaryTier"
)
