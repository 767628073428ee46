# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What the engine's steps produce: the workers' output of a step, and each request's output."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.v1.outputs import KVConnectorOutput


@dataclass
class ModelRunnerOutput:
    """What the workers return for one step (aggregated over ranks).

    Attributes:
        sampled_token_ids: the token sampled for each request that reached its end this step.
        kv_connector_output: the connectors' report, or None without a connector.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request.

    Attributes:
        request_id: the request.
        new_token_ids: tokens sampled this step.
        finished: the request is done.
        finish_reason: ``"length"`` or ``"abort"`` once finished.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
