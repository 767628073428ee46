# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Multi-tier offloading: a CPU primary tier fronting write-through secondary tiers."""
