# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""vLLM v1 engine components used by the KV-cache offload subsystem."""
