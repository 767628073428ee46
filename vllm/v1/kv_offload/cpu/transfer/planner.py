# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Planning of GPU <-> CPU transfer jobs: a job's specs -> one ``copy_blocks`` call.

Job semantics (both directions), for a GPU spec with ``group_sizes`` ``n_g`` and ``block_indices``
``i_g`` and a CPU spec: GPU block ids are ordered by group; so are CPU block ids, group ``g`` taking
``ceil((s_g + n_g) / k_g)`` of them, where ``k_g`` is the group's block-size factor and
``s_g = i_g % k_g`` sub-blocks of the group's first CPU block are skipped (a load whose first
offloaded block is only partly needed). GPU block ``m`` of the group (0-based) pairs with
sub-block ``(s_g + m) % k_g`` of the group's CPU block ``(s_g + m) // k_g``. Every layer (canonical
tensor) of the group moves in the same job.

A job writes each destination once: no GPU block twice (groups sharing a GPU tensor checked
together), no CPU sub-block twice, and no CPU row for two groups whose CPU bytes can overlap
(groups sharing a tensor, or whose views alias as per-group rows do): a row holds one key, so
one group's block.

A plan is checked here, once: the region templates at construction (``check_copy_blocks`` with
the real extents), each job's ids (bounds, repeated destinations) when it is planned; the handler
hands it to the copy without ``copy_blocks``' checks.

Memory on both sides is described in ``vllm.v1.kv_offload.cpu.transfer.gpu_worker`` (CPU views) and
``vllm.v1.kv_offload.worker.canonical`` (GPU pages); the resulting regions follow
``vllm.kv_copy.regions``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
import torch

from vllm import _custom_ops as ops
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches

# Up to this many ids, a job's checks run in Python (numpy's per-call cost is more, and its sort
# releases the GIL: see _repeated).
_SMALL_JOB: Final = 64
# Region arrays kept per planner (one per job shape, see JobPlanner._regions).
_REGION_CACHE: Final = 1024


@dataclass(frozen=True)
class TransferPlan:
    """One job as a ``copy_blocks`` call.

    Attributes:
        regions: ``REGION_DTYPE`` array, one region per (group, canonical tensor of the group).
        src_ids, dst_ids: the pairs' ids (GPU block ids on the GPU side, CPU sub-block ids
            ``row * k + j`` on the CPU side).
        num_bytes: bytes the job moves.
    """

    regions: ops.RegionArray
    src_ids: npt.NDArray[np.int64]
    dst_ids: npt.NDArray[np.int64]
    num_bytes: int


