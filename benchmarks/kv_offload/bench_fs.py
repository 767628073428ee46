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

The tier's process CPU time (every thread, from ``time.process_time``) per GiB moved is recorded
beside the wall-clock throughput.

Throughput counts payload bytes (the rows); the tier's 4 KiB header per file is overhead it pays.
Reported numbers are the median of ``--repeat`` runs.

With ``--integrity``, every size is also measured with a fleet secret (keyed integrity: an
HMAC-SHA256 of each block on store and on load), right after the same size without one: the
``keyed tier / tier without a secret`` ratios, and the CPU per GiB of each, are what the MAC costs.

``--thread-cpu`` measures something else: the CPU the tier's background threads (I/O, lookup,
scan/reconcile) spend per stored block, in a loop shaped like the engine's (per step: a request's
lookups, a store job, every third step a load job, the step end, a few ms of "model"), with the
tier's default settings and ``max_bytes`` (capacity slots on). Thread CPU is read from
``/proc/self/task/<tid>/schedstat`` for every thread but the scheduler's, grouped by thread
name; the scheduler thread's own CPU (``time.thread_time``) and the wall time are shown beside
it. ``--compare-with DIR`` runs the same loop against the package in another checkout (e.g. a
worktree of the commit before a change), alternating the two trees ``--rounds`` times in fresh
processes, and reports the ratio of the medians.

