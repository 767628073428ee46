# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadingSpec``: what one engine run offloads, and the object that builds both its sides.

A spec combines the parsed ``kv_connector_extra_config`` (``OffloadingConfig``) with the facts
of the run that fix the bytes of a block (``KVCacheRunInfo``: model, dtype, KV layout, block
sizes, parallel sizes). The same spec builds the scheduler side (``get_manager``: which blocks
live where) and each worker's side (``get_handlers``: the transfer handlers that move the bytes of
the jobs the manager issues), so a medium's two halves are chosen together and the connector
between them never names a medium.
"""

from __future__ import annotations

import enum
import math
import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from vllm.v1.kv_offload.base import LoadStoreSpec, OffloadingManager, TierStats
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.worker.worker import OffloadingHandler

if TYPE_CHECKING:
    from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches


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
        sliding_windows: per group, the window in tokens of a sliding-window attention group or
            None for full attention; empty: every group has full attention.
        group_kv_bytes_per_block: per group, the bytes one GPU block id of that group occupies
            on ONE worker (its layers' KV tensors); they add up to ``gpu_kv_bytes_per_block``,
            so giving them says that no two groups share a KV tensor, and a spec of several
            groups then sizes its rows per group (``RowLayout.PER_GROUP``). Empty: not known
            per group (every group counts ``gpu_kv_bytes_per_block``; rows hold every group's
            tensors, ``RowLayout.SHARED``).
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
    sliding_windows: tuple[int | None, ...] = ()
    group_kv_bytes_per_block: tuple[int, ...] = ()

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
        group_bytes = self.group_kv_bytes_per_block
        if group_bytes and (
            len(group_bytes) != len(self.gpu_block_sizes)
            or min(group_bytes) <= 0
            or sum(group_bytes) != self.gpu_kv_bytes_per_block
        ):
            raise ValueError(
                f"group_kv_bytes_per_block={group_bytes} needs one positive entry per group "
                f"({len(self.gpu_block_sizes)}) adding up to gpu_kv_bytes_per_block="
                f"{self.gpu_kv_bytes_per_block}"
            )

    def group_bytes_per_block(self, group: int) -> int:
        """Bytes one GPU block id of ``group`` occupies on one worker (all of a block id's bytes
        when not known per group)."""
        if self.group_kv_bytes_per_block:
            return self.group_kv_bytes_per_block[group]
        return self.gpu_kv_bytes_per_block

    @property
    def world_size(self) -> int:
        """Workers that each hold a slice of every block."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


class RowLayout(str, enum.Enum):
    """How a primary-tier row lays out a worker's slot (``OffloadingSpec.row_layout``).

    A key belongs to one KV-cache group and takes one row, so a row only ever holds one group's
    block; the layouts differ in where each group's bytes sit in the slot.
    """

    SHARED = "shared"
    """Every canonical tensor of every group has its own byte range of the slot, one after
    another (what a key of any group could touch): the slot is the sum of all groups' pages.
    The layout of single-group runs, and of multi-group runs whose groups may share tensors
    (``KVCacheRunInfo.group_kv_bytes_per_block`` unknown)."""

    PER_GROUP = "per_group"
    """Each group's tensors are laid out from the start of the slot, so the groups' views alias
    one another: the slot is the largest group's page, not the sum. Multi-group runs whose
    groups use disjoint tensors (``group_kv_bytes_per_block`` known)."""


HandlerRegistration = tuple[type[LoadStoreSpec], type[LoadStoreSpec], OffloadingHandler]
"""``(src spec class, dst spec class, handler)``: the handler serving one direction of transfers
(upstream vLLM's ``get_handlers`` yields the same triples)."""


def _no_op() -> None:
    pass


@dataclass
class WorkerHandlers:
    """A worker rank's transfer handlers, and how to release what they were built on.

    Returned by ``OffloadingSpec.get_handlers``; owned from then on by the caller (the connector's
    worker half), which shuts every registered handler down, drops its references to them, and
    only then calls ``close`` (exactly once).

    Attributes:
        registrations: one handler per ``(src spec class, dst spec class)`` direction.
        close: releases the resources the handlers used (e.g. this rank's mapping of the shared
            host region); called after every handler is shut down. Default: nothing to release.
    """

    registrations: list[HandlerRegistration]
    close: Callable[[], None] = field(default=_no_op)


