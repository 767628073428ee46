# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Model definitions (``llama.py``: the Llama architecture with seeded weights and presets)."""
