# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Exceptions of the block copy operations (re-exported by ``vllm._custom_ops``)."""

from __future__ import annotations


class CopyArgumentError(ValueError):
    """A copy was refused because of its arguments; nothing was enqueued or copied."""


class CudaCopyError(RuntimeError):
    """A CUDA call of the copy library failed, or CUDA is unusable (see the message)."""
