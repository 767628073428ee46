# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A shared fs root is bounded as a whole, and every instance's accounting converges (issue #12,
part 3).

2 and 4 real processes (``shared_root_worker.py``), each a full fs tier with the same
``max_bytes``, store blocks of a private key range and of a range they all share (so both
different and overlapping data) into one root, loading some back. While they run, the test
samples the directory: it stops every worker with SIGSTOP (and waits until each has stopped), so
that a sample is the directory at one instant, not the union of a walk over changing files, then
resumes them. Every sample must be within ``max_bytes`` plus the files being evicted at that
instant; after the last store, every worker's reported usage must equal the directory within the
documented convergence interval; and no load may ever return wrong bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE

from .conftest import make_spec

ROW_BYTES = 128 << 10
FILE_SIZE = HEADER_SIZE + ROW_BYTES
CAPACITY_FILES = 16
MAX_BYTES = CAPACITY_FILES * FILE_SIZE
N_READ_THREADS, N_WRITE_THREADS = 1, 2
RECONCILE_INTERVAL_S = 0.05
RECONCILE_BATCH = 256
TIER_KWARGS: dict[str, Any] = {
    "max_bytes": MAX_BYTES,
    "n_read_threads": N_READ_THREADS,
    "n_write_threads": N_WRITE_THREADS,
    "min_free_bytes": 0,
    "reconcile_interval_s": RECONCILE_INTERVAL_S,
    "reconcile_batch": RECONCILE_BATCH,
}
# Files being evicted at one instant: at most one per thread that evicts (I/O threads and the
# reconcile thread), in every instance.
IN_FLIGHT_FILES_PER_INSTANCE = N_READ_THREADS + N_WRITE_THREADS + 1
# The documented convergence interval: one full reconcile pass after the last change, i.e.
# ceil(entries / reconcile_batch) steps of reconcile_interval_s. The directory holds at most
# CAPACITY_FILES block files (+ their slot names and directories): one step covers it; the
# deadline allows for a pass in progress, process scheduling on 2 shared cores, and the I/O.
CONVERGENCE_DEADLINE_S = 5.0
WORKER = Path(__file__).with_name("shared_root_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[5]


@dataclass
class DiskSample:
    """The run directory at one instant."""

    bytes: int  # every regular file (distinct inodes: slot names are hard links)
    unslotted_bytes: int  # inodes (with bytes) holding no capacity slot name
    block_files: int  # *.bin names
    block_bytes: int


def sample_disk(rank_dir: Path) -> DiskSample:
    inodes: dict[int, int] = {}
    slotted: set[int] = set()
    block_files = block_bytes = 0
    slots_dir = rank_dir / "slots"
    for dirpath, _, files in os.walk(rank_dir):
        in_slots = Path(dirpath).parent == slots_dir
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue
            inodes[st.st_ino] = st.st_size
            if in_slots and not name.startswith("."):
                slotted.add(st.st_ino)
            if name.endswith(".bin"):
                block_files += 1
                block_bytes += st.st_size
    unslotted = sum(size for ino, size in inodes.items() if ino not in slotted)
    return DiskSample(sum(inodes.values()), unslotted, block_files, block_bytes)


class Workers:
    """``n`` worker processes over one root; closed (killed if needed) by ``close``."""

    def __init__(self, root: Path, n: int, n_jobs: int) -> None:
        run = asdict(make_spec(ROW_BYTES, 16).run)
        run["gpu_block_sizes"] = list(run["gpu_block_sizes"])
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.procs: list[subprocess.Popen[str]] = []
        for i in range(n):
            params = {
                "run": run,
                "row_bytes": ROW_BYTES,
                "rows": 16,
                "batch": 4,
                "n_jobs": n_jobs,
                "seed": i,
                # Private keys (different data) and keys every worker stores (overlapping).
                "keys": [*range(1000 * (i + 1), 1000 * (i + 1) + 48), *range(48)],
                "tier": TIER_KWARGS,
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(root), json.dumps(params)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )

    def expect(self, proc: subprocess.Popen[str], prefix: str) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(prefix), f"worker {proc.pid}: expected {prefix!r}, got {line!r}"
        return line[len(prefix) :].strip()

    def send(self, proc: subprocess.Popen[str], line: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    def freeze_and_sample(self, rank_dir: Path) -> DiskSample:
        """Stop every worker (SIGSTOP, waited for), sample the directory, resume them."""
        stopped = []
        try:
            for proc in self.procs:
                os.kill(proc.pid, signal.SIGSTOP)
                stopped.append(proc)
            for proc in self.procs:
                _, status = os.waitpid(proc.pid, os.WUNTRACED)
                assert os.WIFSTOPPED(status), f"worker {proc.pid} ended: status {status}"
            return sample_disk(rank_dir)
        finally:
            for proc in stopped:
                os.kill(proc.pid, signal.SIGCONT)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    self.send(proc, "quit")
                    proc.wait(timeout=20)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("n_procs", [2, 4])
def test_shared_root_stays_bounded_and_usage_converges(tmp_path: Path, n_procs: int) -> None:
    root = tmp_path / "kv_root"
    workers = Workers(root, n_procs, n_jobs=120)
    try:
        for proc in workers.procs:
            workers.expect(proc, "READY")
        rank_dirs = [p for p in root.iterdir() if p.name.endswith("_r0")]
        assert len(rank_dirs) == 1, rank_dirs
        rank_dir = rank_dirs[0]
        samples: list[DiskSample] = []
        stop_sampling = threading.Event()

        def sampler() -> None:
            # Pacing between samples (not synchronisation): let the workers run in between.
            while not stop_sampling.wait(0.005):
                samples.append(workers.freeze_and_sample(rank_dir))

        for proc in workers.procs:
            workers.send(proc, "go")
        thread = threading.Thread(target=sampler, name="disk-sampler")
        thread.start()
        try:
            done = [json.loads(workers.expect(proc, "DONE ")) for proc in workers.procs]
        finally:
            stop_sampling.set()
            thread.join()
        done_at = time.monotonic()

        # Nothing served was ever wrong, and the workers really stored and evicted.
        assert [d["wrong"] for d in done] == [0] * n_procs
        assert sum(d["blocks_written"] for d in done) > 4 * CAPACITY_FILES
        assert sum(d["loads_ok"] for d in done) > 0

        # The bound, at every sampled instant.
        assert len(samples) >= 20, f"only {len(samples)} samples"
        allowance = n_procs * IN_FLIGHT_FILES_PER_INSTANCE * FILE_SIZE
        worst = max(samples, key=lambda s: s.bytes)
        print(
            f"\n{n_procs} processes, {len(samples)} samples: max {worst.bytes / FILE_SIZE:.1f} "
            f"files (bound {CAPACITY_FILES} + in flight); samples with files outside a slot: "
            f"{sum(1 for s in samples if s.unslotted_bytes)}, at most "
            f"{max(s.unslotted_bytes for s in samples) / FILE_SIZE:.0f}; stores "
            f"{sum(d['blocks_written'] for d in done)}, failed "
            f"{sum(d.get('store_failures', 0) for d in done)}"
        )
        for sample in samples:
            # Files holding a slot never exceed max_bytes; the others are the ones in flight.
            assert sample.bytes - sample.unslotted_bytes <= MAX_BYTES, sample
            assert sample.bytes <= MAX_BYTES + allowance, sample

        # Convergence: every worker's usage equals the directory, within the deadline.
        converged: dict[int, float] = {}
        last: dict[int, Any] = {}
        while len(converged) < n_procs and time.monotonic() - done_at < CONVERGENCE_DEADLINE_S:
            disk = sample_disk(rank_dir)
            for i, proc in enumerate(workers.procs):
                if i in converged:
                    continue
                workers.send(proc, "usage")
                last[i] = json.loads(workers.expect(proc, "USAGE "))
                if last[i] == [disk.block_bytes, disk.block_files]:
                    converged[i] = time.monotonic() - done_at
        disk = sample_disk(rank_dir)
        print(f"converged after {sorted(converged.values())} s; disk {disk}")
        assert len(converged) == n_procs, (
            f"usage {last} still differs from the directory ({disk.block_bytes} bytes in "
            f"{disk.block_files} block files) {CONVERGENCE_DEADLINE_S} s after the last store"
        )
        assert disk.bytes == disk.block_bytes <= MAX_BYTES, disk
    finally:
        workers.close()
