# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The whole tiering stack with a filesystem tier, built from config like an engine does.

``TieringOffloadingSpec`` builds the real shared host region, the CPU primary tier and the fs tier
(through the tier factory). Blocks are stored into the CPU tier, cascaded to disk, evicted from
the CPU tier, and promoted back bit-exactly; then a second engine over the same root (a restart)
promotes them again from disk.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from tests.v1.kv_offload.utils import closed_at_teardown, make_tiering_spec, store_and_cascade
from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.fs.manager import STORAGE_MEDIUM, FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

from .conftest import key_of, pattern
from .tier_state import block_file

ROW_BYTES = 1 << 20
NUM_CPU_BLOCKS = 4
_instances = itertools.count()


class Engine:
    """A tiering manager built from config, plus helpers that play the scheduler and worker."""

    def __init__(self, tmp_path: Path, root: Path) -> None:
        fs_tier = {
            "type": "fs",
            "root_dir": str(root),
            "n_read_threads": 2,
            "n_write_threads": 2,
            "min_free_bytes": 0,
            "enable_events": True,
        }
        spec = make_tiering_spec(
            tmp_path,
            NUM_CPU_BLOCKS,
            gpu_kv_bytes_per_block=ROW_BYTES,
            secondary_tiers=[fs_tier],
            instance_id=f"fs-integration-{next(_instances)}",
        )
        self.manager: TieringOffloadingManager = spec.get_manager()
        tier = self.manager.secondary_tiers[0]
        assert isinstance(tier, FileSystemSecondaryTier)
        self.tier = tier
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows: npt.NDArray[np.uint8] | None = np.asarray(view)

    def step(self) -> None:
        """One scheduler step end."""
        self.manager.on_schedule_end()

    def store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """GPU -> CPU store of ``keys`` (the worker's copy is a row fill), then the cascade."""
        assert self.rows is not None
        store_and_cascade(
            self.manager, self.tier, self.rows, keys, ctx, lambda key: pattern(key, ROW_BYTES)
        )

    def lookups(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool | None]:
        return [self.manager.lookup(key, ctx) for key in keys]

    def promote(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """Drive lookups until every key is readable in the CPU tier again."""
        assert self.lookups(keys, ctx) == [None] * len(keys)  # fs lookups are asynchronous
        self.step()  # flushes the fs lookups
        assert self.tier.wait_lookups_idle(10)
        assert self.lookups(keys, ctx) == [None] * len(keys)  # found on disk: promotions queued
        self.step()  # submits the promotion
        self.tier.drain_jobs()
        self.step()  # its completion makes the rows readable
        assert self.lookups(keys, ctx) == [True] * len(keys)

    def assert_cpu_holds(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        assert self.rows is not None
        spec = self.manager.prepare_load(keys, ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        for key, row in zip(keys, spec.block_ids.tolist(), strict=True):
            assert np.array_equal(self.rows[row], pattern(key, ROW_BYTES)), key.hex()
        self.manager.complete_load(keys, ctx)

    def shutdown(self) -> None:
        self.rows = None
        self.manager.shutdown()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[Engine]]:
    yield from closed_at_teardown(Engine.shutdown)


def test_store_evict_from_cpu_promote_back_bit_exact(tmp_path: Path, engines: list[Engine]) -> None:
    root = tmp_path / "kv"
    engine = Engine(tmp_path, root)
    engines.append(engine)
    first = [key_of(i) for i in range(NUM_CPU_BLOCKS)]
    second = [key_of(100 + i) for i in range(NUM_CPU_BLOCKS)]
    writer = ReqContext("writer")
    engine.manager.on_new_request(writer)
    engine.store(first, writer)
    assert all(Path(block_file(engine.tier, key)).is_file() for key in first)
    engine.store(second, writer)  # the CPU tier is full: the first blocks are evicted from it
    assert engine.manager.primary_tier.lookup(first[0], writer) is False
    engine.manager.on_request_finished(writer)
    stored_on_disk = {
        key
        for event in engine.manager.take_events()
        if event.medium == STORAGE_MEDIUM and not event.removed
        for key in event.keys
    }
    assert stored_on_disk == set(first + second)

    reader = ReqContext("reader")
    engine.manager.on_new_request(reader)
    engine.promote(first, reader)
    engine.assert_cpu_holds(first, reader)
    engine.manager.on_request_finished(reader)
    assert engine.manager.get_stats()["tiering_jobs_failed"] == 0

    # A restart: a new engine over the same root serves the blocks from disk.
    engine.shutdown()
    engines.remove(engine)
    restarted = Engine(tmp_path, root)
    engines.append(restarted)
    ctx = ReqContext("after-restart")
    restarted.manager.on_new_request(ctx)
    restarted.promote(second, ctx)
    restarted.assert_cpu_holds(second, ctx)


def test_a_corrupt_block_is_never_served_through_the_stack(
    tmp_path: Path, engines: list[Engine]
) -> None:
    root = tmp_path / "kv"
    engine = Engine(tmp_path, root)
    engines.append(engine)
    keys = [key_of(i) for i in range(NUM_CPU_BLOCKS)]
    writer = ReqContext("writer")
    engine.manager.on_new_request(writer)
    engine.store(keys, writer)
    engine.manager.on_request_finished(writer)
    engine.shutdown()
    engines.remove(engine)
    # Flip one payload bit of the second block on disk (same size: only the checksum sees it).
    path = Path(block_file(engine.tier, keys[1]))
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size - 1)
        last = f.read(1)[0]
        f.seek(-1, 2)
        f.write(bytes([last ^ 0x80]))

    restarted = Engine(tmp_path, root)
    engines.append(restarted)
    ctx = ReqContext("reader")
    restarted.manager.on_new_request(ctx)
    # After the start-up scan the index answers every lookup in the step that asks, so the four
    # promotions are queued together (while it runs, the keys it has not reached yet would be
    # probed and promoted a step later, in a job of their own).
    assert restarted.tier.wait_until_ready(10)
    assert restarted.lookups(keys, ctx) == [None] * len(keys)  # all four look fine on disk
    restarted.step()  # submits the promotion of the four blocks as one job
    restarted.tier.drain_jobs()
    restarted.step()  # the job failed: every reserved row is freed, none becomes readable
    primary = restarted.manager.primary_tier
    assert [primary.lookup(key, ctx) for key in keys] == [False] * len(keys)
    assert primary.num_free_blocks == NUM_CPU_BLOCKS
    assert restarted.manager.get_stats()["tiering_jobs_failed"] == 1
    assert not path.exists()  # the corrupt file was deleted...
    # ...and the broken block now misses, so the request stops at it instead of retrying.
    assert restarted.manager.lookup(keys[1], ctx) is False
    assert restarted.manager.lookup(keys[0], ctx) is None  # the good ones promote again