class JobPlanner:
    """Turns a job's specs into one ``copy_blocks`` call for one direction.

    Region templates (everything but the pair range) are built once per group; a job only fills
    in pair ranges and id arrays, so planning costs O(blocks of the job + regions).

    Args:
        kv_caches: the worker's canonical GPU KV caches.
        cpu_views: one CPU view per canonical tensor (see ``gpu_worker``); the planner reads their
            addresses, row strides and row lengths only.
        factors: block-size factor ``k_g`` per group.
        num_cpu_blocks: CPU rows.
        store: True for GPU -> CPU jobs, False for CPU -> GPU.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        cpu_views: Sequence[torch.Tensor],
        factors: tuple[int, ...],
        num_cpu_blocks: int,
        store: bool,
    ) -> None:
        self._factors = factors
        self._max_factor = max(factors)
        self._num_cpu_blocks = num_cpu_blocks
        self._store = store
        self._templates: list[ops.RegionArray] = []
        self._group_bytes: list[int] = []
        self._num_gpu_blocks: list[int] = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            regions = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx]
                view = cpu_views[ref.tensor_idx]
                gpu = ops.BlockSide(
                    base=t.ptr,
                    block_stride=t.row_stride_bytes,
                    num_blocks=t.num_blocks,
                    sub_stride=t.page_size_bytes,
                )
                cpu = ops.BlockSide(
                    base=view.data_ptr(),
                    block_stride=int(view.stride(0)),
                    num_blocks=num_cpu_blocks,
                    sub_blocks=factors[g],
                    sub_stride=t.page_size_bytes,
                )
                src, dst = (gpu, cpu) if store else (cpu, gpu)
                regions.append(ops.CopyRegion(src, dst, ref.page_size_bytes, 0, 0))
            template = ops.make_regions(regions)
            # Validates everything but ids once, with the real extents.
            ops.check_copy_blocks(template, np.zeros(0, np.int64), np.zeros(0, np.int64))
            self._templates.append(template)
            self._group_bytes.append(sum(ref.page_size_bytes for ref in refs))
            self._num_gpu_blocks.append(
                min(kv_caches.tensors[r.tensor_idx].num_blocks for r in refs)
            )
        # Groups that can write the same bytes have their destinations checked for collisions
        # together (connected components). Loads write GPU pages: groups that share a tensor.
        # Stores write CPU rows: groups that share a tensor, and groups whose CPU views alias
        # (per-group rows: every group's views start at the same offset of a row).
        parent = list(range(kv_caches.num_groups))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        first_user: dict[int, int] = {}
        for g, refs in enumerate(kv_caches.group_data_refs):
            for ref in refs:
                other = first_user.setdefault(ref.tensor_idx, g)
                parent[find(g)] = find(other)
        if store:
            spans: list[tuple[int, int, int, int]] = []  # (row 0's start, its end, stride, group)
            for g, refs in enumerate(kv_caches.group_data_refs):
                for ref in refs:
                    view = cpu_views[ref.tensor_idx]
                    start = view.data_ptr()
                    spans.append((start, start + int(view.shape[1]), int(view.stride(0)), g))
            for i, (s0, e0, st0, g0) in enumerate(spans):
                for s1, e1, st1, g1 in spans[i + 1 :]:
                    # ``_check_cpu_views`` admits overlap only of views with one row stride
                    # inside one row, so row 0's byte ranges tell whether any rows alias.
                    if g0 != g1 and st0 == st1 and s0 < e1 and s1 < e0:
                        parent[find(g0)] = find(g1)
        self._cluster = [find(g) for g in range(kv_caches.num_groups)]
        self._shared_clusters = {c for c in self._cluster if self._cluster.count(c) > 1}
        self._region_cache: dict[tuple[tuple[int, int], ...], ops.RegionArray] = {}

    def plan(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec) -> TransferPlan:
        """The ``copy_blocks`` call of one job (see the module docstring for the pairing).

        Raises:
            ValueError: the specs do not fit the KV cache (group count, block ranges, CPU block
                count), or the job would write one GPU block or CPU sub-block twice.
        """
        num_groups = len(self._templates)
        if len(gpu_spec.group_sizes) != num_groups:
            raise ValueError(
                f"the GPU spec has {len(gpu_spec.group_sizes)} groups, the KV cache has "
                f"{num_groups}"
            )
        gpu_ids, cpu_ids = gpu_spec.block_ids, cpu_spec.block_ids
        gpu_parts: list[npt.NDArray[np.int64]] = []
        cpu_parts: list[npt.NDArray[np.int64]] = []
        dst_keys: dict[int, list[npt.NDArray[np.int64]]] = {}
        group_rows: dict[int, list[npt.NDArray[np.int64]]] = {}
        ranges: list[tuple[int, int]] = []  # (group, its blocks) per group with blocks
        gpu_off = cpu_off = num_bytes = 0
        for g, n in enumerate(gpu_spec.group_sizes):
            if n == 0:
                continue
            k = self._factors[g]
            skip = gpu_spec.block_indices[g] % k
            n_cpu = -(-(skip + n) // k)
            cpu_g = cpu_ids[cpu_off : cpu_off + n_cpu]
            if len(cpu_g) != n_cpu:
                raise ValueError(
                    f"group {g}: {n} GPU blocks starting at sub-block {skip} need {n_cpu} CPU "
                    f"blocks, the CPU spec has {len(cpu_ids) - cpu_off} left"
                )
            gpu_g = gpu_ids[gpu_off : gpu_off + n]
            # The specs' ids are non-negative int64 (BlockIDsLoadStoreSpec); a job's few ids
            # are bounded in Python (a numpy reduction costs more).
            cpu_max = _largest(cpu_g)
            if cpu_max >= self._num_cpu_blocks:
                raise ValueError(
                    f"group {g}: CPU block {cpu_max} is outside [0, {self._num_cpu_blocks})"
                )
            gpu_max = _largest(gpu_g)
            if gpu_max >= self._num_gpu_blocks[g]:
                raise ValueError(
                    f"group {g}: GPU block {gpu_max} is outside [0, {self._num_gpu_blocks[g]})"
                )
            if k == 1:
                sub = cpu_g
            else:
                sub = (cpu_g[:, None] * k + np.arange(k, dtype=np.int64)).ravel()[skip : skip + n]
            gpu_parts.append(gpu_g)
            cpu_parts.append(sub)
            ranges.append((g, n))
            # Destination slots in a group-independent numbering, to catch two groups of one
            # cluster writing the same page. A store's are CPU rows: a row is one key's, of one
            # group, so two groups of a cluster storing into one row collide whatever their
            # sub-blocks (with aliased views their bytes overlap); within a group, its
            # sub-blocks must differ.
            if self._store:
                key = sub if self._max_factor == 1 else (sub // k) * self._max_factor + sub % k
                if self._cluster[g] in self._shared_clusters:
                    # A group's own rows may repeat (sub-blocks of one row); across groups not.
                    group_rows.setdefault(self._cluster[g], []).append(np.unique(cpu_g))
            else:
                key = gpu_g
            dst_keys.setdefault(self._cluster[g], []).append(key)
            num_bytes += n * self._group_bytes[g]
            gpu_off += n
            cpu_off += n_cpu
        if cpu_off != len(cpu_ids):
            raise ValueError(f"the CPU spec has {len(cpu_ids)} blocks, the job uses {cpu_off}")
        for keys in dst_keys.values():
            flat = np.concatenate(keys) if len(keys) > 1 else keys[0]
            dup = _repeated(flat)
            if dup:
                k_max = self._max_factor
                where = (
                    [f"CPU row {d // k_max} sub-block {d % k_max}" for d in dup]
                    if self._store
                    else [f"GPU block {d}" for d in dup]
                )
                raise ValueError(f"the job writes more than once to: {', '.join(where)}")
        for rows_per_group in group_rows.values():
            if len(rows_per_group) < 2:
                continue
            dup = _repeated(np.concatenate(rows_per_group))
            if dup:
                rows = ", ".join(str(r) for r in dup)
                raise ValueError(
                    f"the job stores more than one group's block into CPU row(s) {rows}"
                )
        if not ranges:
            empty = np.zeros(0, dtype=np.int64)
            return TransferPlan(np.zeros(0, dtype=ops.REGION_DTYPE), empty, empty, 0)
        if len(ranges) == 1:
            gpu_all, cpu_all = gpu_parts[0], cpu_parts[0]
        else:
            gpu_all, cpu_all = np.concatenate(gpu_parts), np.concatenate(cpu_parts)
        src, dst = (gpu_all, cpu_all) if self._store else (cpu_all, gpu_all)
        return TransferPlan(self._regions(tuple(ranges)), src, dst, num_bytes)

    def _regions(self, ranges: tuple[tuple[int, int], ...]) -> ops.RegionArray:
        """The job's regions: each group's template with its pair range, groups in order.

        Jobs repeat a few shapes (blocks per group), so the arrays are kept, read-only, for up to
        ``_REGION_CACHE`` shapes (all dropped when full): the host copy recognises a geometry by
        their bytes.
        """
        regions = self._region_cache.get(ranges)
        if regions is None:
            parts, pairs = [], 0
            for g, n in ranges:
                part = self._templates[g].copy()
                part["pair_begin"] = pairs
                part["pair_count"] = n
                parts.append(part)
                pairs += n
            regions = parts[0] if len(parts) == 1 else np.concatenate(parts)
            regions.flags.writeable = False
            if len(self._region_cache) >= _REGION_CACHE:
                self._region_cache.clear()
            self._region_cache[ranges] = regions
        return regions


def _largest(ids: npt.NDArray[np.int64]) -> int:
    """The largest of a non-empty array of ids."""
    return max(ids.tolist()) if len(ids) <= _SMALL_JOB else int(ids.max())


def _repeated(ids: npt.NDArray[np.int64], most: int = 4) -> list[int]:
    """Up to ``most`` values that occur more than once in ``ids``, smallest first ([] if none).

    A job's check runs on every transfer: a few ids are checked with a Python set (numpy's sort
    releases the GIL, and re-taking it can wait for a tier's thread), more with one sort and
    one comparison (``np.unique`` with counts costs several times more).
    """
    if len(ids) <= _SMALL_JOB:
        values = ids.tolist()
        if len(set(values)) == len(values):
            return []
    ordered = np.sort(ids)
    same = ordered[1:] == ordered[:-1]
    if not same.any():
        return []
    return [int(x) for x in np.unique(ordered[1:][same])[:most]]
