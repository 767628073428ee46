# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Helpers shared by the tier benchmarks (``bench_fs.py``, ``bench_redis.py``).

The scripts run as ``python benchmarks/kv_offload/bench_*.py``, so this directory is on
``sys.path`` and they import this module as ``_common``.
"""

from __future__ import annotations

import hashlib

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo


def bench_spec(block_bytes: int, num_blocks: int) -> CPUOffloadingSpec:
    """A CPU spec of ``num_blocks`` rows of ``block_bytes`` for a fixed model-like run."""
    run = KVCacheRunInfo(
        model_name="bench/model",
        dtype="float16",
        kv_layout="cross_layer",
        num_layers=32,
        num_kv_heads=8,
        head_size=128,
        gpu_block_sizes=(16,),
        gpu_kv_bytes_per_block=block_bytes,
    )
    return CPUOffloadingSpec(OffloadingConfig(cpu_bytes_to_use=num_blocks * block_bytes), run)


def bench_keys(num_blocks: int, salt: object) -> list[OffloadKey]:
    """``num_blocks`` distinct keys; a different ``salt`` gives different keys."""
    return [
        make_offload_key(hashlib.sha256(f"{salt}:{i}".encode()).digest(), 0)
        for i in range(num_blocks)
    ]
