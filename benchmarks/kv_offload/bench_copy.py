# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Throughput of batched KV-block copies: a job of N scattered blocks vs one contiguous copy.

For every copy path this machine can run (``torch`` always; ``cuda-dma``, ``cuda-dma-loop`` and
``cuda-kernel`` when the CUDA library is built and a GPU is visible), every block size and both
directions (store = GPU -> CPU, load = CPU -> GPU), it times one ``copy_blocks`` job that moves N
blocks between random, distinct block ids of a GPU-side pool and a CPU-side pool (each pool holds
2N blocks), and, in the same run, one contiguous copy of the same total bytes (the baseline):

* torch path: the "GPU" pool is host memory; baseline ``torch.Tensor.copy_`` (multi-threaded).
* CUDA paths: device memory vs pinned, mapped host memory; baseline one ``cudaMemcpyAsync`` of
  the total bytes, timed with events on the same stream. ``cuda-auto`` rows time the path
  ``CopyMethodPolicy`` picks for the job (the engine's default choice by chunk size and
  direction), named in parentheses.

Job and contiguous copies are timed in alternating rounds of 5 repetitions (about ``--reps`` of
each in all, after two warm-ups); GB/s and the ratio (job GB/s / contiguous GB/s) come from the
median times.

Per-layer rows (torch path, ``--layers L``, blocks of ``--layer-block-kib``): the shape of the
engine's jobs with the per-layer KV layout. The "GPU" side is ``2 L`` separate tensors (each
layer's K and V planes, one page of ``block / 2 L`` bytes per block), the CPU side one row of
``block`` bytes per block holding every page; a job of ``--layer-job-blocks`` blocks is ``2 L``
regions, its ids drawn from pools of ``2 N`` blocks (at least ``--layer-pool-blocks``: 256 is
the engine's default GPU pool, whose per-layer tensors are large allocations). Each "GPU"
tensor starts on a memory page, as the engine allocates its host KV tensors
(``--layer-planes heap``: where torch's allocator puts them, at various offsets of a page).
``torch-memmove`` rows time, in the same run, the torch backend's previous design (one
``ctypes.memmove`` per merged copy, after the same checks). The last column is the calling
thread's CPU per job (the engine thread's cost; a large job's helper threads not counted). The
baseline is one contiguous copy of the job's bytes on one thread (``np.copyto``, a ``memcpy``):
the job's own copies are single-threaded below 4 MiB, and torch's multi-threaded ``copy_`` of a
few MiB mostly measures its threads' wake-up on a busy machine. ``--cpu-per-job`` prints only
that last column, for ``--reps`` jobs back to back with nothing in between: the figure to
compare small jobs by (between the bandwidth rows' baseline copies it swings by 2x).

Device memory comes from the test helpers in ``tests/cuda_helpers.py`` (no CUDA build of torch
is needed); the script puts the repository root on ``sys.path`` for them. The CUDA paths run on
device 0.

Example::

    python benchmarks/kv_offload/bench_copy.py --job-mib 128 --reps 7 --markdown out.md
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

# The repository root, for tests.cuda_helpers (and this checkout's vllm) when run as a script.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.cuda_helpers import DeviceBuffer, memset_sync
from vllm import _custom_ops as ops

DEVICE = 0
DEFAULT_BLOCK_KIB = (16, 64, 256, 1024, 2048)


@dataclass
class Row:
    path: str
    direction: str
    block_kib: int
    num_blocks: int
    job_gbps: float
    contiguous_gbps: float
    ratio: float
    layout: str = "one region"
    job_thread_cpu_us: float | None = None  # per-layer rows: the calling thread's CPU per job


def _paired(
    job: Callable[[], float], contiguous: Callable[[], float], reps: int
) -> tuple[float, float, float]:
    """Median job time, median contiguous time, and their ratio (contiguous / job time).

    Both are timed in the same run, in alternating rounds of a few consecutive repetitions each
    (after two warm-ups), so that both see the same machine load. Not strictly alternating: after
    torch's multi-threaded ``copy_`` its OpenMP worker keeps spinning on a core for a while, which
    slowed the next (threaded) job by ~20% on a 2-core machine; within a round only its first
    repetition pays that, and the median drops it.
    """
    for _ in range(2):
        job()
        contiguous()
    per_round = 5
    job_times: list[float] = []
    base_times: list[float] = []
    for _ in range(max(1, -(-reps // per_round))):
        job_times += [job() for _ in range(per_round)]
        base_times += [contiguous() for _ in range(per_round)]
    t_job = statistics.median(job_times)
    t_base = statistics.median(base_times)
    return t_job, t_base, t_base / t_job


def _job(
    gpu_base: int, cpu_base: int, block: int, n: int, store: bool, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    gpu_ids = rng.permutation(2 * n)[:n].astype(np.int64)
    cpu_ids = rng.permutation(2 * n)[:n].astype(np.int64)
    gpu = ops.BlockSide(gpu_base, block, 2 * n)
    cpu = ops.BlockSide(cpu_base, block, 2 * n)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    regions = ops.make_regions([ops.CopyRegion(src, dst, block, 0, n)])
    return (regions, gpu_ids, cpu_ids) if store else (regions, cpu_ids, gpu_ids)


def _host_job(regions: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray) -> float:
    t0 = time.perf_counter()
    ops.copy_blocks(regions, src_ids, dst_ids, backend="torch")
    return time.perf_counter() - t0


def _host_memmove_job(regions: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray) -> float:
    """The torch backend before region-wise copies: one ``memmove`` per (merged) copy."""
    t0 = time.perf_counter()
    ops.check_copy_blocks(regions, src_ids, dst_ids)
    ops.host_memmove(*ops.expand_copies(regions, src_ids, dst_ids))
    return time.perf_counter() - t0


def _host_contiguous(dst: torch.Tensor, src: torch.Tensor) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def bench_torch(block: int, n: int, reps: int) -> list[Row]:
    total = block * n
    gpu = torch.randint(-128, 128, (2 * total,), dtype=torch.int8)
    cpu = torch.zeros(2 * total, dtype=torch.int8)
    cpu.fill_(1)  # fault the pages in before timing
    rows = []
    for store in (True, False):
        regions, src_ids, dst_ids = _job(gpu.data_ptr(), cpu.data_ptr(), block, n, store, seed=1)
        src_flat, dst_flat = (gpu, cpu) if store else (cpu, gpu)
        t_job, t_base, ratio = _paired(
            functools.partial(_host_job, regions, src_ids, dst_ids),
            functools.partial(_host_contiguous, dst_flat[total:], src_flat[:total]),
            reps,
        )
        rows.append(
            Row(
                "torch",
                "store" if store else "load",
                block >> 10,
                n,
                total / t_job / 1e9,
                total / t_base / 1e9,
                ratio,
            )
        )
    return rows


def _thread_cpu_us(job: Callable[[], float], reps: int) -> float:
    """Median CPU time of the calling thread per run of ``job`` (its helper threads' excluded:
    what a job costs the engine thread that submits it)."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        job()
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e6


def _memcpy(dst: np.ndarray, src: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def _per_layer_job(
    planes: list[torch.Tensor],
    rows: torch.Tensor,
    page: int,
    n: int,
    store: bool,
    seed: int,
    pool: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A job of ``n`` blocks: one region per plane (GPU tensor) <-> its page in the CPU rows,
    ids drawn from pools of ``pool`` blocks on each side."""
    rng = np.random.default_rng(seed)
    gpu_ids = rng.permutation(pool)[:n].astype(np.int64)
    cpu_ids = rng.permutation(pool)[:n].astype(np.int64)
    row = page * len(planes)
    regions = []
    for j, plane in enumerate(planes):
        gpu = ops.BlockSide(plane.data_ptr(), page, pool)
        cpu = ops.BlockSide(rows.data_ptr() + j * page, row, pool)
        src, dst = (gpu, cpu) if store else (cpu, gpu)
        regions.append(ops.CopyRegion(src, dst, page, 0, n))
    made = ops.make_regions(regions)
    return (made, gpu_ids, cpu_ids) if store else (made, cpu_ids, gpu_ids)


def _plane(nbytes: int, aligned: bool) -> torch.Tensor:
    """Random bytes, starting on a memory page if ``aligned``."""
    if not aligned:
        return torch.randint(-128, 128, (nbytes,), dtype=torch.int8)
    raw = torch.randint(-128, 128, (nbytes + 4096,), dtype=torch.int8)
    start = -raw.data_ptr() % 4096
    return raw[start : start + nbytes]


def _per_layer_memory(
    block: int, layers: int, pool: int, aligned: bool
) -> tuple[int, list[torch.Tensor], torch.Tensor]:
    """The page size, the ``2 layers`` "GPU" planes of ``pool`` pages and the CPU rows."""
    page = block // (2 * layers)
    planes = [_plane(pool * page, aligned) for _ in range(2 * layers)]
    cpu = torch.ones(pool * block, dtype=torch.int8)  # faulted in before timing
    return page, planes, cpu


def bench_torch_per_layer(
    block: int, layers: int, n: int, reps: int, min_pool: int = 0, aligned: bool = True
) -> list[Row]:
    pool = max(2 * n, min_pool)
    page, planes, cpu = _per_layer_memory(block, layers, pool, aligned)
    total = n * block
    flat_src = np.random.default_rng(0).integers(-128, 128, total, dtype=np.int8)
    flat_dst = np.ones(total, dtype=np.int8)
    rows = []
    for store in (True, False):
        regions, src_ids, dst_ids = _per_layer_job(planes, cpu, page, n, store, 1, pool)
        for path, job in (("torch", _host_job), ("torch-memmove", _host_memmove_job)):
            run = functools.partial(job, regions, src_ids, dst_ids)
            t_job, t_base, ratio = _paired(
                run, functools.partial(_memcpy, flat_dst, flat_src), reps
            )
            rows.append(
                Row(
                    path,
                    "store" if store else "load",
                    block >> 10,
                    n,
                    total / t_job / 1e9,
                    total / t_base / 1e9,
                    ratio,
                    f"per-layer, {2 * layers} pages of {page >> 10} KiB",
                    _thread_cpu_us(run, reps),
                )
            )
    return rows


def per_layer_cpu_per_job(
    block: int, layers: int, sizes: list[int], reps: int, min_pool: int, aligned: bool
) -> list[str]:
    """``--cpu-per-job``: the calling thread's CPU per per-layer job, ``reps`` jobs back to back
    and nothing else in between (the bandwidth rows' baseline copies in between made small jobs'
    figures swing by 2x on a 2-core machine), as markdown rows ``| blocks | store | load |``."""
    pool = max(2 * max(sizes), min_pool)
    page, planes, cpu = _per_layer_memory(block, layers, pool, aligned)
    lines = []
    for n in sizes:
        us = []
        for store in (True, False):
            regions, src_ids, dst_ids = _per_layer_job(planes, cpu, page, n, store, 1, pool)
            us.append(_thread_cpu_us(functools.partial(_host_job, regions, src_ids, dst_ids), reps))
        lines.append(f"| {n} | {us[0]:,.0f} us | {us[1]:,.0f} us |")
    return lines


@dataclass
class _CudaTimer:
    lib: ops.CudaCopyLibrary
    stream: ops.CudaStream
    start: ops.CudaEvent
    end: ops.CudaEvent

    def copy(
        self,
        regions: np.ndarray,
        src_ids: np.ndarray,
        dst_ids: np.ndarray,
        method: ops.CopyMethod,
        max_ctas: int,
    ) -> float:
        self.start.record(self.stream.handle)
        self.lib.copy_blocks(
            DEVICE, regions, src_ids, dst_ids, method, max_ctas, self.stream.handle
        )
        self.end.record(self.stream.handle)
        self.end.synchronize()
        return self.start.elapsed_ms(self.end) / 1000.0


def bench_cuda(
    block: int, n: int, reps: int, methods: list[ops.CopyMethod], max_ctas: int
) -> list[Row]:
    lib = ops.cuda_library()
    assert lib is not None
    total = block * n
    # A private mapping: page-aligned and shared with no other allocation, so pinning it cannot
    # collide with another registration.
    host = torch.frombuffer(mmap.mmap(-1, 2 * total), dtype=torch.int8)
    host.fill_(1)
    flags = ops.HOST_REGISTER_PORTABLE | ops.HOST_REGISTER_MAPPED
    owned = lib.host_register(DEVICE, host.data_ptr(), host.numel(), flags)
    dev = DeviceBuffer(lib, 2 * total, DEVICE)
    memset_sync(lib, DEVICE, dev.ptr, 3, 2 * total)
    timer = _CudaTimer(
        lib,
        ops.CudaStream(lib, DEVICE),
        ops.CudaEvent(lib, DEVICE),
        ops.CudaEvent(lib, DEVICE),
    )
    rows = []
    try:
        for store in (True, False):
            regions, src_ids, dst_ids = _job(dev.ptr, host.data_ptr(), block, n, store, seed=1)
            gpu_side = ops.BlockSide(dev.ptr, total, 2)
            cpu_side = ops.BlockSide(host.data_ptr(), total, 2)
            base_src, base_dst = (gpu_side, cpu_side) if store else (cpu_side, gpu_side)
            base = ops.make_regions([ops.CopyRegion(base_src, base_dst, total, 0, 1)])
            # One cudaMemcpyAsync of `total` bytes: block 0 of one side to block 1 of the other.
            contiguous = functools.partial(
                timer.copy,
                base,
                np.zeros(1, np.int64),
                np.ones(1, np.int64),
                ops.CopyMethod.DMA_LOOP,
                0,
            )
            # The path the engine's handlers take for this job (by chunk size and direction).
            chosen = ops.CopyMethodPolicy().choose(regions, src_ids, dst_ids, store=store)
            for method, label in [
                *((m, m.name.lower().replace("_", "-")) for m in methods),
                (chosen, f"auto ({chosen.name.lower().replace('_', '-')})"),
            ]:
                t_job, t_base, ratio = _paired(
                    functools.partial(timer.copy, regions, src_ids, dst_ids, method, max_ctas),
                    contiguous,
                    reps,
                )
                rows.append(
                    Row(
                        "cuda-" + label,
                        "store" if store else "load",
                        block >> 10,
                        n,
                        total / t_job / 1e9,
                        total / t_base / 1e9,
                        ratio,
                    )
                )
    finally:
        for r in (timer.start, timer.end, timer.stream, dev):
            r.close()
        if owned:
            lib.host_unregister(DEVICE, host.data_ptr())
    return rows


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} CPUs, torch {torch.__version__} ({threads} threads)"


def to_markdown(rows: list[Row]) -> str:
    out = [
        "| path | layout | direction | block | blocks | job GB/s | contiguous GB/s | ratio "
        "| calling thread's CPU per job |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        size = f"{r.block_kib} KiB" if r.block_kib < 1024 else f"{r.block_kib >> 10} MiB"
        cpu = "-" if r.job_thread_cpu_us is None else f"{r.job_thread_cpu_us:,.0f} us"
        out.append(
            f"| {r.path} | {r.layout} | {r.direction} | {size} | {r.num_blocks} | "
            f"{r.job_gbps:.2f} | {r.contiguous_gbps:.2f} | {r.ratio:.2f} | {cpu} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--block-kib", type=int, nargs="+", default=list(DEFAULT_BLOCK_KIB))
    p.add_argument("--job-mib", type=int, default=128, help="bytes moved per job (N = job / block)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--paths", nargs="+", default=["torch", "cuda"], choices=["torch", "cuda"])
    p.add_argument("--max-ctas", type=int, default=0, help="kernel path thread blocks (0: default)")
    p.add_argument("--layers", type=int, default=8, help="per-layer rows: layers (0: none)")
    p.add_argument("--layer-block-kib", type=int, nargs="+", default=[16, 64])
    p.add_argument("--layer-job-blocks", type=int, nargs="+", default=[16, 64, 512])
    p.add_argument(
        "--layer-pool-blocks",
        type=int,
        default=0,
        help="per-layer rows: blocks per pool at least (default 2 N; the engine's GPU pool: 256)",
    )
    p.add_argument(
        "--layer-planes",
        choices=["aligned", "heap"],
        default="aligned",
        help="per-layer rows: 'GPU' tensors from a memory page, as the engine's (default), or "
        "wherever torch allocates them",
    )
    p.add_argument(
        "--cpu-per-job",
        action="store_true",
        help="only the per-layer jobs' calling-thread CPU per job (--reps jobs back to back; "
        "no bandwidth rows)",
    )
    p.add_argument("--markdown", help="also write the table (with command and machine) here")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args(argv)

    if args.cpu_per_job:
        for kib in args.layer_block_kib:
            print(f"per-layer jobs of {kib} KiB blocks, {2 * args.layers} pages each:")
            print("| blocks | store | load |\n|---:|---:|---:|")
            for line in per_layer_cpu_per_job(
                kib << 10,
                args.layers,
                args.layer_job_blocks,
                args.reps,
                args.layer_pool_blocks,
                args.layer_planes == "aligned",
            ):
                print(line)
        return 0
    lib = ops.cuda_library()
    devices = ops.cuda_devices()
    has_gpu = devices.count > 0
    rows: list[Row] = []
    for kib in args.block_kib:
        block = kib << 10
        n = max(4, (args.job_mib << 20) // block)
        if "torch" in args.paths:
            rows += bench_torch(block, n, args.reps)
        if "cuda" in args.paths and has_gpu:
            methods = list(ops.CopyMethod)
            rows += bench_cuda(block, n, args.reps, methods, args.max_ctas)
    if "torch" in args.paths and args.layers:
        for kib in args.layer_block_kib:
            for n in args.layer_job_blocks:
                rows += bench_torch_per_layer(
                    kib << 10,
                    args.layers,
                    n,
                    args.reps,
                    args.layer_pool_blocks,
                    args.layer_planes == "aligned",
                )
    if "cuda" in args.paths and not has_gpu:
        print(f"CUDA paths skipped: {devices.problem}", file=sys.stderr)
    table = to_markdown(rows)
    cmd = "python " + " ".join(
        [os.path.relpath(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]
    )
    header = f"Command: `{cmd}`\n\nMachine: {machine()}"
    if has_gpu and lib is not None:
        header += f"; CUDA library {os.path.basename(lib.path)}, cuMemcpyBatchAsync "
        header += "available" if lib.dma_batch_available() else "unavailable"
        fallbacks, reason = lib.dma_batch_fallbacks()
        if fallbacks:
            header += f"; {fallbacks} DMA job(s) fell back to the loop: {reason}"
    print(header + "\n\n" + table)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(header + "\n\n" + table + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
