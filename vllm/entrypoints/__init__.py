# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""User-facing entry points (the ``vllm-kv-offload`` command)."""
