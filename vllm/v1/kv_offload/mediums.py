# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Transfer descriptors of the built-in media, shared by every layer that names a medium.

A ``LoadStoreSpec`` says where one side of a transfer reads or writes. The scheduler-side manager
produces the offloaded side, the connector pairs it with the GPU side, and the worker routes the
pair to the handler registered for ``(type(src), type(dst))``. These value types sit here, apart
from any medium's implementation, so that code that only passes them around (the connector, the
worker) never imports a concrete medium.

* ``GPULoadStoreSpec`` (defined in ``vllm.v1.kv_offload.base``): GPU blocks, per KV-cache group.
* ``CPULoadStoreSpec``: rows of the CPU primary tier's shared host region.
"""

from __future__ import annotations

import numpy as np
from typing_extensions import Self, override

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, GPULoadStoreSpec

__all__ = ["CPU_MEDIUM", "CPULoadStoreSpec", "GPULoadStoreSpec"]

CPU_MEDIUM = "CPU"
"""Medium name of the CPU primary tier, as used in specs and ``OffloadingEvent.medium``."""


class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU blocks of a transfer.

    Attributes:
        block_ids: 1-D, C-contiguous ``int64`` array of row indices into the CPU region (the shared
            host buffer of ``num_blocks`` rows, one row per offloaded block), in the order of the
            keys of the manager call that produced the spec. Row ``i`` spans bytes
            ``[i * row_bytes, (i + 1) * row_bytes)`` of the region. Owned by the spec; callers
            must not mutate it.
    """

    @classmethod
    def from_rows(cls, rows: list[int]) -> Self:
        """A spec of rows that the CPU tier's own bookkeeping produced, without validation.

        The public constructor checks that arbitrary input is a 1-D sequence of non-negative
        integers below 2**63; rows the manager hands out are so by construction, and the check
        (about a microsecond a spec, two specs per request and step) would only repeat it.

        Args:
            rows: row indices, each in ``[0, num_blocks)``.
        """
        spec = cls.__new__(cls)
        spec.block_ids = np.array(rows, dtype=np.int64)
        return spec

    @staticmethod
    @override
    def medium() -> str:
        return CPU_MEDIUM
