# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Throughput of the filesystem tier against plain sequential file I/O on the same filesystem.

For each block size, in the same run and the same directory:

* baseline store: one file per block, ``os.write`` of the row + ``os.fsync`` + close, one block
  after another (the same durability the tier gives: every stored block is on disk);
* tier store: ``FileSystemSecondaryTier.submit_store`` of every block (jobs of
  ``--blocks-per-job``), then ``drain_jobs()``; each block is checksummed, written to a temporary
  file, fsynced, renamed and its directory fsynced;
* baseline load: cold (the files' pages are dropped with ``POSIX_FADV_DONTNEED``), one file after
  another, ``os.readv`` straight into the row;
* tier load: cold likewise, ``submit_load`` + ``drain_jobs()``, verified (header + CRC-32) into
  the rows; the loaded rows are then compared with what was stored.

Throughput counts payload bytes (the rows); the tier's 4 KiB header per file is overhead it pays.
Reported numbers are the median of ``--repeat`` runs.

With ``--integrity``, every size is also measured with a fleet secret (keyed integrity: an
HMAC-SHA256 of each block on store and on load), in the same run and against the same baseline:
the ``keyed / unkeyed`` ratios are what the MAC costs.

Usage::

    python benchmarks/kv_offload/bench_fs.py --dir /path/on/the/filesystem [--sizes 256K,2M,8M]
        [--integrity]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import bench_keys, bench_spec

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.fs.config import parse_size
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier

GiB = float(1 << 30)


@dataclass
class Result:
    """Throughputs in GiB/s: ``*_gib_s`` from the median run, ``*_best_gib_s`` from the fastest
    (the one least disturbed by other processes)."""

    block_bytes: int
    num_blocks: int
    o_direct: bool
    keyed: bool
    baseline_store_gib_s: float
    tier_store_gib_s: float
    baseline_load_gib_s: float
    tier_load_gib_s: float
    baseline_store_best_gib_s: float
    tier_store_best_gib_s: float
    baseline_load_best_gib_s: float
    tier_load_best_gib_s: float

    @property
    def store_ratio(self) -> float:
        return self.tier_store_gib_s / self.baseline_store_gib_s

    @property
    def load_ratio(self) -> float:
        return self.tier_load_gib_s / self.baseline_load_gib_s

    @property
    def store_ratio_best(self) -> float:
        return self.tier_store_best_gib_s / self.baseline_store_best_gib_s

    @property
    def load_ratio_best(self) -> float:
        return self.tier_load_best_gib_s / self.baseline_load_best_gib_s


def _drop_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn: Callable[..., None], *args: Any, **kwargs: Any) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def plain_store(flat: memoryview, block_bytes: int, rows: list[int], paths: list[Path]) -> None:
    """Baseline store: per block, a new file, ``os.write`` of the row, ``os.fsync``."""
    for row, path in zip(rows, paths, strict=True):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with flat[row * block_bytes : (row + 1) * block_bytes] as data:
                done = 0
                while done < block_bytes:
                    done += os.write(fd, data[done:])
            os.fsync(fd)
        finally:
            os.close(fd)


def plain_load(flat: memoryview, block_bytes: int, rows: list[int], paths: list[Path]) -> None:
    """Baseline load: per block, ``os.readv`` of the file straight into the row."""
    for row, path in zip(rows, paths, strict=True):
        fd = os.open(path, os.O_RDONLY)
        try:
            with flat[row * block_bytes : (row + 1) * block_bytes] as data:
                done = 0
                while done < block_bytes:
                    got = os.readv(fd, [data[done:]])
                    if got == 0:
                        raise EOFError(path)
                    done += got
        finally:
            os.close(fd)


