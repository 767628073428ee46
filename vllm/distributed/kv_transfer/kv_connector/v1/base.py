# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The KV connector v1 interface, as the engine calls it.

A connector has two halves, one per role. The scheduler-side half runs in the engine core next to
the scheduler; the worker-side half runs in every worker process, next to the GPU KV cache. They
talk only through metadata: the scheduler side builds a ``KVConnectorMetadata`` per step that the
workers consume, and each worker returns a ``KVConnectorWorkerMetadata`` that the engine sums over
ranks and hands back to the scheduler side in ``KVConnectorOutput``.

Call order within one engine step (scheduler side unless noted)::

    schedule():
        get_num_new_matched_tokens(request, num_computed_tokens)   # per waiting request
        update_state_after_alloc(request, blocks, num_external_tokens)
        build_connector_meta(scheduler_output)
        take_events()
    worker: handle_preemptions(meta); bind_connector_metadata(meta); start_load_kv();
            <model forward>; wait_for_save(); get_finished(finished_req_ids);
            build_connector_worker_meta(); clear_connector_metadata()
    update_from_output():
        update_connector_output(connector_output)
        request_finished(request)                                   # per finished request
        take_events()
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

from typing_extensions import Self


class KVConnectorRole(enum.Enum):
    """Which half of a connector an instance is."""

    SCHEDULER = 0
    """Runs in the engine core, next to the scheduler."""
    WORKER = 1
    """Runs in a worker, next to the GPU KV cache."""


class KVConnectorMetadata(ABC):  # noqa: B024 (a marker base: subclasses define the fields)
    """Scheduler -> worker metadata of one step. Subclasses define the payload."""


class KVConnectorWorkerMetadata(ABC):
    """Worker -> scheduler metadata of one step, produced by each worker rank."""

    @abstractmethod
    def aggregate(self, other: Self) -> Self:
        """Combine this rank's metadata with another rank's (same step); returns the result.

        Aggregation is commutative and associative, so the engine may fold the ranks in any
        order. Neither input is mutated.
        """
