# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``FileSystemSecondaryTier`` over real temporary directories with 1 MiB blocks."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.spec import RowLayout
from vllm.v1.kv_offload.tiering.base import JobMetadata
from vllm.v1.kv_offload.tiering.block_format import (
    CHECKSUM_CRC32,
    CHECKSUM_CRC32C,
    HEADER_SIZE,
    MAGIC,
)
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs import block_io, meters
from vllm.v1.kv_offload.tiering.fs.block_io import HOST_TAG
from vllm.v1.kv_offload.tiering.fs.lookup import FsLookups
from vllm.v1.kv_offload.tiering.fs.manager import STORAGE_MEDIUM, FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.fs.scan import RankDirWalker, ScanStats
from vllm.v1.kv_offload.tiering.fs.transfers import BlockTransfers, JobChunk

from .conftest import (
    ROW_BYTES,
    Primary,
    TierFactory,
    job,
    key_of,
    load,
    make_spec,
    reseal_block_file,
    resolve_lookups,
    run_jobs,
    share,
    store,
)
from .tier_state import (
    block_file,
    check_index,
    counters,
    descriptors_of,
    lru_keys,
    scan_stats,
    threads_named,
    usage,
)

FILE_SIZE = HEADER_SIZE + ROW_BYTES


def _files_under(path: str | Path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("*") if p.is_file() or p.is_symlink())


def _block_files(tier: FileSystemSecondaryTier) -> list[Path]:
    return [p for p in _files_under(tier.rank_dir) if p.suffix == ".bin"]


def _tmp_files(tier: FileSystemSecondaryTier) -> list[Path]:
    return [p for p in _files_under(tier.rank_dir) if p.name.endswith(".tmp")]


def _event_keys(tier: FileSystemSecondaryTier) -> list[tuple[bool, set[OffloadKey]]]:
    """The tier's events as (removed, keys); keys of one merged event are a set because blocks
    of one job complete in any order."""
    events = list(tier.take_events())
    assert all(e.medium == STORAGE_MEDIUM for e in events)
    return [(e.removed, set(e.keys)) for e in events]