def tier_transfer(
    tier: FileSystemSecondaryTier,
    keys: list[OffloadKey],
    rows: list[int],
    *,
    load: bool,
    blocks_per_job: int,
    first_job_id: int,
) -> None:
    """Submit every block (jobs of ``blocks_per_job``) and wait for all of them."""
    ctx = ReqContext("bench")
    for job_id, start in enumerate(range(0, len(keys), blocks_per_job), first_job_id):
        job = JobMetadata(
            job_id=job_id,
            keys=keys[start : start + blocks_per_job],
            block_ids=np.array(rows[start : start + blocks_per_job], dtype=np.int64),
            is_promotion=load,
            req_context=ctx,
        )
        (tier.submit_load if load else tier.submit_store)(job)
    tier.drain_jobs()
    assert all(r.success for r in tier.get_finished_jobs()), "a tier job failed"


def bench_size(
    base_dir: Path,
    block_bytes: int,
    total_bytes: int,
    repeat: int,
    n_read: int,
    n_write: int,
    blocks_per_job: int,
    o_direct_mode: bool | str = "auto",
    key_file: str | None = None,
) -> Result:
    """Baseline and tier, store and load, ``repeat`` times; the tier signs and checks every
    block with the secret in ``key_file`` if given."""
    num_blocks = max(1, total_bytes // block_bytes)
    mm = mmap.mmap(-1, 2 * num_blocks * block_bytes)  # source rows, then destination rows
    view = memoryview(mm).cast("B", (2 * num_blocks, block_bytes))
    flat = memoryview(mm)
    rows = np.frombuffer(mm, dtype=np.uint8).reshape(2 * num_blocks, block_bytes)
    rows[:num_blocks] = np.random.default_rng(0).integers(
        0, 256, (num_blocks, block_bytes), dtype=np.uint8
    )
    rows[num_blocks:] = 0  # fault the destination rows in before timing
    src = list(range(num_blocks))
    dst = list(range(num_blocks, 2 * num_blocks))
    spec = bench_spec(block_bytes, 2 * num_blocks)
    samples: dict[str, list[float]] = {k: [] for k in ("bs", "ts", "bl", "tl")}
    o_direct = False
    try:
        for rep in range(repeat):
            plain = base_dir / f"plain_{block_bytes}_{rep}"
            plain.mkdir()
            paths = [plain / f"{i}.blk" for i in range(num_blocks)]
            samples["bs"].append(_timed(plain_store, flat, block_bytes, src, paths))
            _drop_cache(paths)
            samples["bl"].append(_timed(plain_load, flat, block_bytes, dst, paths))
            assert np.array_equal(rows[num_blocks:], rows[:num_blocks]), "baseline loads differ"
            rows[num_blocks:] = 0
            shutil.rmtree(plain)

            root = base_dir / f"tier_{block_bytes}_{rep}"
            tier = FileSystemSecondaryTier(
                spec,
                view,
                "fs",
                root_dir=str(root),
                n_read_threads=n_read,
                n_write_threads=n_write,
                min_free_bytes=0,
                o_direct=o_direct_mode,
                **({} if key_file is None else {"integrity_key_file": key_file}),
            )
            try:
                tier.wait_for_scan(60)
                o_direct = tier.uses_o_direct
                keys = bench_keys(num_blocks, rep)
                samples["ts"].append(
                    _timed(tier_transfer, tier, keys, src, load=False,
                           blocks_per_job=blocks_per_job, first_job_id=0)
                )  # fmt: skip
                _drop_cache(sorted(Path(tier.rank_dir).rglob("*.bin")))
                samples["tl"].append(
                    _timed(tier_transfer, tier, keys, dst, load=True,
                           blocks_per_job=blocks_per_job, first_job_id=num_blocks)
                )  # fmt: skip
                assert np.array_equal(rows[num_blocks:], rows[:num_blocks]), "tier loads differ"
                rows[num_blocks:] = 0
            finally:
                tier.shutdown()
            shutil.rmtree(root)
    finally:
        del rows
        flat.release()
        view.release()
        mm.close()

    def rate(key: str, best: bool = False) -> float:
        seconds = min(samples[key]) if best else statistics.median(samples[key])
        return num_blocks * block_bytes / seconds / GiB

    return Result(
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        o_direct=o_direct,
        keyed=key_file is not None,
        baseline_store_gib_s=rate("bs"),
        tier_store_gib_s=rate("ts"),
        baseline_load_gib_s=rate("bl"),
        tier_load_gib_s=rate("tl"),
        baseline_store_best_gib_s=rate("bs", True),
        tier_store_best_gib_s=rate("ts", True),
        baseline_load_best_gib_s=rate("bl", True),
        tier_load_best_gib_s=rate("tl", True),
    )


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="directory on the filesystem to measure")
    parser.add_argument("--sizes", default="256K,2M,8M", help="block sizes (comma-separated)")
    parser.add_argument("--total", default="512MiB", help="bytes moved per size and direction")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--read-threads", type=int, default=8)
    parser.add_argument("--write-threads", type=int, default=8)
    parser.add_argument("--blocks-per-job", type=int, default=8)
    parser.add_argument(
        "--o-direct", choices=("auto", "on", "off"), default="auto", help="the tier's o_direct"
    )
    parser.add_argument(
        "--integrity",
        action="store_true",
        help="also measure every size with a fleet secret (keyed integrity: MAC per block)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)

    parent = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    base_dir = Path(tempfile.mkdtemp(prefix="bench_fs_", dir=parent))
    o_direct_mode: bool | str = {"on": True, "off": False}.get(args.o_direct, "auto")
    results: list[Result] = []
    key_files: list[str | None] = [None]
    if args.integrity:
        key_path = base_dir / "fleet.key"
        key_path.write_bytes(os.urandom(32))
        key_path.chmod(0o600)
        key_files.append(str(key_path))
    try:
        for size in args.sizes.split(","):
            for key_file in key_files:
                results.append(
                    bench_size(
                        base_dir,
                        parse_size("--sizes", size),
                        parse_size("--total", args.total),
                        args.repeat,
                        args.read_threads,
                        args.write_threads,
                        args.blocks_per_job,
                        o_direct_mode,
                        key_file,
                    )
                )
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)

    print(f"filesystem: {parent} ({os.cpu_count()} CPUs); {args.repeat} runs; GiB/s (median)")
    print(
        "| block | blocks | O_DIRECT | MAC | store: baseline | store: tier | ratio | ratio (best) "
        "| load: baseline | load: tier | ratio | ratio (best) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {_fmt_size(r.block_bytes)} | {r.num_blocks} | {'yes' if r.o_direct else 'no'} "
            f"| {'yes' if r.keyed else 'no'} "
            f"| {r.baseline_store_gib_s:.2f} | {r.tier_store_gib_s:.2f} | {r.store_ratio:.2f} "
            f"| {r.store_ratio_best:.2f} "
            f"| {r.baseline_load_gib_s:.2f} | {r.tier_load_gib_s:.2f} | {r.load_ratio:.2f} "
            f"| {r.load_ratio_best:.2f} |"
        )
    if args.integrity:
        # Each keyed row follows its unkeyed row: the MAC's cost, against the same baseline.
        for plain, keyed in zip(results[::2], results[1::2], strict=True):
            print(
                f"MAC cost at {_fmt_size(plain.block_bytes)}: keyed / unkeyed tier throughput, "
                f"store {keyed.store_ratio / plain.store_ratio:.2f} "
                f"(best {keyed.store_ratio_best / plain.store_ratio_best:.2f}), "
                f"load {keyed.load_ratio / plain.load_ratio:.2f} "
                f"(best {keyed.load_ratio_best / plain.load_ratio_best:.2f})"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                [
                    asdict(r)
                    | {
                        "store_ratio": r.store_ratio,
                        "load_ratio": r.load_ratio,
                        "store_ratio_best": r.store_ratio_best,
                        "load_ratio_best": r.load_ratio_best,
                    }
                    for r in results
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
