# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``SchedulerOutput``: what the scheduler decided for one step.

It is handed to the KV connector's ``build_connector_meta`` (scheduler side) and, with the
connector metadata attached, to every worker.

Block ids are per KV-cache group: ``block_ids[g]`` lists GPU block ids of group ``g`` in the
order of the request's logical blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.request import Request

GroupBlockIds = tuple[list[int], ...]
"""GPU block ids per KV-cache group."""


@dataclass
class NewRequestData:
    """A request scheduled for the first time (or the first time after a preemption).

    Attributes:
        req_id: the request id.
        prompt_token_ids: the request's prompt.
        block_ids: every GPU block the request holds now, per group (prefix hits included).
        num_computed_tokens: tokens already computed before this step (local prefix hits plus
            tokens loaded by the connector).
        output_token_ids: tokens the request generated before a preemption (empty otherwise).
    """

    req_id: str
    prompt_token_ids: list[int]
    block_ids: GroupBlockIds
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_request(cls, request: Request, block_ids: GroupBlockIds) -> NewRequestData:
        """Describe ``request`` as scheduled now, holding ``block_ids``."""
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),
        )


@dataclass
class CachedRequestData:
    """Requests that were already running in the previous step (parallel lists).

    Attributes:
        req_ids: the requests.
        new_block_ids: per request, the GPU blocks allocated to it this step, per group (None if
            none were allocated).
        num_computed_tokens: per request, tokens computed before this step.
    """

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[GroupBlockIds | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        """Number of requests described."""
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step's scheduling decision.

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time, or resumed after a
            preemption (they hold a fresh set of blocks).
        scheduled_cached_reqs: requests that ran in the previous step and run again.
        num_scheduled_tokens: tokens to compute this step, per request id.
        total_num_scheduled_tokens: the sum of ``num_scheduled_tokens``.
        finished_req_ids: requests that finished (or were aborted) since the previous step.
        preempted_req_ids: requests preempted in this step (their GPU blocks were freed).
        kv_connector_metadata: what the scheduler-side connector built for the workers.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    kv_connector_metadata: KVConnectorMetadata | None = None
