# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Worker -> scheduler outputs of one step that concern the KV connector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


@dataclass
class KVConnectorOutput:
    """What the workers' connectors report after a step (already aggregated over ranks).

    Attributes:
        finished_sending: requests whose asynchronous sends finished (blocks may now be freed).
        finished_recving: requests whose asynchronous loads finished (successfully or not).
        invalid_block_ids: GPU block ids (per group) whose load failed; their KV must be
            recomputed. Keys are group indices.
        kv_connector_worker_meta: the connector's own worker -> scheduler metadata.
        kv_connector_stats: the connector's statistics of the step (monitoring only; nothing
            the scheduler decides depends on them).
    """

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: dict[int, set[int]] = field(default_factory=dict)
    kv_connector_worker_meta: KVConnectorWorkerMetadata | None = None
    kv_connector_stats: KVConnectorStats | None = None

    def is_empty(self) -> bool:
        """Whether nothing at all is reported."""
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.kv_connector_worker_meta is not None
            or self.kv_connector_stats is not None
        )
