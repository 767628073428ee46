# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Upstream vLLM's module path of ``CpuGpuOffloadingHandlers``.

The worker-side transfer code lives in the ``vllm.v1.kv_offload.cpu.transfer`` package; code
written against upstream's path imports the handlers from here.
"""

from vllm.v1.kv_offload.cpu.transfer.gpu_worker import CpuGpuOffloadingHandlers

__all__ = ["CpuGpuOffloadingHandlers"]
