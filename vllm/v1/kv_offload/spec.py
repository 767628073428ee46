"""``OffloadingSpec``: what one engine run offloads, and the object that builds its managers.

A spec combines the parsed ``kv_connector_extra_config`` (``OffloadingConfig``) with the facts
of the run that fix the bytes of a block (``KVCacheRunInfo``: model, dtype, KV layout, block
sizes, parallel sizes). Specs build the scheduler-side manager; worker-side objects are built by
the worker from the same spec.
"""

from __future__ import annotations

import math
import mmap
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from vllm.v1.kv_offload.base import OffloadingManager
from vllm.v1.kv_offload.config import OffloadingConfig


def round_up(value: int, multiple: int) -> int:
    """Round ``value`` up to a multiple of ``multiple`` (> 0)."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class KVCacheRunInfo:
    """Facts about the run that determine the bytes of an offloaded block.

    Attributes:
        model_name: model identifier (part of the on-disk identity of a block).
        dtype: KV-cache dtype name, e.g. ``"float16"``.
        kv_layout: the GPU KV-cache layout name (e.g. ``"cross_layer"``), part of the identity.
        num_layers: attention layers holding KV cache.
        num_kv_heads: KV heads per worker.
        head_size: elements per head.
        gpu_block_sizes: tokens per GPU block, one entry per KV-cache group.
        gpu_kv_bytes_per_block: bytes one GPU block id occupies on ONE worker, summed over every KV
            tensor (all layers, K and V), padding included.
        tensor_parallel_size: tensor-parallel workers.
        pipeline_parallel_size: pipeline-parallel stages.
        instance_id: unique id of this engine instance (names its shared host region).
    """

    model_name: str
    dtype: str
    kv_layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    gpu_block_sizes: tuple[int, ...]
    gpu_kv_bytes_per_block: int
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    instance_id: str = "default"

    def __post_init__(self) -> None:
        if not self.gpu_block_sizes or any(b <= 0 for b in self.gpu_block_sizes):
            raise ValueError(f"gpu_block_sizes must be positive, got {self.gpu_block_sizes}")
        for name in (
            "num_layers",
            "num_kv_heads",
            "head_size",
            "gpu_kv_bytes_per_block",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def world_size(self) -> int:
        """Workers that each hold a slice of every block."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class OffloadingSpec(ABC):
    """Sizes the offloaded blocks of a run and builds its scheduler-side manager.

    Attributes:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        gpu_block_size: tokens per GPU block, per KV-cache group.
        offloaded_block_size: tokens per offloaded block: ``config.block_size`` if given (a
            multiple of every group's GPU block size), else the lcm of the GPU block sizes.
        block_size_factors: ``offloaded_block_size // gpu_block_size[g]`` per group.
        worker_page_bytes: bytes of one offloaded block on one worker.
        row_bytes: bytes of one primary-tier row (every worker's slice, padded to the page size).
        num_primary_blocks: rows that fit in ``config.cpu_bytes_to_use``.
    """

    BLOCK_SIZE_ALIGNMENT = mmap.PAGESIZE

    SCHEDULER_MAPS_REGION: ClassVar[bool] = False
    """Whether the scheduler side maps the shared host region too, besides every worker rank.

    Every participant passes it to ``SharedOffloadRegion(expect_scheduler=...)``: the region's
    name is removed once all expected participants joined, so the two sides must agree.
    """

    def __init__(self, config: OffloadingConfig, run: KVCacheRunInfo) -> None:
        self.config = config
        self.run = run
        self.gpu_block_size: tuple[int, ...] = run.gpu_block_sizes
        lcm = math.lcm(*run.gpu_block_sizes)
        if config.block_size is None:
            self.offloaded_block_size = lcm
        else:
            if config.block_size % lcm:
                raise ValueError(
                    f"block_size={config.block_size} must be a multiple of every GPU block size "
                    f"{list(run.gpu_block_sizes)}"
                )
            self.offloaded_block_size = config.block_size
        self.block_size_factors = tuple(self.offloaded_block_size // b for b in run.gpu_block_sizes)
        self.worker_page_bytes = run.gpu_kv_bytes_per_block * max(self.block_size_factors)
        self.row_bytes = round_up(
            self.worker_page_bytes * run.world_size, self.BLOCK_SIZE_ALIGNMENT
        )
        self.num_primary_blocks = config.cpu_bytes_to_use // self.row_bytes
        if self.num_primary_blocks < 1:
            raise ValueError(
                f"cpu_bytes_to_use={config.cpu_bytes_to_use} is smaller than one offloaded block "
                f"({self.row_bytes} bytes across {run.world_size} worker(s))"
            )

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """Return the scheduler-side manager (created on first call, then cached)."""