class OffloadingSpec(ABC):
    """Sizes the offloaded blocks of a run and builds both of its sides.

    ``get_manager`` builds the scheduler side (one manager per engine), ``get_handlers`` the
    worker side (once per worker rank, over the rank's KV caches). The jobs the manager issues
    name ``LoadStoreSpec`` classes; the handlers ``get_handlers`` registers must serve exactly
    those ``(src, dst)`` pairs.

    Attributes:
        config: the parsed ``kv_connector_extra_config``.
        run: the run's block-defining facts.
        gpu_block_size: tokens per GPU block, per KV-cache group.
        offloaded_block_size: tokens per offloaded block: ``config.block_size`` if given (a
            multiple of every group's GPU block size), else the lcm of the GPU block sizes.
        block_size_factors: ``offloaded_block_size // gpu_block_size[g]`` per group.
        group_block_bytes: per group, the bytes of one offloaded block of that group (one key)
            on every worker together: what a load of the key moves.
        row_layout: where each group's bytes sit in a row (``RowLayout``): ``PER_GROUP`` for
            a run of several groups whose bytes per block are known per group, else ``SHARED``.
        worker_page_bytes: bytes of one worker's slot of a row: with ``SHARED`` rows, every
            group's page (``gpu_kv_bytes_per_block`` times the largest factor); with
            ``PER_GROUP`` rows, the largest of the groups' ``group_bytes_per_block(g) * k_g``.
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
        self.group_block_bytes = tuple(
            run.group_bytes_per_block(g) * f * run.world_size
            for g, f in enumerate(self.block_size_factors)
        )
        # A row holds one key, i.e. one group's block: when the groups' tensors are known to be
        # disjoint, sizing the row for the largest group rather than for all of them together
        # gives the primary tier (and every secondary tier's payload) that many more blocks.
        if len(run.gpu_block_sizes) > 1 and run.group_kv_bytes_per_block:
            self.row_layout = RowLayout.PER_GROUP
            self.worker_page_bytes = max(
                run.group_bytes_per_block(g) * f for g, f in enumerate(self.block_size_factors)
            )
        else:
            self.row_layout = RowLayout.SHARED
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
        """Return the scheduler-side manager (created on first call, then cached).

        The connector's scheduler half owns the manager and shuts it down.
        """

    @abstractmethod
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        """Build worker ``rank``'s transfer handlers over its KV caches.

        Called once per worker rank, in the worker, when the connector's worker half registers
        the rank's KV caches (upstream vLLM: ``get_handlers(kv_caches, attn_backends)``). Runs
        after the scheduler side's ``get_manager`` when both live in one process, but must not
        rely on it: a worker process has a spec of its own.

        Args:
            kv_caches: the rank's GPU KV caches in canonical form. Borrowed: the worker owns the
                tensors and keeps them alive until the connector is shut down.
            rank: the worker's rank, in ``[0, run.world_size)``.

        Returns:
            One registration per ``(src, dst)`` direction the manager issues jobs for, and a
            ``close`` callback. Ownership passes to the caller: it shuts every registered handler
            down (which waits for transfers in flight), drops them, then calls ``close`` once.

        Raises:
            ValueError: ``rank`` is out of range or the caches do not fit the spec.
            Any error of acquiring the handlers' resources; the spec releases whatever it had
            acquired before raising, so a caller that gets an exception has nothing to close.
        """

    def get_tier_stats(self) -> list[TierStats]:
        """Point-in-time reports of the secondary tiers behind the primary tier, in lookup order.

        Scheduler side: the tiers are those of the manager ``get_manager`` built (none before it
        is built); tiers that report nothing (``SecondaryTierManager.get_stats`` returns None)
        are left out. Called between steps, on the scheduler thread; no side effect.
        Default: ``[]`` (a spec without secondary tiers).
        """
        return []

    def wait_for_tiers_ready(self, timeout_s: float | None = None) -> bool:
        """Block until every secondary tier finished its start-up work (e.g. indexing what is
        already stored), so that ``get_tier_stats`` reports it.

        Not for the step path: the CLI's runs (``engine_run``, ``bench_ttft``) call it, through
        the engine and the connector, before their first request. Scheduler side, after
        ``get_manager``.

        Args:
            timeout_s: the longest wait, over all tiers; None waits without bound.

        Returns:
            False if ``timeout_s`` expired first. Default: True (nothing to wait for).
        """
        return True
