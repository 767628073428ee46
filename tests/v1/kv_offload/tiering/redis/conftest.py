# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Fixtures of the redis tier tests: real servers, engines built from config like a real run.

``Engine`` is a ``TieringOffloadingManager`` built by ``TieringOffloadingSpec`` (a real shared host
region, a CPU primary tier, the redis tier through the tier factory), plus helpers that play the
scheduler and the worker. Two engines with the same run fields share the redis namespace, as two
replicas of one model do.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tests.v1.kv_offload.tiering.redis.servers import RedisCluster3, RedisServer
from tests.v1.kv_offload.utils import closed_at_teardown, make_tiering_spec, store_and_cascade
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.base import JobMetadata, JobResult
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.redis.manager import RedisSecondaryTier

ROW_BYTES = 256 << 10
"""256 KiB rows: real multi-chunk values that keep the suite fast on 2 cores."""
NUM_CPU_BLOCKS = 8
_instances = itertools.count()


def key_of(i: int, group: int = 0) -> OffloadKey:
    """A 32-byte-hash key, like a real block hash."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), group)


def pattern(key: bytes, nbytes: int = ROW_BYTES) -> npt.NDArray[np.uint8]:
    """Deterministic pseudo-random bytes of ``key`` (what a test stores as its row)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class Engine:
    """A tiering manager with one redis tier, and helpers that play the scheduler and worker."""

    def __init__(self, tmp_path: Path, url: str | None, **tier_kwargs: Any) -> None:
        tmp_path.mkdir(parents=True, exist_ok=True)
        spec = make_tiering_spec(
            tmp_path,
            NUM_CPU_BLOCKS,
            gpu_kv_bytes_per_block=ROW_BYTES,
            secondary_tiers=[{"type": "redis", "url": url, "timeout_s": 1.0, **tier_kwargs}],
            instance_id=f"redis-test-{next(_instances)}",
        )
        self.manager: TieringOffloadingManager = spec.get_manager()
        tier = self.manager.secondary_tiers[0]
        assert isinstance(tier, RedisSecondaryTier)
        self.tier = tier
        self.rows: npt.NDArray[np.uint8] | None = np.asarray(
            self.manager.primary_tier.get_kv_memoryview()
        )

    def step(self) -> None:
        self.manager.on_schedule_end()

    def store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """GPU -> CPU store of ``keys`` (the worker's copy is a row fill), then the cascade."""
        assert self.rows is not None
        store_and_cascade(self.manager, self.tier, self.rows, keys, ctx, pattern)

    def lookups(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool | None]:
        return [self.manager.lookup(key, ctx) for key in keys]

    def probe(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[bool | None]:
        """Ask, end the step (flushes the batched probe), wait for it, ask again."""
        first = self.lookups(keys, ctx)
        self.step()
        assert self.tier.wait_lookups_idle(10)
        return [
            a if a is not None else b for a, b in zip(first, self.lookups(keys, ctx), strict=True)
        ]

    def promote(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, *, sync: bool = True
    ) -> list[bool | None]:
        """Drive lookups through a promotion; returns the final lookups (True: readable).

        A tier that follows the namespace's stores first waits until its view holds what other
        instances announced (``sync_view``; ``sync=False`` where it cannot, e.g. a cluster
        master down): then its lookups find their blocks at once, and the first lookups answer
        None for the promotions they queue instead of for the server's answer."""
        if sync and self.tier.config.follow_stores:
            assert self.tier.sync_view(10)
        assert self.lookups(keys, ctx) == [None] * len(keys)
        self.step()
        assert self.tier.wait_lookups_idle(10)
        self.lookups(keys, ctx)  # found: promotions queued
        self.step()  # submits them
        self.tier.drain_jobs()
        self.step()  # completions make the rows readable (or free them)
        return self.lookups(keys, ctx)

    def assert_cpu_holds(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        assert self.rows is not None
        spec = self.manager.prepare_load(keys, ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        for key, row in zip(keys, spec.block_ids.tolist(), strict=True):
            assert np.array_equal(self.rows[row], pattern(key)), key.hex()
        self.manager.complete_load(keys, ctx)

    def shutdown(self) -> None:
        self.rows = None
        self.manager.shutdown()


def written_for(
    writer: Engine, reader: Engine, num_keys: int
) -> tuple[list[OffloadKey], ReqContext]:
    """``writer`` stores ``key_of(i)`` for ``i < num_keys`` (a request of its own) and ``reader``
    opens request ``"r"``: returns the keys and that request, for the reader to look them up."""
    keys = [key_of(i) for i in range(num_keys)]
    ctx, req = ReqContext("w"), ReqContext("r")
    writer.manager.on_new_request(ctx)
    writer.store(keys, ctx)
    reader.manager.on_new_request(req)
    return keys, req


def assert_shared(writer: Engine, reader: Engine, num_keys: int) -> list[OffloadKey]:
    """What ``writer`` stores (``written_for``), ``reader`` promotes and reads bit-exact;
    returns the keys."""
    keys, req = written_for(writer, reader, num_keys)
    assert reader.promote(keys, req) == [True] * num_keys
    reader.assert_cpu_holds(keys, req)
    return keys


def job(job_id: int, keys: Sequence[bytes], rows: list[int], *, load: bool) -> JobMetadata:
    """A job naming primary ``rows`` directly (tests that drive the tier, not the manager)."""
    return JobMetadata(job_id, keys, np.array(rows, dtype=np.int64), load, ReqContext("t"))  # type: ignore[arg-type]


def collect(engine: Engine, ids: set[int]) -> dict[int, bool]:
    """Every job of ``ids`` reported exactly once (drain_jobs, then one poll): id -> success."""
    engine.tier.drain_jobs()
    results: list[JobResult] = list(engine.tier.get_finished_jobs())
    got = [r.job_id for r in results]
    assert sorted(got) == sorted(ids), f"reported {got}, expected {sorted(ids)}"
    return {r.job_id: r.success for r in results}


def seeded_engine(
    tmp_path: Path, url: str, engines: list[Engine], num_keys: int, **tier_kwargs: Any
) -> tuple[Engine, npt.NDArray[np.uint8], list[OffloadKey]]:
    """An engine (shut down by the ``engines`` fixture) whose rows ``i`` hold ``key_of(i)``'s
    pattern for ``i < num_keys``; returns it, its rows and those keys."""
    engine = Engine(tmp_path / "e", url, **tier_kwargs)
    engines.append(engine)
    rows = engine.rows
    assert rows is not None
    keys = [key_of(i) for i in range(num_keys)]
    for i, key in enumerate(keys):
        rows[i] = pattern(key)
    return engine, rows, keys


@contextlib.contextmanager
def limited_server(workdir: Path, maxmemory: str, policy: str) -> Iterator[RedisServer]:
    """A standalone server of its own limited to ``maxmemory`` (``--maxmemory-policy
    policy``), stopped on exit."""
    server = RedisServer(workdir, "--maxmemory", maxmemory, "--maxmemory-policy", policy)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A standalone server of its own (tests kill, pause and fill it)."""
    srv = RedisServer(tmp_path / "redis")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster3]:
    c = RedisCluster3(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    yield from closed_at_teardown(Engine.shutdown)
