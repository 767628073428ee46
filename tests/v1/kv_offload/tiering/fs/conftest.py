# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Fixtures of the filesystem-tier tests: a real spec, a page-aligned primary region, tiers.

Every tier is built over a real temporary directory and a real anonymous ``mmap`` primary region
(page-aligned, like the shared host region), with MB-sized rows.
"""

from __future__ import annotations

import hashlib
import itertools
import mmap
import struct
import subprocess
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tests.v1.kv_offload.utils import make_cpu_spec
from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE, payload_checksum
from vllm.v1.kv_offload.tiering.fs.block_io import HOST_TAG
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.fs.native_io import DISABLE_ENV

ROW_BYTES = 1 << 20
"""1 MiB rows: MB-sized blocks that keep the suite fast on 2 cores."""
NUM_ROWS = 16


def make_spec(
    row_bytes: int = ROW_BYTES, num_rows: int = NUM_ROWS, **run_overrides: Any
) -> CPUOffloadingSpec:
    """A real ``CPUOffloadingSpec`` whose rows are ``row_bytes`` (one worker, one group)."""
    return make_cpu_spec(row_bytes, num_rows, **run_overrides)


class Primary:
    """A page-aligned primary region: ``view`` (format "B", shape (rows, row_bytes)) and a numpy
    array over the same bytes."""

    def __init__(self, num_rows: int = NUM_ROWS, row_bytes: int = ROW_BYTES) -> None:
        self.num_rows = num_rows
        self.row_bytes = row_bytes
        self.mm = mmap.mmap(-1, num_rows * row_bytes)
        self.view = memoryview(self.mm).cast("B", (num_rows, row_bytes))
        self.rows: npt.NDArray[np.uint8] = np.frombuffer(self.mm, dtype=np.uint8).reshape(
            num_rows, row_bytes
        )

    def fill(self, row: int, key: OffloadKey) -> None:
        self.rows[row] = pattern(key, self.row_bytes)

    def holds(self, row: int, key: OffloadKey) -> bool:
        return bool(np.array_equal(self.rows[row], pattern(key, self.row_bytes)))

    def close(self) -> None:
        del self.rows
        self.view.release()
        self.mm.close()


_pattern_cache: dict[tuple[bytes, int], npt.NDArray[np.uint8]] = {}


def pattern(key: bytes, nbytes: int) -> npt.NDArray[np.uint8]:
    """Deterministic pseudo-random bytes of ``key`` (what a test stores as its row)."""
    cached = _pattern_cache.get((key, nbytes))
    if cached is None:
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        cached = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
        if len(_pattern_cache) > 256:
            _pattern_cache.clear()
        _pattern_cache[(key, nbytes)] = cached
    return cached


def key_of(i: int, group: int = 0) -> OffloadKey:
    """A 32-byte-hash key, like a real block hash."""
    return make_offload_key(hashlib.sha256(i.to_bytes(8, "little")).digest(), group)


_job_ids = itertools.count(1000)


def job(
    keys: list[OffloadKey], rows: list[int], *, load: bool, req: ReqContext | None = None
) -> JobMetadata:
    return JobMetadata(
        job_id=next(_job_ids),
        keys=tuple(keys),
        block_ids=np.array(rows, dtype=np.int64),
        is_promotion=load,
        req_context=req or ReqContext("req"),
    )


def run_jobs(tier: FileSystemSecondaryTier, *jobs: JobMetadata) -> dict[int, bool]:
    """Submit ``jobs``, drain the tier and return every reported ``job_id -> success``."""
    for j in jobs:
        (tier.submit_load if j.is_promotion else tier.submit_store)(j)
    tier.drain_jobs()
    results = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert sorted(results) == sorted(j.job_id for j in jobs), results
    return results


def store(
    tier: FileSystemSecondaryTier, primary: Primary, keys: list[OffloadKey], rows: list[int]
) -> bool:
    """Fill ``rows`` with the keys' patterns and store them as one job."""
    for key, row in zip(keys, rows, strict=True):
        primary.fill(row, key)
    j = job(keys, rows, load=False)
    return run_jobs(tier, j)[j.job_id]


def load(
    tier: FileSystemSecondaryTier, primary: Primary, keys: list[OffloadKey], rows: list[int]
) -> bool:
    """Zero ``rows`` and load the keys into them as one job."""
    for row in rows:
        primary.rows[row] = 0
    j = job(keys, rows, load=True)
    return run_jobs(tier, j)[j.job_id]


