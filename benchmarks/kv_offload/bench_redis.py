# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Throughput of the redis tier against raw pipelined SET/GET of the same bytes.

For each block size, in the same run, against the same server, the measurements are interleaved,
round after round, so that a noisy neighbour slows all of them alike. The raw baseline is redis-py
at its fastest for these values: the tier's client settings (RESP2, read buffer, timeouts), with
redis-py's pure-Python command packer, which sends a memoryview argument without copying it
(hiredis's packer, the default, copies it twice), and hiredis parsing the replies. The tier moves
its values over its own connections (``tiering/redis/direct_io.py``).

* raw store: pipelined ``SET key row`` of every row, as many per pipeline as a tier job has
  blocks (``--blocks-per-job``), the row passed as a memoryview;
* tier store: ``RedisSecondaryTier.submit_store`` of every block (jobs of ``--blocks-per-job``),
  then ``drain_jobs()``; the queued jobs run in batches, each with one ``EXISTS`` round trip, then
  ``SET`` rounds of header + row, each sent once the CRC-32C of its row is computed;
* raw load: pipelined ``GET`` of every raw key, pipelines as above, parsed by redis-py (the reply
  bytes are only received);
* tier load: ``submit_load`` + ``drain_jobs()``: ``GET`` rounds, every value received into its
  primary row and verified (size, header, key, CRC-32C); the rows are then compared with what was
  stored;
* keyed store and keyed load: the same, through a second tier with a fleet secret
  (``integrity_key_env``): every value also carries an HMAC-SHA256 of header and row, computed on
  store and verified on load (``block_format.IntegrityKey``). Its ratios are against the tier
  without a secret: what keyed integrity costs.

The server is flushed before each store, so that the tier writes every block. Throughput counts
payload bytes (the rows); the tier's 4 KiB header per value is overhead it pays. Reported: the
median of ``--repeat`` rounds of each, the tier/raw ratio of the medians, the ratio of the
fastest rounds (the ones least disturbed by other processes), and the client's CPU time (every
thread of this process) per GB moved.

