# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The model's compute stream, which GPU -> CPU stores are ordered after."""

from __future__ import annotations

from collections.abc import Callable

import torch

ComputeStreamFn = Callable[[], int]
"""Returns the ``cudaStream_t`` handle (as an int; 0 = legacy default stream) of the stream the
model's compute runs on, on the KV cache's device; stores are ordered after the work enqueued on
it so far."""


def current_compute_stream(device: int | None = None) -> int:
    """torch's current CUDA stream on ``device`` (default: torch's current device) as a handle.

    Returns 0 (the legacy default stream) when torch has no CUDA, e.g. a CPU build of torch
    driving the CUDA library directly; the model then runs on the legacy stream, if on any.
    """
    if torch.cuda.is_available():
        return int(torch.cuda.current_stream(device).cuda_stream)
    return 0
