# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Concurrent stress of the filesystem tier: LRU eviction under ``max_bytes`` with exact accounting.

A scheduler loop keeps several store and load jobs in flight on six I/O threads, with lookups
every step, while another thread deletes and truncates block files behind the tier's back. The
accounting must stay exact throughout and match the directory at the end, every successful load
must be bit-exact, and the events must describe exactly the files the tier wrote and removed.
"""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier

from .conftest import ROW_BYTES, Primary, TierFactory, job, key_of, register_dead_writer
from .tier_state import block_file, check_index, counters, index_of, indexed_size, usage

FILE_SIZE = HEADER_SIZE + ROW_BYTES
MAX_FILES = 6
UNIVERSE = [key_of(i) for i in range(24)]
STEPS = 600


class Vandal(threading.Thread):
    """Deletes or truncates one random existing block file each time it is poked."""

    def __init__(self, tier: FileSystemSecondaryTier, seed: int) -> None:
        super().__init__(name="vandal", daemon=True)
        self.tier = tier
        self.rng = random.Random(seed)
        self.poke = threading.Semaphore(0)
        self.stop = False
        self.deleted: set[OffloadKey] = set()
        self.truncated: set[OffloadKey] = set()

    def run(self) -> None:
        while True:
            self.poke.acquire()
            if self.stop:
                return
            by_path = {block_file(self.tier, key): key for key in UNIVERSE}
            existing = sorted(str(p) for p in Path(self.tier.rank_dir).rglob("*.bin"))
            if not existing:
                continue
            path = self.rng.choice(existing)
            key = by_path[path]
            try:
                if self.rng.random() < 0.5:
                    os.unlink(path)
                    self.deleted.add(key)
                else:
                    os.truncate(path, self.rng.randrange(0, FILE_SIZE))
                    self.truncated.add(key)
            except FileNotFoundError:
                pass


def _disk_sizes(tier: FileSystemSecondaryTier) -> dict[OffloadKey, int]:
    by_path = {block_file(tier, key): key for key in UNIVERSE}
    sizes: dict[OffloadKey, int] = {}
    for path in Path(tier.rank_dir).rglob("*.bin"):
        sizes[by_path[str(path)]] = path.stat().st_size
    return sizes


@pytest.mark.slow
def test_concurrent_stores_loads_and_vandalism_keep_exact_accounting(
    make_tier: TierFactory, primary: Primary
) -> None:
    rng = random.Random(1234)
    tier = make_tier(
        max_bytes=MAX_FILES * FILE_SIZE, n_read_threads=3, n_write_threads=3, enable_events=True
    )
    vandal = Vandal(tier, seed=99)
    vandal.start()
    free_rows = list(range(primary.num_rows))
    in_flight: dict[int, JobMetadata] = {}
    stored_ok: list[OffloadKey] = []
    events: list[tuple[bool, OffloadKey]] = []
    loads_ok = loads_failed = 0
    req = ReqContext("stress")

    def collect() -> None:
        nonlocal loads_ok, loads_failed
        for result in tier.get_finished_jobs():
            done = in_flight.pop(result.job_id)
            rows = done.block_ids.tolist()
            if done.is_promotion and result.success:
                loads_ok += 1
                for key, row in zip(done.keys, rows, strict=True):
                    assert primary.holds(row, key), f"load of {key.hex()} is not bit-exact"
            elif done.is_promotion:
                loads_failed += 1
            elif result.success:
                stored_ok.extend(done.keys)
            free_rows.extend(rows)
        events.extend((e.removed, key) for e in tier.take_events() for key in e.keys)

    try:
        for step in range(STEPS):
            if len(in_flight) >= 4 or len(free_rows) < 6:
                tier.drain_jobs()  # a full pipeline: let the I/O threads catch up
            collect()
            if len(in_flight) < 4 and len(free_rows) >= 3:
                keys = rng.sample(UNIVERSE, rng.randint(1, 3))
                rows = [free_rows.pop() for _ in keys]
                for key, row in zip(keys, rows, strict=True):
                    primary.fill(row, key)
                j = job(keys, rows, load=False, req=req)
                in_flight[j.job_id] = j
                tier.submit_store(j)
            if len(in_flight) < 4 and len(free_rows) >= 3 and stored_ok:
                keys = list(dict.fromkeys(rng.choices(stored_ok[-12:], k=rng.randint(1, 3))))
                rows = [free_rows.pop() for _ in keys]
                j = job(keys, rows, load=True, req=req)
                in_flight[j.job_id] = j
                tier.submit_load(j)
            for key in rng.sample(UNIVERSE, 3):
                tier.lookup(key, req)
            tier.touch(rng.sample(UNIVERSE, 2), req)
            tier.on_schedule_end()
            if step % 3 == 0:
                vandal.poke.release()
            check_index(tier)
            assert usage(tier).used_bytes <= MAX_FILES * FILE_SIZE
        tier.drain_jobs()
        collect()
    finally:
        vandal.stop = True
        vandal.poke.release()
        vandal.join(10)
    assert not in_flight
    assert loads_ok > 20 and len(stored_ok) > 100, (loads_ok, len(stored_ok))

    # Reconcile what the vandal did behind the tier's back: a writer found gone (the presence
    # file a crash leaves) sends the reconcile through the whole directory; then the index must
    # match the directory exactly.
    tier.on_request_finished(req)
    register_dead_writer(tier)
    assert tier.wait_reconciled(10) and tier.wait_reconciled(10)
    disk = _disk_sizes(tier)
    assert {key: indexed_size(index_of(tier), key) for key in UNIVERSE} == {
        key: disk.get(key) for key in UNIVERSE
    }
    check_index(tier)
    snap = usage(tier)
    assert snap.used_bytes == sum(disk.values()) <= MAX_FILES * FILE_SIZE
    assert snap.num_writing == snap.num_removing == snap.num_pinned == 0
    assert not list(Path(tier.rank_dir).rglob("*.tmp"))
    # Events: replaying them gives every file on disk; anything more was removed by the vandal.
    present: set[OffloadKey] = set()
    for removed, key in events:
        (present.discard if removed else present.add)(key)
    assert set(disk) <= present
    assert present - set(disk) <= vandal.deleted | vandal.truncated
    stats = counters(tier)
    assert stats["blocks_evicted"] > 0 and vandal.deleted and vandal.truncated
