# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Worker side of KV offloading: transfer handlers and the worker that routes jobs to them."""