Usage::

    python benchmarks/kv_offload/bench_fs.py --dir /path/on/the/filesystem [--sizes 256K,2M,8M]
        [--integrity]
    python benchmarks/kv_offload/bench_fs.py --thread-cpu --dir DIR [--compare-with OLD_TREE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
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
    tier_store_cpu_s_per_gib: float
    tier_load_cpu_s_per_gib: float
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


def _timed_cpu(cpu: list[float], fn: Callable[..., None], *args: Any, **kwargs: Any) -> float:
    """``_timed``, also appending the CPU time of the whole process (every thread) to ``cpu``."""
    start = time.process_time()
    wall = _timed(fn, *args, **kwargs)
    cpu.append(time.process_time() - start)
    return wall


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
    samples: dict[str, list[float]] = {k: [] for k in ("bs", "ts", "bl", "tl", "tsc", "tlc")}
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
                tier.wait_until_ready(60)
                o_direct = tier.uses_o_direct
                keys = bench_keys(num_blocks, rep)
                samples["ts"].append(
                    _timed_cpu(samples["tsc"], tier_transfer, tier, keys, src, load=False,
                           blocks_per_job=blocks_per_job, first_job_id=0)
                )  # fmt: skip
                _drop_cache(sorted(Path(tier.rank_dir).rglob("*.bin")))
                samples["tl"].append(
                    _timed_cpu(samples["tlc"], tier_transfer, tier, keys, dst, load=True,
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

    payload = num_blocks * block_bytes

    def rate(key: str, best: bool = False) -> float:
        seconds = min(samples[key]) if best else statistics.median(samples[key])
        return num_blocks * block_bytes / seconds / GiB

    return Result(
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        o_direct=o_direct,
        keyed=key_file is not None,
        tier_store_cpu_s_per_gib=statistics.median(samples["tsc"]) * GiB / payload,
        tier_load_cpu_s_per_gib=statistics.median(samples["tlc"]) * GiB / payload,
        baseline_store_gib_s=rate("bs"),
        tier_store_gib_s=rate("ts"),
        baseline_load_gib_s=rate("bl"),
        tier_load_gib_s=rate("tl"),
        baseline_store_best_gib_s=rate("bs", True),
        tier_store_best_gib_s=rate("ts", True),
        baseline_load_best_gib_s=rate("bl", True),
        tier_load_best_gib_s=rate("tl", True),
    )


# ---------------------------------------------------------------------------------------------
# Background-thread CPU per stored block (--thread-cpu)
# ---------------------------------------------------------------------------------------------


def _thread_cpu_ns(native_id: int) -> int:
    """CPU time of one thread of this process (``schedstat``: ns on a CPU); 0 once it ended."""
    try:
        with open(f"/proc/self/task/{native_id}/schedstat") as f:
            return int(f.read().split()[0])
    except OSError:
        return 0


def _background_cpu_ns() -> dict[str, int]:
    """CPU of every live Python thread but the calling one, by name without its index."""
    me = threading.get_native_id()
    by_role: dict[str, int] = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        if tid is None or tid == me:
            continue
        role = thread.name.rstrip("0123456789").rstrip("_")
        by_role[role] = by_role.get(role, 0) + _thread_cpu_ns(tid)
    return by_role


def thread_cpu_child(base_dir: Path, steps: int, step_ms: float, salt: int) -> dict[str, Any]:
    """One measurement, in this process: the engine-shaped loop over a fresh tier."""
    block_bytes, num_rows, per_job, per_load = 64 << 10, 512, 5, 4
    mm = mmap.mmap(-1, num_rows * block_bytes)
    view = memoryview(mm).cast("B", (num_rows, block_bytes))
    np.frombuffer(mm, dtype=np.uint8)[:] = np.random.default_rng(salt).integers(
        0, 256, num_rows * block_bytes, dtype=np.uint8
    )
    root = Path(tempfile.mkdtemp(prefix="thread_cpu_", dir=base_dir))
    tier = FileSystemSecondaryTier(
        bench_spec(block_bytes, num_rows), view, "fs", root_dir=str(root), max_bytes="1GiB"
    )
    try:
        assert tier.wait_until_ready(60)
        keys = bench_keys(steps * per_job, salt)
        stored: list[OffloadKey] = []  # keys of store jobs reported done: loadable
        job_keys: dict[int, tuple[bool, list[OffloadKey]]] = {}
        failed: list[int] = []

        def submit(batch: list[OffloadKey], rows: list[int], load: bool, ctx: ReqContext) -> None:
            job = JobMetadata(
                job_id=len(job_keys),
                keys=tuple(batch),
                block_ids=np.array(rows, dtype=np.int64),
                is_promotion=load,
                req_context=ctx,
            )
            job_keys[job.job_id] = (load, batch)
            (tier.submit_load if load else tier.submit_store)(job)

        def collect() -> None:
            for result in tier.get_finished_jobs():
                load, batch = job_keys[result.job_id]
                if not result.success:
                    failed.append(result.job_id)
                elif not load:
                    stored.extend(batch)

        before = _background_cpu_ns()
        main0, wall0 = time.thread_time(), time.perf_counter()
        for step in range(steps):
            ctx = ReqContext(f"req-{step}")
            new = keys[step * per_job : (step + 1) * per_job]
            for key in stored[-4:] + new[:4]:  # a prefix already stored, then new blocks
                tier.lookup(key, ctx)
            rows = [(step * per_job + i) % (num_rows // 2) for i in range(per_job)]
            submit(new, rows, False, ctx)
            if step % 3 == 2 and len(stored) >= per_load:
                # Each load job its own rows (the manager never lets two loads share a row):
                # windows of per_load rows in the upper half, reused after 64 loads (~2 s).
                base = num_rows // 2 + (step // 3 * per_load) % (num_rows // 2)
                submit(stored[-per_load:], list(range(base, base + per_load)), True, ctx)
            tier.on_schedule_end()
            collect()
            tier.on_request_finished(ctx)
            time.sleep(step_ms / 1000)
        tier.drain_jobs()
        collect()
        wall = time.perf_counter() - wall0
        main_cpu = time.thread_time() - main0
        after = _background_cpu_ns()
        stored_blocks = tier.get_stats().counters.get("blocks_written", 0)
        assert not failed, f"tier jobs failed: {failed}"
    finally:
        tier.shutdown()
        view.release()
        mm.close()
        shutil.rmtree(root, ignore_errors=True)
    cpu = {role: (after.get(role, 0) - before.get(role, 0)) / 1e9 for role in after}
    return {
        "blocks_stored": stored_blocks,
        "wall_s": wall,
        "scheduler_cpu_s": main_cpu,
        "background_cpu_s": cpu,
    }


def _us_per_block(run: dict[str, Any], role: str) -> float:
    return run["background_cpu_s"].get(role, 0) / max(run["blocks_stored"], 1) * 1e6


def bench_thread_cpu(args: argparse.Namespace, base_dir: Path) -> int:
    """Runs ``thread_cpu_child`` in fresh processes for this tree and ``--compare-with``."""
    here = str(Path(__file__).resolve().parents[2])
    trees = ([str(Path(args.compare_with).resolve())] if args.compare_with else []) + [here]
    runs: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for rnd in range(args.rounds):
        for tree in trees if rnd % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run(
                [sys.executable, __file__, "--thread-cpu-child", str(base_dir),
                 str(args.steps), str(args.step_ms), str(rnd)],
                env=env, check=False, capture_output=True, text=True,
            )  # fmt: skip
            if out.returncode:
                raise RuntimeError(f"the run against {tree} failed:\n{out.stderr[-4000:]}")
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"fs tier background threads: {args.steps} steps of {args.step_ms:g} ms, 64 KiB blocks, "
        f"jobs of 5 stores (+4 loads every third step), max_bytes 1GiB, the tier's default "
        f"threads; {args.rounds} rounds, medians; load {os.getloadavg()[0]:.1f} "
        f"({os.cpu_count()} CPUs)"
    )
    print(
        "| tree | blocks stored | wall s | scheduler thread CPU s | background CPU s "
        "| background CPU per stored block (us) | by thread (us per block) |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    per_block: dict[str, float] = {}
    for tree, samples in runs.items():
        blocks = statistics.median(r["blocks_stored"] for r in samples)
        total = [sum(r["background_cpu_s"].values()) for r in samples]
        per_block[tree] = statistics.median(
            t / max(r["blocks_stored"], 1) * 1e6 for t, r in zip(total, samples, strict=True)
        )
        roles = sorted({role for r in samples for role in r["background_cpu_s"]})
        by_role = ", ".join(
            f"{role}: {statistics.median(_us_per_block(r, role) for r in samples):.0f}"
            for role in roles
        )
        print(
            f"| {tree} | {blocks:.0f} | {statistics.median(r['wall_s'] for r in samples):.2f} "
            f"| {statistics.median(r['scheduler_cpu_s'] for r in samples):.2f} "
            f"| {statistics.median(total):.2f} | {per_block[tree]:.0f} | {by_role} |"
        )
    if args.compare_with:
        old, new = trees
        print(
            f"ratio (this tree / {old}): background CPU per stored block "
            f"{per_block[new] / per_block[old]:.2f} (target <= 0.5)"
        )
    return 0


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--thread-cpu-child":
        base, steps, step_ms, salt = argv[1:5]
        print(json.dumps(thread_cpu_child(Path(base), int(steps), float(step_ms), int(salt))))
        return 0
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
    parser.add_argument(
        "--thread-cpu",
        action="store_true",
        help="measure the background threads' CPU per stored block instead (see above)",
    )
    parser.add_argument("--compare-with", default=None, help="--thread-cpu: another checkout")
    parser.add_argument("--rounds", type=int, default=3, help="--thread-cpu: rounds per tree")
    parser.add_argument("--steps", type=int, default=600, help="--thread-cpu: engine steps")
    parser.add_argument("--step-ms", type=float, default=5.0, help="--thread-cpu: model time")
    args = parser.parse_args(argv)

    parent = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    base_dir = Path(tempfile.mkdtemp(prefix="bench_fs_", dir=parent))
    if args.thread_cpu:
        try:
            return bench_thread_cpu(args, base_dir)
        finally:
            shutil.rmtree(base_dir, ignore_errors=True)
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
                f"MAC cost at {_fmt_size(plain.block_bytes)}: keyed tier / tier without a secret, "
                f"store {keyed.tier_store_gib_s / plain.tier_store_gib_s:.2f} "
                f"(best {keyed.tier_store_best_gib_s / plain.tier_store_best_gib_s:.2f}), "
                f"load {keyed.tier_load_gib_s / plain.tier_load_gib_s:.2f} "
                f"(best {keyed.tier_load_best_gib_s / plain.tier_load_best_gib_s:.2f}); process "
                f"CPU s/GiB, store {plain.tier_store_cpu_s_per_gib:.2f} -> "
                f"{keyed.tier_store_cpu_s_per_gib:.2f}, load {plain.tier_load_cpu_s_per_gib:.2f} "
                f"-> {keyed.tier_load_cpu_s_per_gib:.2f}"
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
