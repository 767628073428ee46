"""Tests of the shared host region: layout, the create/join protocol, failures and teardown."""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm.v1.kv_offload.cpu import shared_offload_region as sor
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

PAGE = mmap.PAGESIZE


def _region(tmp_path: Path, **kwargs: Any) -> SharedOffloadRegion:
    args: dict[str, Any] = dict(
        instance_id="inst", num_blocks=4, worker_page_bytes=1000, num_workers=3, directory=tmp_path
    )
    args.update(kwargs)
    return SharedOffloadRegion(**args)


def _files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.fixture
def poll_started(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """An event set once a joiner starts polling (its first sleep between fstat calls)."""
    event = threading.Event()
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        event.set()
        real_sleep(seconds)

    monkeypatch.setattr(sor.time, "sleep", sleep)
    yield event


# ---------------------------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------------------------


def test_geometry_and_padding(tmp_path: Path) -> None:
    with _region(tmp_path) as region:
        assert SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT == PAGE
        assert region.row_bytes == -(-3000 // PAGE) * PAGE
        assert region.row_bytes % PAGE == 0
        assert region.total_bytes == 4 * region.row_bytes
        assert os.path.getsize(region.path) == region.total_bytes
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
        status, is_creator, seen = queue.get(timeout=120)
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


def _join_while_creator_holds_stub(
    tmp_path: Path, poll_started: threading.Event
) -> tuple[str, int, Callable[[], SharedOffloadRegion]]:
    """A creator's stub file, created but not sized yet, and a joiner polling it from a thread.

    Returns once the joiner polls: the stub's path, the creator's fd of it, and ``joined()``,
    which waits for the joiner and returns the region it got.
    """
    path = SharedOffloadRegion.region_path("inst", tmp_path)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    result: dict[str, Any] = {}

    def join() -> None:
        try:
            result["region"] = _region(tmp_path, join_timeout_s=60.0)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=join)
    thread.start()
    assert poll_started.wait(timeout=60)

    def joined() -> SharedOffloadRegion:
        thread.join(timeout=60)
        assert "error" not in result, result
        region: SharedOffloadRegion = result["region"]
        return region

    return path, fd, joined


def test_joiner_waits_for_creator_to_size_file(
    tmp_path: Path, poll_started: threading.Event
) -> None:
    path, fd, joined = _join_while_creator_holds_stub(tmp_path, poll_started)
    os.ftruncate(fd, 4 * -(-3000 // PAGE) * PAGE)
    region = joined()
    assert not region.is_creator
    region.cleanup()
    # A joiner never removes the file.
    assert os.path.exists(path)
    os.close(fd)


def test_joiner_recreates_after_creator_gave_up(
    tmp_path: Path, poll_started: threading.Event
) -> None:
    path, fd, joined = _join_while_creator_holds_stub(tmp_path, poll_started)
    # The creator failed: it unlinks its stub. The waiting process must not hang on it.
    os.unlink(path)
    os.close(fd)
    region = joined()
    assert region.is_creator
    assert os.path.getsize(path) == region.total_bytes
    region.cleanup()
    assert _files(tmp_path) == []


def test_joiner_times_out_when_file_never_sized(tmp_path: Path) -> None:
    path = SharedOffloadRegion.region_path("inst", tmp_path)
    Path(path).touch()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 0.05 s .*its size is 0"):
        _region(tmp_path, join_timeout_s=0.05)
    assert time.monotonic() - start < 10
    # The joiner leaves the (not its own) file alone.
    assert os.path.exists(path)


def test_foreign_file_of_wrong_size_refused(tmp_path: Path) -> None:
    path = SharedOffloadRegion.region_path("inst", tmp_path)
    with open(path, "wb") as f:
        f.write(b"\x01" * (4 * PAGE + 1))
    with pytest.raises(
        ValueError, match=rf"has {4 * PAGE + 1} bytes but this geometry needs {4 * PAGE}"
    ):
        _region(tmp_path, worker_page_bytes=PAGE, num_workers=1)
    with open(path, "rb") as f:
        assert f.read() == b"\x01" * (4 * PAGE + 1)


# ---------------------------------------------------------------------------------------------
# Failed starts leave nothing behind
# ---------------------------------------------------------------------------------------------


def test_insufficient_space_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sor.os, "statvfs", lambda _path: SimpleNamespace(f_bavail=3, f_frsize=PAGE))
    with pytest.raises(OSError) as info:
        _region(tmp_path)
    assert info.value.errno == errno.ENOSPC
    message = str(info.value)
    assert str(tmp_path) in message
    assert f"needed {4 * PAGE} bytes" in message
    assert f"available {3 * PAGE} bytes" in message
    assert _files(tmp_path) == []


def test_ftruncate_failure_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_ftruncate(fd: int, length: int) -> None:
        raise OSError(errno.EFBIG, "simulated ftruncate failure")

    monkeypatch.setattr(sor.os, "ftruncate", failing_ftruncate)
    with pytest.raises(OSError, match="simulated ftruncate failure"):
        _region(tmp_path)
    assert _files(tmp_path) == []


def test_prefault_failure_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_prefault(self: SharedOffloadRegion) -> None:
        raise OSError(errno.EFAULT, "simulated pre-fault failure")

    monkeypatch.setattr(SharedOffloadRegion, "_prefault", failing_prefault)
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
    with _region(tmp_path, num_blocks=5, prefault=False) as owner:
        rows = np.asarray(owner.create_kv_memoryview())
        rng = np.random.default_rng(0)
        rows[:] = rng.integers(0, 256, size=rows.shape, dtype=np.uint8)
        expected = rows.copy()
        if madvise == "unsupported":
            # An advice value the kernel rejects with EINVAL: the fallback must take over.
            monkeypatch.setattr(sor, "_MADV_POPULATE_WRITE", 0x7FFF)
        elif madvise == "absent":
            monkeypatch.setattr(sor, "_MADV_POPULATE_WRITE", None)
        with _region(tmp_path, num_blocks=5, rank=rank, prefault=True) as peer:
            assert not peer.is_creator
        assert np.array_equal(rows, expected)
        del rows


class _MadviseFails:
    """Stands in for the mmap object: madvise fails as when the tmpfs cannot back the pages."""

    def madvise(self, option: int, start: int, length: int) -> None:
        raise OSError(errno.EFAULT, "Bad address")


def test_prefault_other_madvise_errors_raise(tmp_path: Path) -> None:
    with _region(tmp_path, prefault=False) as region:
        real = region._mm
        region._mm = _MadviseFails()  # type: ignore[assignment]
        try:
            with pytest.raises(OSError, match=r"could not pre-fault shared region .*full\?"):
                region._madvise_populate(0, region.row_bytes)
        finally:
            region._mm = real


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
        assert os.path.getsize(region.path) == 2 * PAGE
    assert not os.path.exists(region.path)
