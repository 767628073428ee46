# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""One engine instance of the shared-root tests: a real fs tier in its own process.

Run as ``python shared_root_worker.py <root_dir> <params json>`` (see ``test_shared_root.py``).
Protocol on stdin/stdout, one line each:

* the worker prints ``READY`` once its tier has finished its start-up scan, then waits for ``go``;
* it stores ``n_jobs`` jobs of ``batch`` random keys of its universe (two jobs in flight, on
  alternate halves of its primary rows), loading a few keys it stored before after every job,
  and checks that every successful load is bit-exact;
* it prints ``DONE <json>`` (its counters and the number of wrong loads), then answers each
  ``usage`` line with ``USAGE <json>`` (its index's bytes and blocks) until ``quit``.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import random
import sys
from typing import Any

import numpy as np

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier


def key_of(i: int) -> OffloadKey:
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), 0)


def pattern(key: bytes, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    root, params = sys.argv[1], json.loads(sys.argv[2])
    fields = params["run"]
    fields["gpu_block_sizes"] = tuple(fields["gpu_block_sizes"])
    row_bytes, rows, batch = params["row_bytes"], params["rows"], params["batch"]
    spec = CPUOffloadingSpec(
        OffloadingConfig(cpu_bytes_to_use=rows * row_bytes), KVCacheRunInfo(**fields)
    )
    mm = mmap.mmap(-1, rows * row_bytes)
    view = memoryview(mm).cast("B", (rows, row_bytes))
    arr = np.frombuffer(mm, dtype=np.uint8).reshape(rows, row_bytes)
    tier = FileSystemSecondaryTier(spec, view, "fs", root_dir=root, **params["tier"])
    assert tier.wait_until_ready(30)
    rng = random.Random(params["seed"])
    universe = [key_of(i) for i in params["keys"]]
    ctx = ReqContext("worker")
    say("READY")
    assert sys.stdin.readline().strip() == "go"

    in_flight: dict[int, JobMetadata] = {}
    stored: list[OffloadKey] = []
    wrong = loads_ok = loads_failed = 0
    half = rows // 2  # rows [0, batch) and [half, half + batch) for stores, the rest for loads

    def collect() -> None:
        nonlocal wrong, loads_ok, loads_failed
        for result in tier.get_finished_jobs():
            done = in_flight.pop(result.job_id)
            if not done.is_promotion:
                if result.success:
                    stored.extend(done.keys)
                continue
            if not result.success:
                loads_failed += 1
                continue
            loads_ok += 1
            for key, row in zip(done.keys, done.block_ids.tolist(), strict=True):
                if not np.array_equal(arr[row], pattern(key, row_bytes)):
                    wrong += 1

    job_id = 0
    for n in range(params["n_jobs"]):
        base = (n % 2) * half
        while any(int(j.block_ids[0]) == base for j in in_flight.values()):
            tier.drain_jobs()  # the rows of the job two back are still being written
            collect()
        keys = rng.sample(universe, batch)
        for i, key in enumerate(keys):
            arr[base + i] = pattern(key, row_bytes)
        job_id += 1
        job = JobMetadata(job_id, tuple(keys), np.arange(base, base + batch), False, ctx)
        in_flight[job_id] = job
        tier.submit_store(job)
        collect()
        if stored and n % 3 == 0:
            # A load of a key stored before (maybe evicted since, by anyone): bit-exact or a miss.
            tier.drain_jobs()
            collect()
            key = rng.choice(stored)
            job_id += 1
            load = JobMetadata(job_id, (key,), np.array([batch]), True, ctx)
            in_flight[job_id] = load
            tier.submit_load(load)
    tier.drain_jobs()
    collect()
    assert not in_flight
    say("DONE " + json.dumps({**tier.get_stats().counters, "wrong": wrong, "loads_ok": loads_ok}))
    for line in sys.stdin:
        command = line.strip()
        if command == "usage":
            stats = tier.get_stats()
            say("USAGE " + json.dumps([stats.used_bytes, stats.num_blocks]))
        elif command == "quit":
            break
    tier.shutdown()


if __name__ == "__main__":
    main()
