# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``Request``: tokens, status and block hashes."""

from __future__ import annotations

import pytest

from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus


def test_request_tracks_tokens_and_status() -> None:
    r = Request("r", [1, 2, 3], 4, kv_transfer_params={"x": 1})
    assert r.num_tokens == r.num_prompt_tokens == 3 and r.num_output_tokens == 0
    assert r.status is RequestStatus.WAITING and not r.is_finished
    assert r.block_hashes == []  # no hasher: nothing hashed
    r.append_output_token_ids(9)
    assert r.all_token_ids == [1, 2, 3, 9] and r.output_token_ids == [9]
    r.status = RequestStatus.FINISHED_ABORTED
    assert r.is_finished
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)
    assert RequestStatus.is_finished(RequestStatus.FINISHED_LENGTH_CAPPED)


def test_request_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="prompt"):
        Request("r", [], 1)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("r", [1], 0)
    with pytest.raises(ValueError, match="block_size"):
        get_request_block_hasher(0)
