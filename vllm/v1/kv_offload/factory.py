# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingSpecFactory``: pick the ``OffloadingSpec`` class named by ``spec_name``.

Built-in specs are registered by name and imported lazily; any other name is imported from
``spec_module_path``.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

from vllm.logger import init_logger
from vllm.utils.class_registry import LazyClassRegistry
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec

logger = init_logger(__name__)


class OffloadingSpecFactory:
    """Registry of ``OffloadingSpec`` classes by name, imported on first use."""

    _registry: ClassVar[LazyClassRegistry[OffloadingSpec]] = LazyClassRegistry(
        OffloadingSpec, "offloading spec"
    )

    register_spec = _registry.register
    """``register_spec(name, module_path, class_name)``: register ``module_path.class_name``
    under ``name`` (``ValueError`` if ``name`` is already registered)."""

    @classmethod
    def get_spec_class(cls, config: OffloadingConfig) -> type[OffloadingSpec]:
        """The class selected by ``config.spec_name`` (registered, or in ``spec_module_path``).

        Raises:
            ValueError: the name is neither registered nor importable from ``spec_module_path``.
        """
        spec_cls = cls._registry.get(config.spec_name)
        if spec_cls is not None:
            return spec_cls
        if config.spec_module_path is None:
            raise ValueError(
                f"unknown offloading spec {config.spec_name!r}; registered specs: "
                f"{cls._registry.names()} (set 'spec_module_path' for an out-of-tree spec)"
            )
        return cls._registry.load(config.spec_module_path, config.spec_name)

    @classmethod
    def create_spec(
        cls, config: OffloadingConfig, run: KVCacheRunInfo, *, enable_events: bool = False
    ) -> OffloadingSpec:
        """Instantiate the selected spec as ``spec_cls(config, run[, enable_events=...])``.

        ``enable_events`` is passed only to specs whose constructor accepts it; a spec that does
        not accept it while events are requested gets a warning.
        """
        spec_cls = cls.get_spec_class(config)
        params = inspect.signature(spec_cls).parameters
        accepts_events = "enable_events" in params or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
        )
        if accepts_events:
            return spec_cls(config, run, enable_events=enable_events)  # type: ignore[call-arg]
        if enable_events:
            logger.warning(
                "offloading spec %s does not take enable_events; KV events are disabled",
                spec_cls.__qualname__,
            )
        return spec_cls(config, run)


OffloadingSpecFactory.register_spec(
    "CPUOffloadingSpec", "vllm.v1.kv_offload.cpu.spec", "CPUOffloadingSpec"
)
OffloadingSpecFactory.register_spec(
    "TieringOffloadingSpec", "vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec"
)
