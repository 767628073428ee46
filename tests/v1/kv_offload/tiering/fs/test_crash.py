# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Crash safety: a writer process killed with SIGKILL mid-write, then a new tier over the root.

The writer is a real separate process running the real tier. In the "mid_write" case it is
stopped deterministically in the middle of writing one block's temporary file (half the payload
written, not fsynced, not renamed) while other blocks complete; in the "busy" case it is killed
at an arbitrary moment while eight I/O threads write continuously. Either way the new tier must
serve every published block bit-exactly, never serve the interrupted one, and remove the
leftovers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest

from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.fs.native_io import DISABLE_ENV

from .conftest import ROW_BYTES, Primary, TierFactory, key_of, load, make_spec, resolve_lookups
from .tier_state import block_file, scan_stats, usage

FILE_SIZE = HEADER_SIZE + ROW_BYTES

_WRITER = textwrap.dedent(
    """
    import hashlib, json, mmap, os, sys, threading
    import numpy as np
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.spec import KVCacheRunInfo
    from vllm.v1.kv_offload.tiering.base import JobMetadata
    from vllm.v1.kv_offload.tiering.fs import block_io
    from vllm.v1.kv_offload.tiering.fs.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier

    root, mode, run_json = sys.argv[1], sys.argv[2], sys.argv[3]
    fields = json.loads(run_json)
    fields["gpu_block_sizes"] = tuple(fields["gpu_block_sizes"])
    run = KVCacheRunInfo(**fields)
    row = fields["gpu_kv_bytes_per_block"]
    rows = 16
    spec = CPUOffloadingSpec(OffloadingConfig(cpu_bytes_to_use=rows * row), run)
    mm = mmap.mmap(-1, rows * row)
    view = memoryview(mm).cast("B", (rows, row))
    arr = np.frombuffer(mm, dtype=np.uint8).reshape(rows, row)

    def key_of(i):
        return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)

    def pattern(key):
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        return np.random.default_rng(seed).integers(0, 256, row, dtype=np.uint8)

    tier = FileSystemSecondaryTier(
        spec, view, "fs", root_dir=root, n_read_threads=1, n_write_threads=8,
        min_free_bytes=0,
    )
    ctx = ReqContext("writer")
    report = lambda msg: (sys.stdout.write(msg + "\\n"), sys.stdout.flush())

    if mode == "mid_write":
        stalled = key_of(1000)
        stalled_name = FileMapper.block_path(stalled).stem
        real_write_all = block_io._write_all

        def write_half_then_hang(fd, bufs):
            if not os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[1].startswith(
                "." + stalled_name
            ):
                return real_write_all(fd, bufs)
            header, payload = bufs
            real_write_all(fd, [header, payload[: len(payload) // 2]])
            report("STALLED")
            threading.Event().wait()

        block_io._write_all = write_half_then_hang
        for i in range(6):
            arr[i] = pattern(key_of(i))
        tier.submit_store(JobMetadata(1, [key_of(i) for i in range(6)],
                                      np.arange(6, dtype=np.int64), False, ctx))
        tier.drain_jobs()
        assert [r.success for r in tier.get_finished_jobs()] == [True]
        arr[6] = pattern(stalled)
        tier.submit_store(JobMetadata(2, [stalled], np.array([6]), False, ctx))
    else:
        job_id = 0
        i = 0
        while True:
            keys = [key_of(i + j) for j in range(8)]
            for j, key in enumerate(keys):
                arr[j] = pattern(key)
            tier.submit_store(JobMetadata(job_id, keys, np.arange(8, dtype=np.int64), False, ctx))
            tier.drain_jobs()
            assert [r.success for r in tier.get_finished_jobs()] == [True]
            report(f"STORED {i + 8}")
            job_id += 1
            i += 8
    threading.Event().wait()
    """
)


def _run_fields() -> str:
    run = asdict(make_spec().run)
    run["gpu_block_sizes"] = list(run["gpu_block_sizes"])
    return json.dumps(run)


def _start_writer(root: Path, mode: str) -> subprocess.Popen[str]:
    env = dict(os.environ)
    if mode == "mid_write":
        # It stalls the write in Python's block_io._write_all; the batched calls (native_io),
        # which the busy writer uses, write from C.
        env[DISABLE_ENV] = "0"
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), mode, _run_fields()],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)  # reaped: its pid is dead, not a zombie, for the leftover check
    assert proc.returncode == -signal.SIGKILL


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def _wait_for_line(proc: subprocess.Popen[str], predicate: str | int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if isinstance(predicate, str) and line.strip() == predicate:
            return
        if (
            isinstance(predicate, int)
            and line.startswith("STORED")
            and int(line.split()[1]) >= predicate
        ):
            return
    pytest.fail(f"writer exited early with {proc.wait()}")


def test_sigkill_mid_write_then_restart(
    make_tier: TierFactory, primary: Primary, root: Path
) -> None:
    proc = _start_writer(root, "mid_write")
    try:
        _wait_for_line(proc, "STALLED")
        leftovers = _tmp_files(root)
        assert len(leftovers) == 1
        assert leftovers[0].stat().st_size == HEADER_SIZE + ROW_BYTES // 2
    finally:
        _kill(proc)
    tier = make_tier()
    scan = scan_stats(tier)
    assert scan is not None and scan.tmp_removed == 1 and scan.blocks == 6
    assert _tmp_files(root) == []
    keys = [key_of(i) for i in range(6)]
    stalled = key_of(1000)
    assert resolve_lookups(tier, [*keys, stalled]) == [True] * 6 + [False]
    assert load(tier, primary, keys, list(range(6)))
    assert all(primary.holds(i, key) for i, key in enumerate(keys))
    assert not load(tier, primary, [stalled], [6])
    assert usage(tier).used_bytes == 6 * FILE_SIZE


def test_sigkill_of_a_busy_writer_then_restart(
    make_tier: TierFactory, primary: Primary, root: Path
) -> None:
    proc = _start_writer(root, "busy")
    try:
        _wait_for_line(proc, 24)
    finally:
        _kill(proc)
    tier = make_tier()
    assert tier.wait_until_ready(10)
    assert _tmp_files(root) == []
    published = sorted(Path(tier.rank_dir).rglob("*.bin"))
    assert len(published) >= 24
    assert all(p.stat().st_size == FILE_SIZE for p in published)
    # Every published block verifies bit-exactly; which ones exist is up to the kill's timing.
    by_name = {Path(block_file(tier, key_of(i))).name: key_of(i) for i in range(4096)}
    keys = [by_name[p.name] for p in published]
    for start in range(0, len(keys), 8):
        chunk = keys[start : start + 8]
        assert load(tier, primary, chunk, list(range(len(chunk))))
        assert all(primary.holds(i, key) for i, key in enumerate(chunk))
    assert usage(tier).used_bytes == len(keys) * FILE_SIZE
    assert os.listdir(tier.rank_dir)
