# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""CPU primary tier: block pool, cache policies, shared host region and GPU<->CPU handlers."""
