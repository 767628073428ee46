"""Transfer descriptors of the CPU primary tier."""

from __future__ import annotations

from typing_extensions import override

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec

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

    @staticmethod
    @override
    def medium() -> str:
        return CPU_MEDIUM
