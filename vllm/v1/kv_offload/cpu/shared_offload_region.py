# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Upstream vLLM's module path of ``SharedOffloadRegion``.

The region lives in the ``vllm.v1.kv_offload.cpu.shared_region`` package; code written against
upstream's path imports it from here.
"""

from vllm.v1.kv_offload.cpu.shared_region.region import SharedOffloadRegion

__all__ = ["SharedOffloadRegion"]
