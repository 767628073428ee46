# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Upstream vLLM's module path of the CPU tier's transfer descriptors (``CPULoadStoreSpec``).

The definitions live in the medium-neutral ``vllm.v1.kv_offload.mediums`` (so that the connector
can name them without importing the CPU tier); upstream's tiering manager and code written
against it import them from here.
"""

from __future__ import annotations

from vllm.v1.kv_offload.mediums import CPU_MEDIUM, CPULoadStoreSpec

__all__ = ["CPU_MEDIUM", "CPULoadStoreSpec"]
