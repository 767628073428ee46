# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Transfer descriptors of the CPU primary tier.

The definitions live in the medium-neutral ``vllm.v1.kv_offload.mediums`` (so that the connector
can name them without importing the CPU tier); they are re-exported here for existing imports.
"""

from __future__ import annotations

from vllm.v1.kv_offload.mediums import CPU_MEDIUM, CPULoadStoreSpec

__all__ = ["CPU_MEDIUM", "CPULoadStoreSpec"]
