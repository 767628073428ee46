# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``KVConnectorFactory``: build the ``KVConnectorBase_V1`` subclass a ``KVTransferConfig`` names.

Built-in connectors are registered by name and imported on first use, so the engine imports no
connector module itself; any other name is the class of that name in
``kv_connector_module_path`` (an out-of-tree connector), as in upstream vLLM.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVTransferConfig,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import KVCacheRunInfo


def _load_connector_class(module_path: str, class_name: str) -> type[KVConnectorBase_V1]:
    module = importlib.import_module(module_path)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ValueError(f"module {module_path!r} has no KV connector {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ValueError(f"{module_path}.{class_name} is not a subclass of KVConnectorBase_V1")
    return cls


class KVConnectorFactory:
    """Registry of KV connector classes by name, imported on first use."""

    _registry: ClassVar[dict[str, Callable[[], type[KVConnectorBase_V1]]]] = {}

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name``.

        Raises:
            ValueError: ``name`` is already registered.
        """
        if name in cls._registry:
            raise ValueError(f"KV connector {name!r} is already registered")

        def loader() -> type[KVConnectorBase_V1]:
            return _load_connector_class(module_path, class_name)

        cls._registry[name] = loader

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class ``config.kv_connector`` names (registered, or in the module path).

        Raises:
            ValueError: the name is neither registered nor a connector class in
                ``kv_connector_module_path``.
        """
        if config.kv_connector_module_path is not None:
            return _load_connector_class(config.kv_connector_module_path, config.kv_connector)
        loader = cls._registry.get(config.kv_connector)
        if loader is None:
            raise ValueError(
                f"unknown KV connector {config.kv_connector!r}; registered connectors: "
                f"{sorted(cls._registry)} (set kv_connector_module_path for an out-of-tree one)"
            )
        return loader()

    @classmethod
    def create_connector(
        cls,
        config: KVTransferConfig,
        role: KVConnectorRole,
        run: KVCacheRunInfo,
        *,
        rank: int = 0,
    ) -> KVConnectorBase_V1:
        """Instantiate the selected class as ``cls(config, role, run, rank=rank)``."""
        return cls.get_connector_class(config)(config, role, run, rank=rank)


KVConnectorFactory.register_connector(
    "OffloadingConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector",
    "OffloadingConnector",
)