Usage::

    python benchmarks/kv_offload/bench_redis.py [--url redis://host:port] [--sizes 256K,2M]

Without ``--url`` it starts its own ``redis-server`` (``--save '' --appendonly no``) on a free
loopback port and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import redis
from _common import bench_keys, bench_spec
from redis.connection import Encoder, PythonRespSerializer

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.sizes import parse_size
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.redis.client import close_client, make_client
from vllm.v1.kv_offload.tiering.redis.manager import RedisSecondaryTier
from vllm.v1.kv_offload.tiering.redis.transfer import MAX_ROUND_BYTES

GB = 1e9
_SECRET_ENV = "VLLM_KV_OFFLOAD_BENCH_INTEGRITY_KEY"


@dataclass
class Result:
    """Throughputs in GB/s of payload (medians of the rounds) and the tier/raw ratios."""

    block_bytes: int
    num_blocks: int
    rounds: int
    raw_store_gb_s: float
    tier_store_gb_s: float
    raw_load_gb_s: float
    tier_load_gb_s: float
    store_ratio: float
    load_ratio: float
    store_ratio_best: float
    load_ratio_best: float
    keyed_store_gb_s: float
    keyed_load_gb_s: float
    keyed_store_ratio: float
    keyed_load_ratio: float
    client_cpu_s_per_gb: dict[str, float]
    """CPU seconds of this process (all threads) per GB of payload, median, per measurement."""


@contextmanager
def own_server() -> Iterator[str]:
    """A throwaway ``redis-server`` on a free loopback port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: `sudo apt-get install redis-server`, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="bench_redis_")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir, "--logfile", f"{workdir}/redis.log"],
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port)
    try:
        deadline = time.monotonic() + 15
        while True:  # bounded poll: the server has no readiness signal to wait on
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"redis-server did not start (see {workdir}/redis.log)")
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}"
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def _jobs(
    keys: list[OffloadKey], per_job: int, first_id: int, *, load: bool = False, row_offset: int = 0
) -> list[JobMetadata]:
    ctx = ReqContext("bench")
    return [
        JobMetadata(
            first_id + n,
            keys[start : start + per_job],
            np.arange(start, min(start + per_job, len(keys)), dtype=np.int64) + row_offset,
            load,
            ctx,
        )
        for n, start in enumerate(range(0, len(keys), per_job))
    ]


def _run_jobs(tier: RedisSecondaryTier, jobs: list[JobMetadata]) -> None:
    for job in jobs:
        (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    tier.drain_jobs()
    failed = [r.job_id for r in tier.get_finished_jobs() if not r.success]
    if failed:
        raise RuntimeError(f"tier jobs failed: {failed} ({tier.stats()})")


def bench_size(url: str, block_bytes: int, total_bytes: int, per_job: int, rounds: int) -> Result:
    n = max(1, total_bytes // block_bytes)
    # Rows [0, n) hold the data; rows [n, 2n) receive the tier's loads.
    mm = mmap.mmap(-1, 2 * n * block_bytes)
    view = memoryview(mm).cast("B", (2 * n, block_bytes))
    rows = np.frombuffer(mm, dtype=np.uint8).reshape(2 * n, block_bytes)
    rows[:n] = np.random.default_rng(0).integers(0, 256, (n, block_bytes), dtype=np.uint8)
    os.environ[_SECRET_ENV] = secrets.token_hex(32)
    tier, keyed = (
        RedisSecondaryTier(
            bench_spec(block_bytes, 2 * n),
            view,
            "redis",
            url=url,
            max_inflight_bytes=2 * n * block_bytes,
            integrity_key_env=env,
        )
        for env in (None, _SECRET_ENV)
    )
    # A client as the tier makes one, for its connection settings (the raw baseline's).
    settings = make_client(tier.config)
    assert isinstance(settings, redis.Redis)
    pool = settings.connection_pool
    client = redis.Redis(
        connection_pool=redis.ConnectionPool(
            # The baseline's packer (benchmark only): redis-py's pure-Python one, see above.
            command_packer=PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode),
            **pool.connection_kwargs,
        )
    )
    close_client(settings)  # lazy: it never connected
    flat = view.cast("B")
    keys = bench_keys(n, "tier")
    raw_keys = [f"raw:{i}".encode() for i in range(n)]
    # The raw pipelines carry what one tier job carries (a job is one round trip when it fits).
    per_round = max(1, min(per_job, MAX_ROUND_BYTES // (HEADER_SIZE + block_bytes)))
    names = ("raw_store", "tier_store", "keyed_store", "raw_load", "tier_load", "keyed_load")
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    job_id = 0

    def measure(name: str, fn: Callable[[], None]) -> None:
        """Wall time and this process's CPU time (every thread: the tier's I/O thread does the
        work while the caller waits) of ``fn()``."""
        wall, proc = time.perf_counter(), time.process_time()
        fn()
        times[name].append(time.perf_counter() - wall)
        cpu[name].append(time.process_time() - proc)

    def raw(load: bool) -> None:
        for lo in range(0, n, per_round):
            pipe = client.pipeline(transaction=False)
            for i in range(lo, min(lo + per_round, n)):
                if load:
                    pipe.get(raw_keys[i])
                else:
                    pipe.set(raw_keys[i], flat[i * block_bytes : (i + 1) * block_bytes])
            replies = pipe.execute()
            assert all(r is not None for r in replies)

    try:
        for _ in range(rounds):
            client.flushall()
            measure("raw_store", partial(raw, load=False))
            for name, t in (("tier", tier), ("keyed", keyed)):
                measure(f"{name}_store", partial(_run_jobs, t, _jobs(keys, per_job, job_id)))
                job_id += n
            measure("raw_load", partial(raw, load=True))
            for name, t in (("tier", tier), ("keyed", keyed)):
                rows[n:] = 0
                jobs = _jobs(keys, per_job, job_id, load=True, row_offset=n)
                measure(f"{name}_load", partial(_run_jobs, t, jobs))
                job_id += n
                if not np.array_equal(rows[n:], rows[:n]):
                    raise RuntimeError(f"{name} load returned other bytes than were stored")
        client.flushall()
    finally:
        client.close()
        del rows
        flat.release()
        tier.shutdown()
        keyed.shutdown()
        del os.environ[_SECRET_ENV]
        view.release()
        mm.close()
    med = {name: n * block_bytes / statistics.median(t) / GB for name, t in times.items()}
    best = {name: n * block_bytes / min(t) / GB for name, t in times.items()}
    cpu_per_gb = {
        name: round(statistics.median(c) / (n * block_bytes / GB), 3) for name, c in cpu.items()
    }
    return Result(
        block_bytes=block_bytes,
        num_blocks=n,
        rounds=rounds,
        raw_store_gb_s=round(med["raw_store"], 3),
        tier_store_gb_s=round(med["tier_store"], 3),
        raw_load_gb_s=round(med["raw_load"], 3),
        tier_load_gb_s=round(med["tier_load"], 3),
        store_ratio=round(med["tier_store"] / med["raw_store"], 3),
        load_ratio=round(med["tier_load"] / med["raw_load"], 3),
        store_ratio_best=round(best["tier_store"] / best["raw_store"], 3),
        load_ratio_best=round(best["tier_load"] / best["raw_load"], 3),
        keyed_store_gb_s=round(med["keyed_store"], 3),
        keyed_load_gb_s=round(med["keyed_load"], 3),
        keyed_store_ratio=round(med["keyed_store"] / med["tier_store"], 3),
        keyed_load_ratio=round(med["keyed_load"] / med["tier_load"], 3),
        client_cpu_s_per_gb=cpu_per_gb,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an existing server (default: start one)")
    parser.add_argument("--sizes", default="2MiB,256KiB", help="block sizes, comma-separated")
    parser.add_argument("--total", default="128MiB", help="bytes moved per measurement")
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7, help="interleaved rounds")
    parser.add_argument("--json", action="store_true", help="one JSON object per size")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    total = parse_size(args.total)

    def run(url: str) -> None:
        for size in sizes:
            r = bench_size(url, size, total, args.blocks_per_job, args.repeat)
            if args.json:
                print(json.dumps(asdict(r)))
            else:
                print(
                    f"{size >> 10:>6} KiB x {r.num_blocks:>4}: store raw {r.raw_store_gb_s:.2f} "
                    f"tier {r.tier_store_gb_s:.2f} GB/s (x{r.store_ratio:.2f}) | load raw "
                    f"{r.raw_load_gb_s:.2f} tier {r.tier_load_gb_s:.2f} GB/s (x{r.load_ratio:.2f}) "
                    f"| best rounds: store x{r.store_ratio_best:.2f} load x{r.load_ratio_best:.2f}"
                    f"\n{'':>17} keyed (HMAC-SHA256): store {r.keyed_store_gb_s:.2f} GB/s "
                    f"(x{r.keyed_store_ratio:.2f} of the tier) | load {r.keyed_load_gb_s:.2f} GB/s "
                    f"(x{r.keyed_load_ratio:.2f} of the tier)"
                    f"\n{'':>17} client CPU s/GB: "
                    + ", ".join(f"{k} {v:.2f}" for k, v in r.client_cpu_s_per_gb.items())
                )

    if args.url:
        run(args.url)
    else:
        with own_server() as url:
            run(url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
