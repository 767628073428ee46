# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``KVConnectorFactory``: build the ``KVConnectorBase_V1`` subclass a ``KVTransferConfig`` names.

Built-in connectors are registered by name and imported on first use, so the engine imports no
connector module itself; any other name is the class of that name in
``kv_connector_module_path`` (an out-of-tree connector), as in upstream vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVTransferConfig,
)
from vllm.utils.class_registry import LazyClassRegistry

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import KVCacheRunInfo


class KVConnectorFactory:
    """Registry of KV connector classes by name, imported on first use."""

    _registry: ClassVar[LazyClassRegistry[KVConnectorBase_V1]] = LazyClassRegistry(
        KVConnectorBase_V1, "KV connector"
    )

    @classmethod
    def register_connector(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name``.

        Raises:
            ValueError: ``name`` is already registered.
        """
        cls._registry.register(name, module_path, class_name)

    @classmethod
    def get_connector_class(cls, config: KVTransferConfig) -> type[KVConnectorBase_V1]:
        """The class ``config.kv_connector`` names (in the module path, or registered).

        Raises:
            ValueError: the name is neither a connector class in ``kv_connector_module_path``
                nor registered.
        """
        if config.kv_connector_module_path is not None:
            return cls._registry.load(config.kv_connector_module_path, config.kv_connector)
        connector_cls = cls._registry.get(config.kv_connector)
        if connector_cls is None:
            raise ValueError(
                f"unknown KV connector {config.kv_connector!r}; registered connectors: "
                f"{cls._registry.names()} (set kv_connector_module_path for an out-of-tree one)"
            )
        return connector_cls

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
