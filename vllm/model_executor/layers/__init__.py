# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Layers of the transformer: batch-invariant primitives, rotary embeddings, paged attention."""
