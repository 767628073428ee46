# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the system-call layer: symlink refusal, atomic publication, temporary file names."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE, BlockFileCorrupt
from vllm.v1.kv_offload.tiering.fs import block_io
from vllm.v1.kv_offload.tiering.fs.block_io import (
    HOST_TAG,
    FileModes,
    HeaderBuffers,
    is_stale_tmp,
    is_stale_tmp_file,
    open_dir,
    probe_o_direct,
    read_block_file,
    register_writer,
    tmp_name,
    unlink_block,
    unregister_writer,
    write_block_file,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath

DIGEST = hashlib.sha256(b"run").digest()
KEY = hashlib.sha256(b"k").digest() + bytes(4)
PATH = BlockPath("abc", "de_g0", "abcdef.bin")
ROW = 64 * 1024
PRIVATE = FileModes.of("private")  # 0700 / 0600 under the umask


@pytest.fixture
def dir_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.fixture
def row() -> Iterator[memoryview]:
    mm = mmap.mmap(-1, ROW)
    view = memoryview(mm)
    view[:] = hashlib.shake_128(b"row").digest(ROW)
    yield view
    view.release()
    mm.close()


def _write(dir_fd: int, row: memoryview, *, o_direct: bool = False) -> None:
    write_block_file(
        dir_fd,
        PATH,
        tmp_name(PATH.stem, "0badc0de"),
        HeaderBuffers().header,
        row,
        key=KEY,
        run_digest=DIGEST,
        o_direct=o_direct,
        modes=PRIVATE,
    )


def test_open_dir_refuses_symlinks(tmp_path: Path, dir_fd: int) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.close(open_dir("real", dir_fd))
    with pytest.raises(OSError) as info:
        open_dir("link", dir_fd, create=PRIVATE)
    assert info.value.errno in (errno.ELOOP, errno.ENOTDIR)
    with pytest.raises(FileNotFoundError):
        open_dir("absent", dir_fd)
    os.close(open_dir("created", dir_fd, create=PRIVATE))
    assert (tmp_path / "created").is_dir()


def test_publication_is_atomic(
    tmp_path: Path, dir_fd: int, row: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(dir_fd, row)
    final = tmp_path / PATH.name
    before = final.read_bytes()
    assert len(before) == HEADER_SIZE + ROW and before[HEADER_SIZE:] == bytes(row)

    def fail_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "fsync failed")

    monkeypatch.setattr(block_io.os, "fsync", fail_fsync)
    row[0] ^= 0xFF
    with pytest.raises(OSError, match="fsync failed"):
        _write(dir_fd, row)
    monkeypatch.undo()
    assert final.read_bytes() == before  # the old file is untouched...
    assert [p.name for p in tmp_path.iterdir()] == [PATH.name]  # ...and no tmp file is left


def test_verified_read(tmp_path: Path, dir_fd: int, row: memoryview) -> None:
    _write(dir_fd, row)
    out_mm = mmap.mmap(-1, ROW)
    out = memoryview(out_mm)
    header = HeaderBuffers().header
    try:
        read_block_file(dir_fd, PATH.name, header, out, key=KEY, run_digest=DIGEST, o_direct=False)
        assert out == row
        os.truncate(tmp_path / PATH.name, HEADER_SIZE + ROW - 1)
        with pytest.raises(BlockFileCorrupt, match="file size") as info:
            read_block_file(
                dir_fd, PATH.name, header, out, key=KEY, run_digest=DIGEST, o_direct=False
            )
        st = os.stat(tmp_path / PATH.name)
        assert info.value.file_id == (st.st_dev, st.st_ino)
        (tmp_path / "dir.bin").mkdir()
        with pytest.raises(OSError, match="not a regular file"):
            read_block_file(
                dir_fd, "dir.bin", header, out, key=KEY, run_digest=DIGEST, o_direct=False
            )
    finally:
        out.release()
        out_mm.close()


def test_unlink_block_spares_a_replaced_file(tmp_path: Path, dir_fd: int) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    st = os.stat(path)
    old_id = (st.st_dev, st.st_ino)
    replacement = tmp_path / "new"
    replacement.write_bytes(b"new")
    os.replace(replacement, path)  # another writer published a fresh file
    assert unlink_block(dir_fd, "f.bin", old_id) is None
    assert path.read_bytes() == b"new"
    st = os.stat(path)
    removed = unlink_block(dir_fd, "f.bin", (st.st_dev, st.st_ino))
    assert removed is not None and removed.st_ino == st.st_ino
    assert not path.exists()
    assert unlink_block(dir_fd, "f.bin", None) is None


def test_temporary_file_names_and_staleness() -> None:
    writer = register_writer()
    try:
        name = tmp_name("abcdef", writer)
        assert name.startswith(".abcdef.") and name.endswith(".tmp")
        # Each call names a new file, even for one stem and writer.
        assert len({tmp_name("abcdef", writer) for _ in range(1000)} | {name}) == 1001
        assert not is_stale_tmp(name, 0.0, 600)  # a live writer of this process
        assert is_stale_tmp(name, 601.0, 600)  # ...unless too old
    finally:
        unregister_writer(writer)
    assert is_stale_tmp(name, 0.0, 600)  # its tier is gone
    other_host = f".abcdef.{'0' * 8 if HOST_TAG != '0' * 8 else '1' * 8}.1.0badc0de.01234567.tmp"
    assert not is_stale_tmp(other_host, 10.0, 600)
    assert is_stale_tmp(other_host, 600.0, 600)
    assert not is_stale_tmp("random.tmp", 10**9, 600)  # not ours: never
    assert not is_stale_tmp(f".x.{HOST_TAG}.0.0badc0de.01234567.tmp", 10**9, 600)  # pid 0


def test_stale_tmp_file_must_be_a_regular_file_old_enough(tmp_path: Path, dir_fd: int) -> None:
    other_host = f".abcdef.{'0' * 8 if HOST_TAG != '0' * 8 else '1' * 8}.1.0badc0de.01234567.tmp"
    assert not is_stale_tmp_file(dir_fd, other_host, 0.0)  # gone
    (tmp_path / "dir").mkdir()
    os.symlink("dir", tmp_path / other_host)
    assert not is_stale_tmp_file(dir_fd, other_host, 0.0)  # a link: not followed
    os.unlink(tmp_path / other_host)
    (tmp_path / other_host).write_bytes(b"x")
    assert is_stale_tmp_file(dir_fd, other_host, 0.0)
    assert not is_stale_tmp_file(dir_fd, other_host, 600.0)  # just written
    os.utime(tmp_path / other_host, (0, 0))
    assert is_stale_tmp_file(dir_fd, other_host, 600.0)  # mtime is the age


def test_o_direct_probe_leaves_nothing_behind(tmp_path: Path, dir_fd: int) -> None:
    assert isinstance(probe_o_direct(dir_fd, "0badc0de", PRIVATE), bool)
    assert list(tmp_path.iterdir()) == []