class Gate:
    """Holds gated operations: each sets ``started`` and waits for ``release``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.started = threading.Event()
        self.release = threading.Event()

    def wait(self, started: threading.Event | None = None) -> None:
        """Set ``started`` (default: the gate's) and wait for ``release``."""
        (started or self.started).set()
        assert self.release.wait(30), "test gate never released"

    def hold(self, obj: Any, name: str, started: threading.Event | None = None) -> None:
        """Make ``obj.name`` pass the gate (``wait(started)``) before it runs."""
        real = getattr(obj, name)

        def gated(*args: Any, **kwargs: Any) -> Any:
            self.wait(started)
            return real(*args, **kwargs)

        self._monkeypatch.setattr(obj, name, gated)

    def submit(
        self, tier: FileSystemSecondaryTier, j: JobMetadata, started: threading.Event | None = None
    ) -> JobMetadata:
        """Submit ``j`` with every I/O of its direction held; return once one started.

        The I/O thread that took ``j`` stays busy until ``release`` is set.
        """
        started = started or self.started
        self.hold(BlockTransfers, "load" if j.is_promotion else "store", started)
        (tier.submit_load if j.is_promotion else tier.submit_store)(j)
        assert started.wait(10)
        return j


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate(monkeypatch)
    yield g
    g.release.set()


# ---------------------------------------------------------------------------------------------
# Round trip, layout, dedupe, lookups
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("o_direct", ["auto", False])
def test_store_then_load_is_bit_exact(
    make_tier: TierFactory, primary: Primary, o_direct: bool | str
) -> None:
    tier = make_tier(o_direct=o_direct)
    if o_direct is False:
        assert not tier.uses_o_direct
    keys = [key_of(i) for i in range(4)]
    assert store(tier, primary, keys, [0, 1, 2, 3])
    assert load(tier, primary, keys[::-1], [8, 9, 10, 11])
    for i, key in enumerate(keys[::-1]):
        assert primary.holds(8 + i, key)
    # Files stay after a load; each is header + row.
    assert [p.stat().st_size for p in _block_files(tier)] == [FILE_SIZE] * 4
    assert counters(tier)["blocks_written"] == 4
    assert counters(tier)["blocks_loaded"] == 4
    assert counters(tier)["store_busy_us"] > 0 and counters(tier)["load_busy_us"] > 0
    assert usage(tier).used_bytes == 4 * FILE_SIZE
    check_index(tier)


def test_files_with_the_older_crc32_payload_checksum_stay_readable(
    make_tier: TierFactory, primary: Primary
) -> None:
    # The tier writes CRC-32C (checksum kind 2); it wrote CRC-32 (kind 1) before. A file
    # rewritten here as the older tier wrote it is served, verified with its own kind: read
    # with the other one its checksum would not match and the load would fail.
    tier = make_tier()
    keys = [key_of(1), key_of(2)]
    assert store(tier, primary, keys, [0, 1])
    path = block_file(tier, keys[0])
    with open(path, "rb") as f:
        assert struct.unpack("<I", f.read(28)[24:]) == (CHECKSUM_CRC32C,)
    reseal_block_file(path, kind=CHECKSUM_CRC32)
    assert load(tier, primary, keys, [4, 5])
    assert primary.holds(4, keys[0]) and primary.holds(5, keys[1])
    assert counters(tier)["corrupt_removed"] == 0


def test_layout_and_config_json(make_tier: TierFactory, primary: Primary, root: Path) -> None:
    tier = make_tier()
    short = make_offload_key(b"\x01", 7)  # too short to name directories: digested name
    long_hash = make_offload_key(bytes(range(80)), 0)  # too long: digested name
    key = key_of(5, group=3)
    assert store(tier, primary, [key, short, long_hash], [0, 1, 2])

    rank = Path(tier.rank_dir)
    assert rank.parent == root and rank.name.endswith("_r0")
    base = root / rank.name.removesuffix("_r0")
    model, digest = base.name.rsplit("_", 1)
    assert model == "org_test-model" and len(digest) == 16
    fields = json.loads((base / "config.json").read_text())
    assert fields["model_name"] == "org/test-model"
    assert fields["row_bytes"] == ROW_BYTES and fields["format_version"] == 1

    hex_hash = key[:-4].hex()
    expected = Path(tier.rank_dir) / hex_hash[:3] / f"{hex_hash[3:5]}_g3" / f"{hex_hash}.bin"
    assert Path(block_file(tier, key)) == expected and expected.is_file()
    for digested in (short, long_hash):
        path = Path(block_file(tier, digested))
        assert path.name.startswith("z") and len(path.name) == 1 + 64 + 4
        assert path.is_file()
    head = expected.read_bytes()[:HEADER_SIZE]
    assert head.startswith(MAGIC) and key in head
    assert load(tier, primary, [short, long_hash], [5, 6])
    assert primary.holds(5, short) and primary.holds(6, long_hash)


def test_store_skips_blocks_already_present(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier(enable_events=True)
    keys = [key_of(i) for i in range(3)]
    assert store(tier, primary, keys[:2], [0, 1])
    inodes = {p: p.stat().st_ino for p in _block_files(tier)}
    assert _event_keys(tier) == [(False, set(keys[:2]))]
    assert store(tier, primary, keys, [0, 1, 2])
    assert {p: p.stat().st_ino for p in _block_files(tier) if p in inodes} == inodes
    assert counters(tier)["blocks_written"] == 3 and counters(tier)["blocks_skipped"] == 2
    assert _event_keys(tier) == [(False, set(keys[2:]))]  # only the block really written
    assert usage(tier).used_bytes == 3 * FILE_SIZE


def test_empty_job_and_pending_work(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier()
    assert not tier.has_pending_work()
    empty = job([], [], load=False)
    assert run_jobs(tier, empty) == {empty.job_id: True}
    assert not tier.has_pending_work()


def test_registered_in_factory(root: Path, primary: Primary) -> None:
    spec = make_spec()
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root_dir": str(root), "n_read_threads": 1, "n_write_threads": 1},
        primary.view,
        spec,
    )
    try:
        assert isinstance(tier, FileSystemSecondaryTier) and tier.tier_type == "fs"
    finally:
        tier.shutdown()
    with pytest.raises(ValueError, match="bogus"):
        SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": str(root), "bogus": 1}, primary.view, spec
        )


# ---------------------------------------------------------------------------------------------
# Construction errors
# ---------------------------------------------------------------------------------------------


def test_invalid_root_dir_fails_at_construction(tmp_path: Path, primary: Primary) -> None:
    spec = make_spec()
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    for bad in (a_file, a_file / "below"):
        with pytest.raises(OSError, match=str(bad)):
            FileSystemSecondaryTier(spec, primary.view, "fs", root_dir=str(bad))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "root_dir.*required"),
        ({"root_dir": ""}, "root_dir"),
        ({"n_read_threads": 0}, "n_read_threads"),
        ({"n_write_threads": True}, "n_write_threads"),
        ({"max_bytes": -1}, "max_bytes"),
        ({"max_bytes": "12 parsecs"}, "max_bytes"),
        ({"max_bytes": 1000}, "smaller than one block file"),
        ({"min_free_bytes": "x"}, "min_free_bytes"),
        ({"o_direct": "yes"}, "o_direct"),
        ({"enable_events": 1}, "enable_events"),
        ({"stale_tmp_age_s": -1}, "stale_tmp_age_s"),
        ({"unknown_key": 1}, "unknown config keys"),
    ],
)
def test_config_keys_are_validated(
    root: Path, primary: Primary, kwargs: dict[str, Any], match: str
) -> None:
    if "root_dir" not in kwargs and kwargs:
        kwargs = {"root_dir": str(root), **kwargs}
    with pytest.raises(ValueError, match=match):
        FileSystemSecondaryTier(make_spec(), primary.view, "fs", **kwargs)
    assert not root.exists() or not any(root.rglob("*.bin"))


