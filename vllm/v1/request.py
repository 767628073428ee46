# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``Request``: one generation request as the scheduler and the KV connector see it."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

from vllm.v1.core.kv_cache_utils import BlockHash, BlockHasher


class RequestStatus(enum.IntEnum):
    """Lifecycle state of a request. Values above ``PREEMPTED`` are finished states."""

    WAITING = enum.auto()
    """In the waiting queue; not holding any GPU block (or holding loaded ones, see below)."""
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """Holds GPU blocks that an asynchronous connector load is filling; not schedulable yet."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    """Its GPU blocks were taken back; it waits to be recomputed (or reloaded)."""
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether ``status`` is one of the finished states."""
        return status > RequestStatus.PREEMPTED


class Request:
    """A request: its tokens, its progress and the hashes of its full blocks.

    Attributes:
        request_id: unique id within the engine.
        prompt_token_ids: the prompt (immutable after construction).
        output_token_ids: tokens generated so far (appended by the engine).
        max_tokens: maximum number of output tokens.
        kv_transfer_params: opaque per-request parameters for the KV connector.
        num_computed_tokens: tokens whose KV is in (or being loaded into) the request's GPU blocks.
        status: the lifecycle state.
        block_hashes: chained prefix hashes of every full block of ``all_token_ids``, kept up to
            date by ``append_output_token_ids``.
        arrival_time: ``time.monotonic()`` at construction (or as given).
        num_preemptions: how many times the request was preempted.
        num_output_placeholders: under async scheduling, tokens sampled by steps in flight whose
            value is not known yet (the next step may compute their KV already, as vLLM's async
            scheduler does); always 0 otherwise.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        block_hasher: BlockHasher | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt must not be empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.max_tokens = max_tokens
        self.kv_transfer_params = kv_transfer_params
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.num_preemptions = 0
        self.num_output_placeholders = 0
        self.block_hashes: list[BlockHash] = []
        self._block_hasher = block_hasher
        self._update_block_hashes()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by output tokens. Owned by the request; do not mutate."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Number of known tokens (prompt + output)."""
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether the request reached a finished state."""
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Append generated tokens and hash the blocks they complete."""
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