def resolve_lookups(
    tier: FileSystemSecondaryTier, keys: list[OffloadKey], req: ReqContext | None = None
) -> list[bool | None]:
    """The tier's answers for ``keys``, as one request: the lookups; if some deferred (None), one
    step end, the probe thread drained, and the lookups again."""
    req = req or ReqContext("lookup-req")
    answers = [tier.lookup(key, req) for key in keys]
    if None in answers:
        tier.on_schedule_end()
        assert tier.wait_lookups_idle(10)
        answers = [tier.lookup(key, req) for key in keys]
    tier.on_request_finished(req)
    return answers


def first_lookups(
    tier: FileSystemSecondaryTier, keys: list[OffloadKey], req: ReqContext | None = None
) -> list[bool | None]:
    """The answers of the step that asks (None: deferred to the probe), as one request, which
    is then finished."""
    req = req or ReqContext("first-lookup-req")
    answers = [tier.lookup(key, req) for key in keys]
    tier.on_request_finished(req)
    return answers


def share(*tiers: FileSystemSecondaryTier) -> None:
    """Wait until each of ``tiers`` (over one root, all started) has seen the others: a tier
    started before another registered learns of it at its next reconcile round, until then it
    may still take itself for the only writer."""
    for tier in tiers:
        assert tier.wait_reconciled(10)
        assert not tier.sole_writer


def register_dead_writer(tier: FileSystemSecondaryTier, *, create: bool = True) -> Path:
    """What a crashed instance on this host leaves in ``writers/``: its presence file, naming a
    process that no longer exists (the layout of ``docs/fs_tier.md``). ``create=False`` only
    names it, for a test that lays out the writer's other leftovers first."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    path = Path(tier.rank_dir) / "writers" / f"{HOST_TAG}.{proc.pid}.0badc0de"
    if create:
        path.touch()
    return path


def reseal_block_file(
    path: str, edit: Callable[[bytearray], None] | None = None, kind: int | None = None
) -> None:
    """Rewrite block file ``path`` as anyone who can write to the root could: ``edit`` its bytes
    (header and payload), then recompute its payload checksum (with ``kind``, or the kind its
    header names) and its header CRC (the layout of docs/fs_tier.md), so that the header stays
    well-formed. A MAC, if any, is left as it was."""
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        if edit is not None:
            edit(data)
        if kind is None:
            (kind,) = struct.unpack_from("<I", data, 24)
        payload = memoryview(data)[HEADER_SIZE:]
        struct.pack_into("<II", data, 24, kind, payload_checksum(payload, kind))
        payload.release()
        (key_len,) = struct.unpack_from("<I", data, 64)
        end = 68 + key_len
        struct.pack_into("<I", data, end, zlib.crc32(data[:end]))
        f.seek(0)
        f.write(data)


TierFactory = Callable[..., FileSystemSecondaryTier]


@pytest.fixture
def primary() -> Iterator[Primary]:
    p = Primary()
    yield p
    p.close()


@pytest.fixture
def python_io(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiers made after it make every system call from Python: for tests that inject faults
    into ``os`` calls, which the batched calls (``native_io``) do not go through. The batched
    calls hand every block that fails them to this same path (``test_native_io.py``)."""
    monkeypatch.setenv(DISABLE_ENV, "0")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "kv_root"


@pytest.fixture
def make_tier(root: Path, primary: Primary) -> Iterator[TierFactory]:
    """Build tiers over ``root`` and ``primary`` (overridable); all are shut down at teardown."""
    tiers: list[FileSystemSecondaryTier] = []

    def factory(**kwargs: Any) -> FileSystemSecondaryTier:
        spec = kwargs.pop("spec", None) or make_spec(primary.row_bytes, primary.num_rows)
        view = kwargs.pop("view", primary.view)
        kwargs.setdefault("root_dir", str(root))
        kwargs.setdefault("n_read_threads", 2)
        kwargs.setdefault("n_write_threads", 2)
        kwargs.setdefault("min_free_bytes", 0)
        tier = FileSystemSecondaryTier(spec, view, "fs", **kwargs)
        tiers.append(tier)
        assert tier.wait_until_ready(10)
        return tier

    yield factory
    for tier in tiers:
        tier.shutdown()