def test_config_json_of_another_run_is_refused(make_tier: TierFactory, root: Path) -> None:
    tier = make_tier()
    config_path = Path(tier.rank_dir.removesuffix("_r0")) / "config.json"
    tier.shutdown()
    fields = json.loads(config_path.read_text())
    fields["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(fields))
    with pytest.raises(ValueError, match="another run"):
        make_tier()


def test_different_runs_never_collide(make_tier: TierFactory, primary: Primary) -> None:
    fp16 = make_tier()
    fp8 = make_tier(spec=make_spec(dtype="fp8"))
    tp2 = make_tier(spec=make_spec(tensor_parallel_size=2, gpu_kv_bytes_per_block=ROW_BYTES // 2))
    assert len({fp16.rank_dir, fp8.rank_dir, tp2.rank_dir}) == 3
    key = key_of(1)
    assert store(fp16, primary, [key], [0])
    assert resolve_lookups(fp8, [key]) == [False]
    assert resolve_lookups(tp2, [key]) == [False]


# ---------------------------------------------------------------------------------------------
# Integrity: permanent faults delete, transient faults keep
# ---------------------------------------------------------------------------------------------


def test_missing_file_fails_the_whole_job_once(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier()
    keys = [key_of(i) for i in range(3)]
    assert store(tier, primary, keys, [0, 1, 2])
    os.unlink(block_file(tier, keys[1]))
    j = job(keys, [4, 5, 6], load=True)
    assert run_jobs(tier, j) == {j.job_id: False}
    assert list(tier.get_finished_jobs()) == []
    # The vanished file is a miss, and no longer accounted.
    assert usage(tier).used_bytes == 2 * FILE_SIZE
    assert resolve_lookups(tier, keys) == [True, False, True]
    assert load(tier, primary, [keys[0], keys[2]], [4, 6])


def test_stats_show_a_tier_that_failed_every_store_and_load(
    make_tier: TierFactory, primary: Primary
) -> None:
    """What a run's verdict reads to tell a tier that served nothing from one that worked: the
    jobs reported and those that failed, per direction (``get_stats().counters``)."""
    tier = make_tier(min_free_bytes="1000TiB")  # no filesystem has room: every store fails
    stores = [job([key_of(i)], [i], load=False) for i in range(3)]
    loads = [job([key_of(i)], [8 + i], load=True) for i in range(2)]
    assert set(run_jobs(tier, *stores, *loads).values()) == {False}
    counters = tier.get_stats().counters
    assert counters["store_jobs"] == counters["store_jobs_failed"] == 3
    assert counters["load_jobs"] == counters["load_jobs_failed"] == 2
    assert counters.get("blocks_written", 0) == counters.get("blocks_loaded", 0) == 0

    healthy = make_tier(root_dir=str(Path(tier.rank_dir).parent / "other"))
    assert store(healthy, primary, [key_of(0)], [0]) and load(healthy, primary, [key_of(0)], [1])
    assert not load(healthy, primary, [key_of(9)], [2])
    counters = healthy.get_stats().counters
    assert (counters["store_jobs"], counters.get("store_jobs_failed", 0)) == (1, 0)
    assert (counters["load_jobs"], counters["load_jobs_failed"]) == (2, 1)


def _truncate(path: str) -> None:
    os.truncate(path, HEADER_SIZE + 10)


def _flip_payload_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + ROW_BYTES // 2)
        byte = f.read(1)[0]
        f.seek(HEADER_SIZE + ROW_BYTES // 2)
        f.write(bytes([byte ^ 0x10]))


def _flip_header_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(20)  # inside payload_len
        byte = f.read(1)[0]
        f.seek(20)
        f.write(bytes([byte ^ 0x01]))


def _garbage(path: str) -> None:
    Path(path).write_bytes(os.urandom(FILE_SIZE))


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_payload_bit, _flip_header_bit, _garbage], ids=lambda f: f.__name__
)
def test_corrupt_file_fails_load_and_is_deleted(
    make_tier: TierFactory, primary: Primary, damage: Callable[[str], None]
) -> None:
    tier = make_tier(enable_events=True)
    keys = [key_of(1), key_of(2)]
    assert store(tier, primary, keys, [0, 1])
    _event_keys(tier)
    path = block_file(tier, keys[0])
    damage(path)
    assert not load(tier, primary, keys, [4, 5])
    assert not os.path.exists(path)
    assert _event_keys(tier) == [(True, {keys[0]})]
    assert counters(tier)["corrupt_removed"] == 1
    assert usage(tier).used_bytes == FILE_SIZE
    assert resolve_lookups(tier, keys) == [False, True]
    check_index(tier)


def test_foreign_file_of_another_key_is_deleted(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier()
    mine, other = key_of(1), key_of(2)
    assert store(tier, primary, [other], [0])
    target = Path(block_file(tier, mine))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(block_file(tier, other), target)  # valid file, wrong key
    assert not load(tier, primary, [mine], [3])
    assert not target.exists()
    assert load(tier, primary, [other], [4]) and primary.holds(4, other)


def test_file_of_another_run_is_deleted(make_tier: TierFactory, primary: Primary) -> None:
    fp16 = make_tier()
    fp8 = make_tier(spec=make_spec(dtype="fp8"))
    key = key_of(1)
    assert store(fp8, primary, [key], [0])
    target = Path(block_file(fp16, key))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(block_file(fp8, key), target)  # same key, other run's bytes
    assert not load(fp16, primary, [key], [3])
    assert not target.exists()


@pytest.mark.parametrize("shared", [False, True], ids=["sole writer", "shared root"])
def test_failed_load_turns_lookup_into_a_miss(
    make_tier: TierFactory, primary: Primary, shared: bool
) -> None:
    tier = make_tier()
    if shared:
        share(tier, make_tier())
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    req = ReqContext("waiting")
    assert tier.lookup(key, req) is True, "a key the index holds answers at once"
    _truncate(block_file(tier, key))
    j = job([key], [1], load=True, req=req)
    assert run_jobs(tier, j) == {j.job_id: False}
    # Not True again (no livelock on a broken block): the corrupt file was deleted and
    # forgotten, so alone the tier knows it is absent, beside another writer it probes.
    assert resolve_lookups(tier, [key], req) == [False]


@pytest.mark.parametrize("shared", [False, True], ids=["sole writer", "shared root"])
def test_symlinked_block_file_is_never_followed(
    make_tier: TierFactory, primary: Primary, tmp_path: Path, shared: bool
) -> None:
    writer = make_tier()
    key = key_of(1)
    assert store(writer, primary, [key], [0])
    path = Path(block_file(writer, key))
    outside = tmp_path / "outside.bin"
    shutil.move(path, outside)
    path.symlink_to(outside)
    before = outside.read_bytes()
    # The writer's index still holds the key (the swap happened behind its back): a stale
    # "present" is a failed load, never a followed link.
    assert resolve_lookups(writer, [key]) == [True]
    assert not load(writer, primary, [key], [1])  # ELOOP: transient, nothing deleted
    assert path.is_symlink() and outside.read_bytes() == before
    assert not primary.holds(1, key)
    # An instance started now never indexes it: absent at once when alone, after a probe (one
    # lstat) beside another writer.
    if not shared:
        writer.shutdown()
    fresh = make_tier()
    if shared:
        share(writer, fresh)
    assert resolve_lookups(fresh, [key]) == [False]
    assert not load(fresh, primary, [key], [1])
    assert path.is_symlink() and outside.read_bytes() == before
    assert not primary.holds(1, key)


def test_symlinked_directory_is_never_followed(
    make_tier: TierFactory, primary: Primary, tmp_path: Path
) -> None:
    writer = make_tier()
    key, neighbour = key_of(1), key_of(2)
    assert store(writer, primary, [key], [0])
    tier = make_tier()  # shares the root: knows the file from its scan
    share(writer, tier)
    dir1 = Path(block_file(tier, key)).parent.parent
    outside = tmp_path / "outside_dir"
    shutil.move(dir1, outside)
    dir1.symlink_to(outside, target_is_directory=True)
    snapshot = {p: p.read_bytes() for p in _files_under(outside)}
    # A transient error (ELOOP/ENOTDIR) keeps the file in the index, and lookups find it until
    # max_read_failures (3) reads in a row failed; then the probe, which lstats each component,
    # answers.
    for _ in range(3):
        assert resolve_lookups(tier, [key]) == [True]
        assert not load(tier, primary, [key], [1])
    assert resolve_lookups(tier, [key]) == [False]
    # A store whose path runs through the symlink fails instead of writing outside the root.
    clash = make_offload_key(key[:-4], 1)  # same <hhh>, other group
    assert Path(block_file(tier, clash)).parent.parent == dir1
    assert not store(tier, primary, [clash], [2])
    assert {p: p.read_bytes() for p in _files_under(outside)} == snapshot
    assert store(tier, primary, [neighbour], [3])


@pytest.mark.usefixtures("python_io")
@pytest.mark.parametrize("err", [errno.EACCES, errno.EIO, errno.EMFILE, errno.ELOOP])
def test_transient_open_error_fails_job_and_keeps_file(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch, err: int
) -> None:
    tier = make_tier()
    keys = [key_of(1), key_of(2)]
    assert store(tier, primary, keys, [0, 1])
    victim = Path(block_file(tier, keys[1])).name
    real_open = os.open

    def failing_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if path == victim:
            raise OSError(err, os.strerror(err), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(block_io.os, "open", failing_open)
    assert not load(tier, primary, keys, [4, 5])
    monkeypatch.undo()
    assert os.path.exists(block_file(tier, keys[1]))
    assert usage(tier).used_bytes == 2 * FILE_SIZE
    assert load(tier, primary, keys, [4, 5]) and primary.holds(5, keys[1])


# ---------------------------------------------------------------------------------------------
# Capacity: ENOSPC, nearly full, max_bytes
# ---------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("python_io")  # the fault is injected into Python's os.writev
def test_enospc_mid_write_removes_tmp_and_tier_keeps_working(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(enable_events=True)
    real_writev = os.writev
    headers = 0

    def writev_header_then_enospc(fd: int, bufs: list[memoryview]) -> int:
        # A block file is written as [header, payload]: the header reaches the tmp file, then
        # the disk is "full".
        nonlocal headers
        if len(bufs) < 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        headers += 1
        return real_writev(fd, bufs[:1])

    keys = [key_of(1), key_of(2)]
    with monkeypatch.context() as m:
        m.setattr(os, "writev", writev_header_then_enospc)
        assert not store(tier, primary, keys, [0, 1])
    assert headers == 2
    assert _tmp_files(tier) == [] and _block_files(tier) == []
    assert usage(tier).used_bytes == 0 and list(tier.take_events()) == []
    assert store(tier, primary, keys, [0, 1])
    assert load(tier, primary, keys, [2, 3]) and primary.holds(3, keys[1])


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    size = 5 * FILE_SIZE + FILE_SIZE // 2  # room for five block files and a half
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs privileges): {proc.stderr.decode()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_real_enospc_on_a_full_tmpfs(
    make_tier: TierFactory, primary: Primary, small_tmpfs: Path
) -> None:
    tier = make_tier(root_dir=str(small_tmpfs), min_free_bytes=0)
    keys = [key_of(i) for i in range(8)]
    results = [store(tier, primary, [key], [i]) for i, key in enumerate(keys)]
    assert results[:4] == [True] * 4 and False in results
    assert _tmp_files(tier) == []
    on_disk = len(_block_files(tier))
    assert on_disk == sum(results)
    assert usage(tier).used_bytes == on_disk * FILE_SIZE
    # The tier keeps working: loads succeed, and a store succeeds once space is freed.
    assert load(tier, primary, keys[:1], [10]) and primary.holds(10, keys[0])
    os.unlink(block_file(tier, keys[1]))
    os.unlink(block_file(tier, keys[2]))
    assert store(tier, primary, [keys[-1]], [15])


def test_stops_storing_when_nearly_full_and_logs_once(
    make_tier: TierFactory, primary: Primary, caplog: pytest.LogCaptureFixture, root: Path
) -> None:
    root.mkdir()
    st = os.statvfs(root)
    tier = make_tier(min_free_bytes=st.f_bavail * st.f_frsize + (1 << 40))
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        for i in range(3):
            assert not store(tier, primary, [key_of(i)], [i])
    stopped = [r for r in caplog.records if "stopped storing" in r.getMessage()]
    assert len(stopped) == 1
    assert _block_files(tier) == [] and _tmp_files(tier) == []


@pytest.mark.parametrize("left_bytes", [None, 100], ids=["deleted", "truncated"])
def test_failed_store_accounts_a_file_changed_behind_the_tier(
    make_tier: TierFactory,
    primary: Primary,
    monkeypatch: pytest.MonkeyPatch,
    left_bytes: int | None,
) -> None:
    tier = make_tier()
    keys = [key_of(1), key_of(2)]
    assert store(tier, primary, keys, [0, 1])
    path = block_file(tier, keys[0])
    if left_bytes is None:
        os.unlink(path)
    else:
        os.truncate(path, left_bytes)
    assert usage(tier).used_bytes == 2 * FILE_SIZE  # the tier cannot know yet
    real_statvfs = os.statvfs

    def nearly_full(fd: Any) -> Any:
        st = real_statvfs(fd)
        return os.statvfs_result((*st[:4], 0, *st[5:]))  # f_bavail = 0

    monkeypatch.setattr(meters.os, "statvfs", nearly_full)
    assert not store(tier, primary, [keys[0]], [0])
    monkeypatch.undo()
    # Counted as it is on disk: gone, or (truncated, the wrong size) deleted, never indexed.
    assert usage(tier).used_bytes == FILE_SIZE
    check_index(tier)
    assert store(tier, primary, [keys[0]], [0])
    assert usage(tier).used_bytes == 2 * FILE_SIZE


def test_max_bytes_evicts_least_recently_used(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier(max_bytes=3 * FILE_SIZE, enable_events=True)
    keys = [key_of(i) for i in range(5)]
    for i in range(3):  # one job each: blocks of one job complete in any order
        assert store(tier, primary, [keys[i]], [i])
    tier.touch([keys[0]], ReqContext("r"))  # keys[1] is now the least recently used
    assert store(tier, primary, [keys[3]], [3])
    assert not os.path.exists(block_file(tier, keys[1]))
    assert load(tier, primary, [keys[2]], [8])  # a load counts as a use
    assert store(tier, primary, [keys[4]], [4])
    assert not os.path.exists(block_file(tier, keys[0]))
    assert _event_keys(tier) == [
        (False, set(keys[:3])),  # consecutive stored events are merged
        (True, {keys[1]}),
        (False, {keys[3]}),
        (True, {keys[0]}),
        (False, {keys[4]}),
    ]
    assert usage(tier).used_bytes == 3 * FILE_SIZE == len(_block_files(tier)) * FILE_SIZE
    assert resolve_lookups(tier, keys) == [False, False, True, True, True]
    check_index(tier)


def _wait_results(tier: FileSystemSecondaryTier, count: int) -> dict[int, bool]:
    """Collect ``count`` job results while other jobs are held (drain_jobs would block)."""
    deadline = time.monotonic() + 10
    finished: dict[int, bool] = {}
    while len(finished) < count and time.monotonic() < deadline:
        finished.update((r.job_id, r.success) for r in tier.get_finished_jobs())
        time.sleep(0.005)  # the tier's result queue has no wait primitive besides drain_jobs
    return finished


def test_blocks_being_loaded_are_never_evicted(
    make_tier: TierFactory,
    primary: Primary,
    gate: Gate,
) -> None:
    tier = make_tier(max_bytes=2 * FILE_SIZE, n_read_threads=1, n_write_threads=1)
    a, b, c = key_of(0), key_of(1), key_of(2)
    assert store(tier, primary, [a, b], [0, 1])  # a is the least recently used block
    load_job = gate.submit(tier, job([a], [8], load=True))
    # a is pinned by the held load: storing c evicts b instead (on the other I/O thread).
    primary.fill(2, c)
    store_c = job([c], [2], load=False)
    tier.submit_store(store_c)
    assert _wait_results(tier, 1) == {store_c.job_id: True}
    assert os.path.exists(block_file(tier, a)) and not os.path.exists(block_file(tier, b))
    gate.release.set()
    tier.drain_jobs()
    assert {r.job_id: r.success for r in tier.get_finished_jobs()} == {load_job.job_id: True}
    assert primary.holds(8, a)
    assert usage(tier).num_pinned == 0
    check_index(tier)


def test_store_fails_when_only_pinned_blocks_could_be_evicted(
    make_tier: TierFactory,
    primary: Primary,
    gate: Gate,
) -> None:
    tier = make_tier(max_bytes=FILE_SIZE, n_read_threads=1, n_write_threads=1)
    a, b = key_of(0), key_of(1)
    assert store(tier, primary, [a], [0])
    load_job = gate.submit(tier, job([a], [8], load=True))
    primary.fill(1, b)
    store_b = job([b], [1], load=False)
    tier.submit_store(store_b)
    assert _wait_results(tier, 1) == {store_b.job_id: False}
    assert _tmp_files(tier) == [] and not os.path.exists(block_file(tier, b))
    gate.release.set()
    tier.drain_jobs()
    assert {r.job_id: r.success for r in tier.get_finished_jobs()} == {load_job.job_id: True}
    assert store(tier, primary, [b], [1])  # a is evictable again
    assert not os.path.exists(block_file(tier, a))
    assert usage(tier).used_bytes == FILE_SIZE


# ---------------------------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------------------------


def test_drain_jobs_waits_for_in_flight_work(
    make_tier: TierFactory,
    primary: Primary,
    gate: Gate,
) -> None:
    tier = make_tier()
    j = gate.submit(tier, job([key_of(1)], [0], load=False))
    assert tier.has_pending_work()
    drained = threading.Event()
    drainer = threading.Thread(target=lambda: (tier.drain_jobs(), drained.set()))
    drainer.start()
    assert not drained.wait(0.2)
    gate.release.set()
    drainer.join(10)
    assert drained.is_set()
    assert [(r.job_id, r.success) for r in tier.get_finished_jobs()] == [(j.job_id, True)]


def test_shutdown_discards_queued_tasks_and_reports_them_failed(
    make_tier: TierFactory,
    primary: Primary,
    gate: Gate,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier = make_tier(n_read_threads=1, n_write_threads=1)
    keys = [key_of(i) for i in range(4)]
    assert store(tier, primary, keys[:2], [0, 1])
    running = gate.submit(tier, job([keys[0]], [4], load=True))
    # Park the other I/O thread on a store, so that everything submitted next stays queued.
    parked = job([keys[2]], [2], load=False)
    gate.submit(tier, parked, threading.Event())
    queued = [job([keys[1]], [5], load=True), job([keys[3]], [3], load=False)]
    for j in queued:
        (tier.submit_load if j.is_promotion else tier.submit_store)(j)
    # Release the held I/O only once shutdown has dropped the queued jobs: released earlier,
    # the freed I/O threads would run them first (shutdown stops lookups and the reconciler
    # before the pool). If shutdown never drops them, the gate is never released and the
    # stopper stays blocked, which fails the test below.
    real_cancel = JobChunk.cancel
    cancelled: list[JobChunk] = []

    def cancel(chunk: JobChunk) -> None:
        real_cancel(chunk)
        cancelled.append(chunk)
        if len(cancelled) == len(queued):  # each queued job is one chunk of one block
            gate.release.set()

    monkeypatch.setattr(JobChunk, "cancel", cancel)
    stopper = threading.Thread(target=tier.shutdown)
    stopper.start()
    stopper.join(20)
    assert not stopper.is_alive()
    results = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert results == {
        running.job_id: True,
        parked.job_id: True,
        queued[0].job_id: False,
        queued[1].job_id: False,
    }
    assert primary.holds(4, keys[0])
    assert usage(tier).num_pinned == 0
    assert not [t for t in threading.enumerate() if t.name.startswith("vllm_fs_tier_fs")]


# ---------------------------------------------------------------------------------------------
# Restart and sharing
# ---------------------------------------------------------------------------------------------


def test_restart_serves_existing_blocks_and_rebuilds_usage(
    make_tier: TierFactory, primary: Primary
) -> None:
    first = make_tier()
    keys = [key_of(i) for i in range(4)]
    assert store(first, primary, keys, [0, 1, 2, 3])
    first.shutdown()
    second = make_tier()
    scan = scan_stats(second)
    assert scan is not None and scan.completed and scan.blocks == 4
    assert usage(second).used_bytes == 4 * FILE_SIZE
    assert sorted(lru_keys(second)) == sorted(keys)
    assert resolve_lookups(second, keys) == [True] * 4
    assert load(second, primary, keys, [8, 9, 10, 11])
    assert all(primary.holds(8 + i, key) for i, key in enumerate(keys))


def test_restart_scan_evicts_down_to_max_bytes(make_tier: TierFactory, primary: Primary) -> None:
    first = make_tier()
    keys = [key_of(i) for i in range(4)]
    assert store(first, primary, keys, [0, 1, 2, 3])
    first.shutdown()
    second = make_tier(max_bytes=2 * FILE_SIZE, enable_events=True)
    assert usage(second).used_bytes == 2 * FILE_SIZE
    assert len(_block_files(second)) == 2
    removed = [k for is_removed, ks in _event_keys(second) if is_removed for k in ks]
    assert len(removed) == 2


def test_restart_removes_leftover_tmp_files(make_tier: TierFactory, primary: Primary) -> None:
    first = make_tier()
    key = key_of(1)
    assert store(first, primary, [key], [0])
    leaf = Path(block_file(first, key)).parent
    first.shutdown()
    dead_pid = _exited_pid()
    old = time.time() - 3600
    leftovers = {
        "dead_writer": leaf / f".{'ab' * 16}.{HOST_TAG}.{dead_pid}.0badc0de.12345678.tmp",
        "old_other_host": leaf / f".{'cd' * 16}.ffffffff.1.0badc0de.12345678.tmp",
        "dead_writer_in_this_process": leaf
        / f".{'ef' * 16}.{HOST_TAG}.{os.getpid()}.0badc0de.12345678.tmp",
    }
    kept = {
        "recent_other_host": leaf / f".{'01' * 16}.ffffffff.1.0badc0de.12345678.tmp",
        "not_ours": leaf / "something-else.tmp",
    }
    for path in [*leftovers.values(), *kept.values()]:
        path.write_bytes(b"partial")
    os.utime(leftovers["old_other_host"], (old, old))
    second = make_tier(stale_tmp_age_s=600)
    scan = scan_stats(second)
    assert scan is not None and scan.tmp_removed == 3
    assert not any(p.exists() for p in leftovers.values())
    assert all(p.exists() for p in kept.values())
    assert usage(second).used_bytes == FILE_SIZE


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_two_instances_share_one_root(make_tier: TierFactory, primary: Primary) -> None:
    a = make_tier(enable_events=True, max_bytes=2 * FILE_SIZE)
    b = make_tier(enable_events=True)
    assert a.rank_dir == b.rank_dir
    share(a, b)
    k1, k2, k3 = key_of(1), key_of(2), key_of(3)
    assert store(a, primary, [k1], [0])
    assert resolve_lookups(b, [k1]) == [True]
    assert load(b, primary, [k1], [8]) and primary.holds(8, k1)
    assert usage(b).used_bytes == FILE_SIZE  # b learnt about a's file
    assert store(b, primary, [k1, k2], [0, 1])  # k1 exists: skipped, k2 written
    assert _event_keys(b) == [(False, {k2})]
    assert counters(b)["blocks_skipped"] == 1
    assert resolve_lookups(a, [k2]) == [True]
    # a evicts k1 (its LRU) to store k3; b sees a miss, not an error.
    assert store(a, primary, [k3], [2])
    assert not os.path.exists(block_file(a, k1))
    assert not load(b, primary, [k1], [9])
    assert usage(b).used_bytes == FILE_SIZE  # the vanished file is no longer accounted
    assert resolve_lookups(b, [k1, k2, k3]) == [False, True, True]
    check_index(a)
    check_index(b)


def test_scan_never_blocks_the_scheduler(
    root: Path,
    primary: Primary,
    gate: Gate,
) -> None:
    spec = make_spec()
    first = FileSystemSecondaryTier(spec, primary.view, "fs", root_dir=str(root), min_free_bytes=0)
    key = key_of(1)
    assert store(first, primary, [key], [0])
    first.shutdown()
    gate.hold(RankDirWalker, "scan")
    tier = FileSystemSecondaryTier(
        spec, primary.view, "fs", root_dir=str(root), min_free_bytes=0, n_read_threads=1,
        n_write_threads=1,
    )  # fmt: skip
    try:
        assert gate.started.wait(10)
        # The scan is stuck, yet lookups, loads and stores all work.
        assert resolve_lookups(tier, [key]) == [True]
        assert load(tier, primary, [key], [5]) and primary.holds(5, key)
        assert store(tier, primary, [key_of(2)], [1])
        assert not tier.wait_until_ready(0)
        gate.release.set()
        scan = scan_stats(tier)
        assert scan is not None and scan.completed
        assert usage(tier).used_bytes == 2 * FILE_SIZE
        check_index(tier)
    finally:
        gate.release.set()
        tier.shutdown()


def test_rows_outside_the_primary_view_are_rejected(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier()
    with pytest.raises(AssertionError, match="outside"):
        tier.submit_store(job([key_of(1)], [primary.num_rows], load=False))
    assert not tier.has_pending_work()


def test_shutdown_keeps_directories_open_while_a_lookup_is_stuck(
    make_tier: TierFactory,
    monkeypatch: pytest.MonkeyPatch,
    gate: Gate,
    caplog: pytest.LogCaptureFixture,
) -> None:
    other = make_tier()  # another writer: a key the index lacks is probed
    others_fds = set(descriptors_of(other.rank_dir))
    others_threads = set(threads_named("vllm_offloading_lookup_fs"))
    tier = make_tier()
    share(tier, other)
    gate.hold(FsLookups, "batch_lookup")
    # A timeout only tests shorten: no public setting for how long shutdown waits for a thread.
    monkeypatch.setattr(tier, "_THREAD_STOP_TIMEOUT_S", 0.05)
    assert tier.lookup(key_of(1), ReqContext("r")) is None
    tier.on_schedule_end()  # posts the lookup batch to the probe thread
    assert gate.started.wait(10)
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering"):
        tier.shutdown()
    assert any("descriptors stay open" in r.getMessage() for r in caplog.records)
    open_fds = set(descriptors_of(tier.rank_dir)) - others_fds
    assert open_fds, "the stuck probe's directory is still open"
    gate.release.set()
    for thread in set(threads_named("vllm_offloading_lookup_fs")) - others_threads:
        thread.join(10)
        assert not thread.is_alive(), "the probe finished once released"
    for fd in open_fds:
        os.close(fd)


def test_shutdown_keeps_directories_open_while_the_scan_is_stuck(
    root: Path,
    primary: Primary,
    monkeypatch: pytest.MonkeyPatch,
    gate: Gate,
    caplog: pytest.LogCaptureFixture,
) -> None:

    def stuck_scan(*args: Any, **kwargs: Any) -> ScanStats:
        """A stat() hung on a dead NFS server."""
        gate.wait()
        return ScanStats()

    monkeypatch.setattr(RankDirWalker, "scan", stuck_scan)
    # A timeout only tests shorten: no public setting for how long shutdown waits for a thread.
    monkeypatch.setattr(FileSystemSecondaryTier, "_THREAD_STOP_TIMEOUT_S", 0.05)
    tier = FileSystemSecondaryTier(
        make_spec(primary.row_bytes, primary.num_rows),
        primary.view,
        "fs",
        root_dir=str(root),
        min_free_bytes=0,
    )
    assert gate.started.wait(10)
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering"):
        tier.shutdown()  # returns although the scan is stuck
    assert any("start-up scan" in r.getMessage() for r in caplog.records)
    open_fds = descriptors_of(tier.rank_dir)
    assert open_fds, "the stuck scan's directory is still open"
    gate.release.set()
    for thread in threads_named("vllm_fs_tier_fs_scan"):
        thread.join(10)
        assert not thread.is_alive()
    assert tier.get_stats().used_bytes == 0, "a stopped scan evicts and indexes nothing more"
    for fd in open_fds:
        os.close(fd)


def test_primary_rows_are_released_at_shutdown(make_tier: TierFactory) -> None:
    p = Primary(num_rows=2)
    tier = make_tier(view=p.view, spec=make_spec(num_rows=2))
    assert store(tier, p, [key_of(1)], [0])
    tier.shutdown()
    p.close()  # would raise BufferError if the tier still exported the mapping


def test_per_group_rows_ignore_and_refuse_blocks_written_with_shared_rows(
    make_tier: TierFactory, primary: Primary
) -> None:
    # Two KV-cache groups of a block's bytes: shared rows (bytes not known per group) hold
    # both, per-group rows the larger; page rounding makes both rows ROW_BYTES, so only the
    # identity's ``row_layout`` tells the layouts apart. An old file read into a per-group row
    # would put bytes at offsets the new layout gives another tensor.
    kv_bytes = ROW_BYTES - 100
    hybrid: dict[str, Any] = dict(
        gpu_block_sizes=(16, 16), sliding_windows=(None, 32), gpu_kv_bytes_per_block=kv_bytes
    )
    old = make_spec(**hybrid)
    new = make_spec(group_kv_bytes_per_block=(kv_bytes - 50, 50), **hybrid)
    assert old.row_layout is RowLayout.SHARED and new.row_layout is RowLayout.PER_GROUP
    assert old.row_bytes == new.row_bytes == ROW_BYTES
    old_tier = make_tier(spec=old)
    keys = [key_of(1, group=0), key_of(2, group=1)]
    assert store(old_tier, primary, keys, [0, 1])
    old_files = [Path(block_file(old_tier, key)) for key in keys]
    old_tier.shutdown()

    new_tier = make_tier(spec=new)
    assert new_tier.rank_dir != old_tier.rank_dir  # another run directory: not found
    assert resolve_lookups(new_tier, keys) == [False, False]
    # Even copied to where the new run keeps them, the old files are refused by the run digest
    # of their headers: the load fails (so its rows are never published) and the files go.
    targets = [Path(block_file(new_tier, key)) for key in keys]
    for path, target in zip(old_files, targets, strict=True):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    assert not load(new_tier, primary, keys, [2, 3])
    assert not any(t.exists() for t in targets)
    assert all(p.exists() for p in old_files)  # the old run's own files are left alone
