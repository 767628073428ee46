# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The model the engine serves: a Llama-architecture transformer (``models/llama.py``) built from
batch-invariant layers (``layers/``) whose attention reads the engine's paged KV cache."""
