# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``CPUOffloadingSpec`` (single-tier offloading)."""

from __future__ import annotations

import pytest

from tests.v1.kv_offload.utils import make_run_info
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

RUN = make_run_info(3000, tensor_parallel_size=2)


def test_manager_geometry_and_cache() -> None:
    # Rows: 2 workers x 3000 bytes, padded to 8192; 5 rows fit in 41000 bytes.
    spec = CPUOffloadingSpec(OffloadingConfig(cpu_bytes_to_use=41000), RUN)
    assert spec.row_bytes == 8192 and spec.num_primary_blocks == 5
    manager = spec.get_manager()
    assert isinstance(manager, CPUOffloadingManager)
    assert manager.num_blocks == 5
    assert spec.get_manager() is manager


def test_eviction_policy_and_events() -> None:
    spec = CPUOffloadingSpec(
        OffloadingConfig(cpu_bytes_to_use=5 * 8192, eviction_policy="arc"), RUN, enable_events=True
    )
    manager = spec.get_manager()
    assert isinstance(manager.policy, ARCCachePolicy)
    ctx = ReqContext(req_id="r")
    key = make_offload_key(b"k", 0)
    assert manager.prepare_store([key], ctx) is not None
    manager.complete_store([key], ctx)
    assert [e.keys for e in manager.take_events()] == [[key]]


def test_too_little_memory_raises() -> None:
    with pytest.raises(ValueError, match="smaller than one offloaded block"):
        CPUOffloadingSpec(OffloadingConfig(cpu_bytes_to_use=100), RUN)
