# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the shared host region: layout, the create/join protocol, failures and teardown."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import gc
import logging
import mmap
import multiprocessing as mp
import os
import subprocess
import threading
import time
from pathlib import Path
from queue import Empty
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.cpu.shared_region import (
    ProcessIdentity,
    SharedOffloadRegion,
    SharedRegionError,
    process_identity,
)
from vllm.v1.kv_offload.cpu.shared_region import prefault as region_prefault
from vllm.v1.kv_offload.cpu.shared_region import publish as region_publish
from vllm.v1.kv_offload.cpu.shared_region import region as sor
from vllm.v1.kv_offload.cpu.shared_region import sweep as region_sweep
from vllm.v1.kv_offload.cpu.shared_region import trailer as region_trailer

PAGE = mmap.PAGESIZE


def _region(tmp_path: Path, **kwargs: Any) -> SharedOffloadRegion:
    args: dict[str, Any] = dict(
        instance_id="inst", num_blocks=4, worker_page_bytes=1000, num_workers=3, directory=tmp_path
    )
    args.update(kwargs)
    return SharedOffloadRegion(**args)


def _files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def test_geometry_and_padding(tmp_path: Path) -> None:
    with _region(tmp_path) as region:
        assert SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT == PAGE
        assert region.row_bytes == -(-3000 // PAGE) * PAGE
        assert region.row_bytes % PAGE == 0
        assert region.total_bytes == 4 * region.row_bytes
        # One page of metadata (join marks, trailer) after the rows.
        assert region.file_bytes == region.total_bytes + PAGE
        assert os.path.getsize(region.path) == region.file_bytes
        assert region.path == str(tmp_path / "vllm_offload_inst.mmap")
        assert (region.num_blocks, region.worker_page_bytes, region.num_workers) == (4, 1000, 3)
        assert region.rank is None and region.is_creator
        assert region.base_ptr != 0
        assert oct(os.stat(region.path).st_mode & 0o777) == oct(0o600)


def test_exact_multiple_of_page_has_no_padding(tmp_path: Path) -> None:
    with _region(tmp_path, worker_page_bytes=PAGE, num_workers=2) as region:
        assert region.row_bytes == 2 * PAGE


def test_worker_views_strides_offsets_and_bytes(tmp_path: Path) -> None:
    with (
        _region(tmp_path) as scheduler,
        _region(tmp_path, rank=1) as worker,
    ):
        assert not worker.is_creator
        k = worker.create_next_worker_view(300)
        v = worker.create_next_worker_view(700)
        for view, size, offset in ((k, 300, 1000), (v, 700, 1300)):
            assert view.dtype == torch.int8
            assert view.shape == (4, size)
            assert view.stride() == (worker.row_bytes, 1)
            assert view.storage_offset() == offset
            assert view.data_ptr() == worker.base_ptr + offset
        # The slot is now full: any further byte overruns it.
        with pytest.raises(ValueError, match=r"overruns worker 1's slot of 1000 bytes"):
            worker.create_next_worker_view(1)

        k[2].fill_(7)
        v[3, -1] = -1
        rows = np.asarray(scheduler.create_kv_memoryview())
        assert rows.shape == (4, scheduler.row_bytes)
        assert (rows[2, 1000:1300] == 7).all()
        assert rows[3, 1999] == 0xFF
        # Nothing outside those bytes was written (other slots, other rows, padding).
        rows_copy = rows.copy()
        rows_copy[2, 1000:1300] = 0
        rows_copy[3, 1999] = 0
        assert not rows_copy.any()
        del rows


def test_slot_overflow_on_first_view(tmp_path: Path) -> None:
    with _region(tmp_path, rank=2) as worker:
        with pytest.raises(ValueError, match=r"tensor_page_bytes=1001 at offset 0 overruns"):
            worker.create_next_worker_view(1001)
        # A failed call does not advance the running offset.
        assert worker.create_next_worker_view(1000).storage_offset() == 2000
        with pytest.raises(ValueError, match=r"tensor_page_bytes must be an integer > 0"):
            worker.create_next_worker_view(0)


def test_worker_views_at_an_offset_alias_one_row_offset(tmp_path: Path) -> None:
    # Per-group rows: each group's views start at offset 0 of the worker's slot.
    with _region(tmp_path, rank=1) as worker:
        group0 = worker.create_worker_view(0, 600)
        group1 = [worker.create_worker_view(0, 300), worker.create_worker_view(300, 700)]
        assert group0.storage_offset() == group1[0].storage_offset() == 1000
        assert group1[1].storage_offset() == 1300
        assert all(v.stride() == (worker.row_bytes, 1) for v in (group0, *group1))
        group1[0][2].fill_(5)
        assert (group0[2, :300] == 5).all() and not group0[[0, 1, 3]].any()
        # The cursor of create_next_worker_view is not moved by them.
        assert worker.create_next_worker_view(1000).storage_offset() == 1000
        with pytest.raises(ValueError, match=r"at offset 301 overruns worker 1's slot"):
            worker.create_worker_view(301, 700)
        with pytest.raises(ValueError, match="slot_offset must be an integer >= 0"):
            worker.create_worker_view(-1, 8)
    with _region(tmp_path) as scheduler, pytest.raises(RuntimeError, match="rank is None"):
        scheduler.create_worker_view(0, 8)


def test_scheduler_has_no_worker_views(tmp_path: Path) -> None:
    with (
        _region(tmp_path) as scheduler,
        pytest.raises(RuntimeError, match="rank is None"),
    ):
        scheduler.create_next_worker_view(8)


def test_memoryview_shape_and_zero_copy(tmp_path: Path) -> None:
    with _region(tmp_path) as scheduler, _region(tmp_path, rank=0) as worker:
        view = scheduler.create_kv_memoryview()
        assert view.format == "B"
        assert view.shape == (4, scheduler.row_bytes)
        assert view.strides == (scheduler.row_bytes, 1)
        assert view.nbytes == scheduler.total_bytes
        assert not view.readonly
        # Writes through the memoryview are seen by another mapping of the file, and back.
        arr = np.asarray(view)
        arr[1, :5] = [1, 2, 3, 4, 5]
        page = worker.create_next_worker_view(5)
        assert page[1].tolist() == [1, 2, 3, 4, 5]
        page[0].fill_(9)
        assert arr[0, :5].tolist() == [9] * 5
        del arr


# ---------------------------------------------------------------------------------------------
# Create / join across processes
# ---------------------------------------------------------------------------------------------

_GEOMETRY: dict[str, Any] = dict(
    instance_id="xproc", num_blocks=8, worker_page_bytes=3000, num_workers=2
)


def _joiner_main(directory: str, queue: Any) -> None:
    """Child process: join as worker 1, check worker 0's bytes, write our own slot."""
    try:
        region = SharedOffloadRegion(**_GEOMETRY, rank=1, directory=directory)
        with region:
            rows = np.asarray(region.create_kv_memoryview())
            seen = rows[:, :3000].copy()
            del rows
            slot = region.create_next_worker_view(3000)
            for b in range(region.num_blocks):
                slot[b].fill_(b + 100)
            queue.put(("ok", region.is_creator, seen.tolist()))
    except BaseException as e:
        queue.put(("error", repr(e), None))


def _child_result(child: Any, queue: Any, limit_s: float = 600.0) -> Any:
    """The child's one message: waits as long as the child lives (a spawned interpreter that
    imports torch can take minutes on a loaded 2-core machine), fails at once if it died."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except Empty:
            if not child.is_alive():
                try:  # it may have exited right after sending
                    return queue.get(timeout=5.0)
                except Empty:
                    raise AssertionError(
                        f"joiner exited ({child.exitcode}) without a result"
                    ) from None
    raise AssertionError(f"no result from the joiner in {limit_s:.0f} s")


def test_create_and_join_across_processes(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    creator = SharedOffloadRegion(**_GEOMETRY, rank=0, directory=tmp_path)
    try:
        assert creator.is_creator
        slot0 = creator.create_next_worker_view(3000)
        for b in range(creator.num_blocks):
            slot0[b].fill_(b + 1)

        queue = ctx.Queue()
        child = ctx.Process(target=_joiner_main, args=(str(tmp_path), queue))
        child.start()
        status, is_creator, seen = _child_result(child, queue)
        child.join(timeout=60)
        assert status == "ok", is_creator
        assert child.exitcode == 0
        # The child joined (did not create) and saw every byte worker 0 wrote.
        assert is_creator is False
        assert seen == [[b + 1] * 3000 for b in range(creator.num_blocks)]

        rows = np.asarray(creator.create_kv_memoryview())
        for b in range(creator.num_blocks):
            assert (rows[b, :3000] == b + 1).all()
            assert (rows[b, 3000:6000] == b + 100).all()
            assert not rows[b, 6000:].any()  # padding untouched
        del rows
        # The joiner's cleanup did not remove the file; the creator's does.
        assert os.path.exists(creator.path)
    finally:
        creator.cleanup()
    assert _files(tmp_path) == []


def test_creator_publishes_only_a_complete_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region's name appears only once the file is sized and carries its trailer."""
    seen: list[tuple[bool, int, bytes]] = []
    real_link = os.link

    def link(src: str, dst: str) -> None:
        with open(src, "rb") as f:
            data = f.read()
        seen.append((os.path.exists(dst), len(data), data[-region_trailer.TRAILER.size :][:8]))
        real_link(src, dst)

    monkeypatch.setattr(region_publish.os, "link", link)
    with _region(tmp_path) as region:
        assert region.is_creator
        assert seen == [(False, region.file_bytes, region_trailer.MAGIC)]
        # The temporary name is gone; only the region's name is left.
        assert _files(tmp_path) == ["vllm_offload_inst.mmap"]


def test_joiner_recreates_after_creator_gave_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A joiner that opened the name just before the creator removed it starts over."""
    creator = _region(tmp_path)
    joiner_locking = threading.Event()
    real_flock = region_publish.fcntl.flock

    def flock(fd: int, operation: int) -> None:
        if threading.current_thread().name == "joiner" and operation == fcntl.LOCK_EX:
            joiner_locking.set()
        real_flock(fd, operation)

    monkeypatch.setattr(region_publish.fcntl, "flock", flock)
    # Hold the file's lock as a creator does while it removes the name in cleanup().
    fd = os.open(creator.path, os.O_RDONLY)
    real_flock(fd, fcntl.LOCK_EX)
    result: dict[str, Any] = {}

    def join() -> None:
        try:
            result["region"] = _region(tmp_path, rank=0, join_timeout_s=60.0)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=join, name="joiner")
    thread.start()
    assert joiner_locking.wait(timeout=60)
    # The creator gives up: it removes the name under the lock (as cleanup() does).
    os.unlink(creator.path)
    os.close(fd)  # releases the lock: the joiner finds the name gone
    thread.join(timeout=60)
    assert "error" not in result, result
    region = result["region"]
    assert region.is_creator, "it started over and created a fresh region"
    assert os.path.getsize(region.path) == region.file_bytes
    # The first creator's cleanup leaves its successor's file alone.
    creator.cleanup()
    assert _files(tmp_path) == ["vllm_offload_inst.mmap"]
    region.cleanup()
    assert _files(tmp_path) == []


def test_file_without_trailer_refused_and_left_alone(tmp_path: Path) -> None:
    path = SharedOffloadRegion.region_path("inst", tmp_path)
    Path(path).touch()
    with pytest.raises(SharedRegionError, match=r"is not a shared region of this version"):
        _region(tmp_path)
    # Not ours to judge: neither the joiner nor the sweep removes it.
    assert os.path.exists(path)


def test_region_of_another_geometry_refused(tmp_path: Path) -> None:
    with _region(tmp_path, worker_page_bytes=PAGE, num_workers=1, rank=0) as first:
        with open(first.path, "rb") as f:
            before = f.read()
        with pytest.raises(
            SharedRegionError,
            match=r"made for num_blocks=4, row_bytes=4096, worker_page_bytes=4096, num_workers=1 "
            r".* needs num_blocks=4, row_bytes=8192",
        ):
            _region(tmp_path, worker_page_bytes=2 * PAGE, num_workers=1, rank=0)
        with open(first.path, "rb") as f:
            assert f.read() == before


# ---------------------------------------------------------------------------------------------
# Lifetime: nothing of a dead process survives
# ---------------------------------------------------------------------------------------------


def test_name_removed_once_every_participant_joined(tmp_path: Path) -> None:
    scheduler = _region(tmp_path)
    workers = []
    for rank in range(3):
        assert _files(tmp_path) == ["vllm_offload_inst.mmap"], f"before rank {rank} joined"
        workers.append(_region(tmp_path, rank=rank))
    # Every participant holds the file open and mapped: the name is no longer needed.
    assert _files(tmp_path) == []
    page = workers[2].create_next_worker_view(8)
    page[3].fill_(9)
    rows = np.asarray(scheduler.create_kv_memoryview())
    assert (rows[3, 2000:2008] == 9).all(), "still one shared file"
    del rows, page
    for region in (*workers, scheduler):
        region.cleanup()
    assert _files(tmp_path) == []


def test_workers_only_region(tmp_path: Path) -> None:
    with _region(tmp_path, num_workers=2, rank=1, expect_scheduler=False) as first:
        assert first.is_creator and not first.expect_scheduler
        assert _files(tmp_path) == ["vllm_offload_inst.mmap"]
        with _region(tmp_path, num_workers=2, rank=0, expect_scheduler=False):
            assert _files(tmp_path) == []
    # A single worker is every participant at once: the name never outlives the creation.
    with _region(tmp_path, num_workers=1, rank=0, expect_scheduler=False):
        assert _files(tmp_path) == []
    with pytest.raises(ValueError, match=r"rank=None\) needs expect_scheduler=True"):
        _region(tmp_path, expect_scheduler=False)


def test_participants_must_agree_on_the_scheduler(tmp_path: Path) -> None:
    with (
        _region(tmp_path, rank=0, expect_scheduler=False),
        pytest.raises(SharedRegionError, match="expect_scheduler=False, this process"),
    ):
        _region(tmp_path, rank=1)


@pytest.mark.parametrize("rank", [None, 1])
def test_a_participant_joins_only_once(tmp_path: Path, rank: int | None) -> None:
    with _region(tmp_path, rank=2 if rank is None else None), _region(tmp_path, rank=rank):
        who = "the scheduler side" if rank is None else "worker rank 1"
        with pytest.raises(SharedRegionError, match=f"{who} already joined shared region"):
            _region(tmp_path, rank=rank)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # exited and reaped: nothing runs under this pid (until it is reused)
    return proc.pid


def _identity(kind: str) -> ProcessIdentity:
    """A creator identity: alive (this process), or dead in one of the ways a creator can be."""
    me = process_identity.current_identity()
    if kind == "alive":
        return me
    if kind == "dead pid":
        return dataclasses.replace(me, pid=_dead_pid())
    if kind == "pid reused":  # our pid, but the process that had it started at another time
        return dataclasses.replace(me, start_ticks=me.start_ticks + 1)
    if kind == "earlier boot":
        return dataclasses.replace(me, boot_id=bytes(15) + b"\x01")
    if kind == "other pid namespace":  # cannot be judged from here
        return dataclasses.replace(me, pid=_dead_pid(), pidns=me.pidns + 1)
    raise AssertionError(kind)


def _plant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, creator: ProcessIdentity, **kwargs: Any
) -> str:
    """Leave a region behind as its creator would if killed before every participant joined."""
    with monkeypatch.context() as m:
        m.setattr(region_publish, "current_identity", lambda: creator)
        region = _region(tmp_path, **kwargs)
    assert region.is_creator
    # As if SIGKILLed, the mapping goes and the file stays: only the creating process unlinks
    # at cleanup, and this cleanup runs as another process would (a forked child).
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: -1)
        region.cleanup()
    assert os.path.exists(region.path)
    return region.path


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
@pytest.mark.parametrize("kind", ["dead pid", "pid reused", "earlier boot"])
def test_region_of_a_dead_creator_is_swept_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    path = _plant(tmp_path, monkeypatch, _identity(kind), instance_id="crashed")
    with caplog.at_level(logging.WARNING, logger=region_sweep.__name__), _region(tmp_path):
        assert not os.path.exists(path)
        assert _files(tmp_path) == ["vllm_offload_inst.mmap"]
    assert "removed 1 shared region file(s) of dead processes" in caplog.text
    assert "vllm_offload_crashed.mmap" in caplog.text


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_new_process_with_a_dead_creators_pid_does_not_join_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An earlier process with our pid created the region of instance "inst" and died.
    stale = _plant(tmp_path, monkeypatch, _identity("pid reused"), rank=None)
    with open(stale, "rb") as f:
        stale_bytes = f.read()
    with _region(tmp_path) as region:
        assert region.is_creator, "a fresh region, not the stale one"
        with open(region.path, "rb") as f:
            assert f.read() != stale_bytes


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_joiner_of_a_stale_region_gets_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    creator = _identity("dead pid")
    path = _plant(tmp_path, monkeypatch, creator, rank=None)
    # The creator died after this joiner's sweep: the joiner finds the stale region itself.
    monkeypatch.setattr(region_publish, "sweep_stale_regions", lambda directory: [])
    with pytest.raises(
        SharedRegionError,
        match=rf"{path!r} is stale: its creator \(pid {creator.pid}, started at tick "
        rf"{creator.start_ticks}\) is gone.* the file was removed",
    ):
        _region(tmp_path, rank=0)
    assert _files(tmp_path) == []


def test_sweep_leaves_what_it_cannot_judge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    foreign = _plant(tmp_path, monkeypatch, _identity("other pid namespace"), instance_id="ns")
    locked = _plant(tmp_path, monkeypatch, _identity("dead pid"), instance_id="busy")
    (tmp_path / "vllm_offload_legacy.mmap").write_bytes(bytes(PAGE))  # no trailer
    (tmp_path / "unrelated.mmap").write_bytes(b"x")
    # A live process holds the lock of the dead creator's file (it is joining it right now).
    fd = os.open(locked, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with _region(tmp_path, instance_id="live", rank=0):  # sweeps, finds nothing to remove
            assert sorted(_files(tmp_path)) == sorted(
                [
                    os.path.basename(foreign),
                    os.path.basename(locked),
                    "vllm_offload_legacy.mmap",
                    "unrelated.mmap",
                    "vllm_offload_live.mmap",
                ]
            )
    finally:
        os.close(fd)
    # Unlocked, the dead creator's file goes; the rest stays.
    assert region_sweep.sweep_stale_regions(tmp_path) == [locked]
    assert sorted(_files(tmp_path)) == sorted(
        [os.path.basename(foreign), "vllm_offload_legacy.mmap", "unrelated.mmap"]
    )


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_sweep_removes_unpublished_files_of_dead_creators(tmp_path: Path) -> None:
    me = process_identity.current_identity()
    dead = tmp_path / f"vllm_offload_creating-{_dead_pid()}-1-0a1b.tmp"
    reused = tmp_path / f"vllm_offload_creating-{me.pid}-{me.start_ticks + 1}-0a1b.tmp"
    ours = tmp_path / f"vllm_offload_creating-{me.pid}-{me.start_ticks}-0a1b.tmp"
    for path in (dead, reused, ours):
        path.write_bytes(b"")
    assert sorted(region_sweep.sweep_stale_regions(tmp_path)) == sorted([str(dead), str(reused)])
    assert _files(tmp_path) == [ours.name]


def test_process_identity_of_this_process() -> None:
    me = process_identity.current_identity()
    assert me.pid == os.getpid()
    assert process_identity.process_is_alive(me) is True
    if os.path.isdir("/proc/self"):
        assert me.start_ticks > 0 and me.pidns > 0
        assert process_identity.process_is_alive(_identity("pid reused")) is False
        assert process_identity.process_is_alive(_identity("dead pid")) is False
        assert process_identity.process_is_alive(_identity("other pid namespace")) is None


# ---------------------------------------------------------------------------------------------
# Failed starts leave nothing behind
# ---------------------------------------------------------------------------------------------


def test_insufficient_space_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def statvfs(_path: str) -> SimpleNamespace:
        return SimpleNamespace(f_bavail=3, f_frsize=PAGE)

    monkeypatch.setattr(region_publish.os, "statvfs", statvfs)
    with pytest.raises(OSError) as info:
        _region(tmp_path)
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert str(tmp_path) in message
    assert f"needed {5 * PAGE} bytes" in message
    assert f"available {3 * PAGE} bytes" in message
    assert _files(tmp_path) == []


def test_ftruncate_failure_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_ftruncate(fd: int, length: int) -> None:
        raise OSError(errno.EFBIG, "simulated ftruncate failure")

    monkeypatch.setattr(region_publish.os, "ftruncate", failing_ftruncate)
    with pytest.raises(OSError, match="simulated ftruncate failure"):
        _region(tmp_path)
    assert _files(tmp_path) == []


def test_prefault_failure_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_prefault(*args: Any) -> None:
        raise OSError(errno.EFAULT, "simulated pre-fault failure")

    monkeypatch.setattr(region_prefault, "prefault", failing_prefault)
    with pytest.raises(OSError, match="simulated pre-fault failure"):
        _region(tmp_path)
    assert _files(tmp_path) == []


@pytest.mark.parametrize("instance_id", ["", "../escape", "a/b", "a b", "x\x00", "é", "a" * 238, 7])
def test_invalid_instance_id(tmp_path: Path, instance_id: Any) -> None:
    with pytest.raises(ValueError, match="instance_id="):
        _region(tmp_path, instance_id=instance_id)
    assert _files(tmp_path) == []


def test_longest_valid_instance_id(tmp_path: Path) -> None:
    with _region(tmp_path, instance_id="a" * 237) as region:
        assert os.path.basename(region.path) == f"vllm_offload_{'a' * 237}.mmap"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0}, "num_blocks must be an integer > 0"),
        ({"worker_page_bytes": True}, "worker_page_bytes must be an integer > 0"),
        ({"num_workers": 2.0}, "num_workers must be an integer > 0"),
        ({"rank": 3}, r"rank must be None or an integer in \[0, 3\)"),
        ({"rank": -1}, r"rank must be None or an integer in \[0, 3\)"),
        ({"join_timeout_s": 0}, "join_timeout_s must be > 0"),
    ],
)
def test_invalid_arguments(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _region(tmp_path, **kwargs)
    assert _files(tmp_path) == []


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _region(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# Pre-faulting
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("madvise", ["populate", "unsupported", "absent"])
@pytest.mark.parametrize("rank", [None, 0, 1, 2])
def test_prefault_preserves_peer_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, madvise: str, rank: int | None
) -> None:
    owner_rank = 0 if rank is None else None
    with _region(tmp_path, num_blocks=5, rank=owner_rank, prefault=False) as owner:
        rows = np.asarray(owner.create_kv_memoryview())
        rng = np.random.default_rng(0)
        rows[:] = rng.integers(0, 256, size=rows.shape, dtype=np.uint8)
        expected = rows.copy()
        if madvise == "unsupported":
            # An advice value the kernel rejects with EINVAL: the fallback must take over.
            monkeypatch.setattr(region_prefault, "MADV_POPULATE_WRITE", 0x7FFF)
        elif madvise == "absent":
            monkeypatch.setattr(region_prefault, "MADV_POPULATE_WRITE", None)
        with _region(tmp_path, num_blocks=5, rank=rank, prefault=True) as peer:
            assert not peer.is_creator
        assert np.array_equal(rows, expected)
        del rows


class _MadviseFails:
    """Stands in for the mmap object: madvise fails as when the tmpfs cannot back the pages."""

    def madvise(self, option: int, start: int, length: int) -> None:
        raise OSError(errno.EFAULT, "Bad address")


@pytest.mark.skipif(region_prefault.MADV_POPULATE_WRITE is None, reason="no MADV_POPULATE_WRITE")
@pytest.mark.parametrize("rank", [None, 1])
def test_prefault_other_madvise_errors_raise(tmp_path: Path, rank: int | None) -> None:
    geometry = region_trailer.RegionGeometry.compute(4, 1000, 3, True, PAGE)
    mm: Any = _MadviseFails()
    with pytest.raises(OSError, match=r"could not pre-fault shared region .*full\?"):
        region_prefault.prefault(mm, geometry, rank, PAGE, "region.mmap", str(tmp_path))


# ---------------------------------------------------------------------------------------------
# Teardown
# ---------------------------------------------------------------------------------------------


def test_cleanup_idempotent_and_creator_unlinks(tmp_path: Path) -> None:
    creator = _region(tmp_path)
    joiner = _region(tmp_path, rank=0)
    page = joiner.create_next_worker_view(16)
    page[1].fill_(5)
    del page
    joiner.cleanup()
    joiner.cleanup()
    assert joiner.closed
    assert os.path.exists(creator.path), "a joiner must not unlink the file"
    with pytest.raises(RuntimeError, match="is closed"):
        joiner.create_next_worker_view(16)
    with pytest.raises(RuntimeError, match="is closed"):
        _ = joiner.base_ptr

    view = creator.create_kv_memoryview()
    assert view[1:2].tobytes()[:16] == bytes([5] * 16)
    creator.cleanup()
    creator.cleanup()
    assert _files(tmp_path) == []
    with pytest.raises(ValueError):
        view.tobytes()  # released: no access to unmapped memory
    assert "closed=True" in repr(creator)


def test_joiner_mapping_survives_creator_cleanup(tmp_path: Path) -> None:
    creator = _region(tmp_path)
    joiner = _region(tmp_path, rank=1)
    page = joiner.create_next_worker_view(8)
    page.fill_(3)
    creator.cleanup()
    assert _files(tmp_path) == []
    # The file is gone from the directory, but the joiner's mapping stays valid.
    assert page.sum().item() == 3 * 8 * 4
    del page
    joiner.cleanup()


def test_tensor_outliving_cleanup_stays_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    region = _region(tmp_path, rank=0)
    page = region.create_next_worker_view(8)
    derived = page[1:3]
    del page
    with caplog.at_level(logging.WARNING, logger=sor.__name__):
        region.cleanup()
    assert "still alive after cleanup" in caplog.text
    assert _files(tmp_path) == []
    # The mapping was not unmapped under the tensor: writing and reading it is still safe.
    derived.fill_(4)
    assert derived.sum().item() == 4 * 16
    del derived
    gc.collect()


def test_del_without_cleanup_unlinks(tmp_path: Path) -> None:
    region = _region(tmp_path)
    assert _files(tmp_path) == ["vllm_offload_inst.mmap"]
    del region
    gc.collect()
    assert _files(tmp_path) == []


def test_default_directory_is_dev_shm() -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("/dev/shm is absent on this machine")
    instance_id = f"test_{os.getpid()}_{time.monotonic_ns()}"
    with SharedOffloadRegion(instance_id, num_blocks=2, worker_page_bytes=64) as region:
        assert region.path == f"/dev/shm/vllm_offload_{instance_id}.mmap"
        assert os.path.getsize(region.path) == 2 * PAGE + PAGE
    assert not os.path.exists(region.path)
