# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Engine-facing scheduler types: block hashing and the scheduler's per-step output."""
