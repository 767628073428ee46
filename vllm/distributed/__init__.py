# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Distributed pieces of the engine: KV events and KV transfer connectors."""
