# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The fs tier's batched system calls (``vllm._kv_offload_fs_io``, ``native_io``): what they
report for each kind of entry, that a tier stores and loads the same bytes with them as without
them, and when the tier does without them."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.fs import native_io
from vllm.v1.kv_offload.tiering.fs.native_io import DISABLE_ENV, load_native_io

from .conftest import Primary, TierFactory, key_of, load, store
from .tier_state import block_file

try:
    import vllm._kv_offload_fs_io as fs_io
except ImportError:
    if os.environ.get("CI") == "true":
        raise  # CI builds it (.ci/run): a missing module there is a broken build
    pytest.skip(
        "vllm._kv_offload_fs_io is not built: `pip install -e .` builds it (needs a C compiler)",
        allow_module_level=True,
    )

ROW = 2 * mmap.PAGESIZE


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A rank directory and an fd of it."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def _file(path: Path, size: int, fill: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(fill * size)


def test_read_files_reads_whole_files_and_reports_every_other_entry(
    rank: tuple[Path, int],
) -> None:
    root, fd = rank
    size = HEADER_SIZE + ROW
    good = root / "abc" / "de_g0" / "good.bin"
    good.parent.mkdir(parents=True)
    good.write_bytes(b"H" * HEADER_SIZE + b"R" * ROW)
    _file(root / "abc" / "de_g0" / "short.bin", size - 1)
    _file(root / "abc" / "de_g0" / "long.bin", size + 1)
    os.mkfifo(root / "abc" / "de_g0" / "fifo.bin")
    (root / "abc" / "de_g0" / "link.bin").symlink_to(good)
    (root / "lnk").symlink_to(root / "abc")  # a symlinked directory on the way
    paths = [
        ("abc", "de_g0", "good.bin"),
        ("abc", "de_g0", "gone.bin"),
        ("abc", "zz_g0", "good.bin"),
        ("abc", "de_g0", "short.bin"),
        ("abc", "de_g0", "long.bin"),
        ("abc", "de_g0", "fifo.bin"),
        ("abc", "de_g0", "link.bin"),
        ("lnk", "de_g0", "good.bin"),
    ]
    headers = memoryview(mmap.mmap(-1, len(paths) * HEADER_SIZE))
    rows = [memoryview(bytearray(ROW)) for _ in paths]
    codes = fs_io.read_files(fd, paths, headers, rows, False)
    assert codes == [0, errno.ENOENT, errno.ENOENT, -2, -2, -1, errno.ELOOP, errno.ENOTDIR]
    assert bytes(headers[:HEADER_SIZE]) == b"H" * HEADER_SIZE and bytes(rows[0]) == b"R" * ROW
    assert not any(bytes(r).strip(b"\0") for r in rows[1:]), "nothing read for the others"


def test_read_files_reads_with_o_direct_into_aligned_buffers(rank: tuple[Path, int]) -> None:
    root, fd = rank
    path = root / "abc" / "de_g0" / "f.bin"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"h" * HEADER_SIZE + b"r" * ROW)
    region = mmap.mmap(-1, 2 * ROW)  # page-aligned, as the primary rows are
    headers = memoryview(mmap.mmap(-1, HEADER_SIZE))
    try:
        codes = fs_io.read_files(
            fd, [("abc", "de_g0", "f.bin")], headers, [memoryview(region)[ROW:]], True
        )
    except OSError:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    if codes == [errno.EINVAL]:
        pytest.skip("the filesystem of tmp_path refuses O_DIRECT")
    assert codes == [0] and region[ROW:] == b"r" * ROW and bytes(headers) == b"h" * HEADER_SIZE


def test_read_files_refuses_bad_arguments_before_any_system_call(rank: tuple[Path, int]) -> None:
    _, fd = rank
    headers = memoryview(mmap.mmap(-1, HEADER_SIZE))
    with pytest.raises(TypeError, match="same length"):
        fs_io.read_files(fd, [("a", "b", "c")], headers, [], False)
    with pytest.raises(TypeError, match=r"\(dir1, dir2, name\)"):
        fs_io.read_files(fd, [("a", "b")], headers, [memoryview(bytearray(1))], False)
    with pytest.raises(BufferError, match="not writable"):
        fs_io.read_files(fd, [("a", "b", "c")], headers, [memoryview(b"x")], False)
    with pytest.raises(ValueError, match="one equal slice per file"):
        fs_io.read_files(fd, [], headers, [], False)


def test_open_leaves_opens_what_exists_and_looks_for_the_name(rank: tuple[Path, int]) -> None:
    root, fd = rank
    _file(root / "abc" / "de_g0" / "there.bin", 3)
    (root / "abc" / "sl_g0").symlink_to(root / "abc" / "de_g0")
    found = fs_io.open_leaves(
        fd,
        [
            ("abc", "de_g0", "there.bin"),
            ("abc", "de_g0", "absent.bin"),
            ("abc", "zz_g0", "there.bin"),
            ("xyz", "de_g0", "there.bin"),
            ("abc", "sl_g0", "there.bin"),
        ],
        -1,
    )
    try:
        assert [exists for _, exists in found] == [1, 0, 0, 0, 0]
        assert [fd_ for fd_, _ in found[2:]] == [-errno.ENOENT, -errno.ENOENT, -errno.ENOTDIR]
        leaf = root / "abc" / "de_g0"
        assert os.path.samestat(os.fstat(found[0][0]), leaf.stat())
        assert os.path.samestat(os.fstat(found[1][0]), leaf.stat())
    finally:
        for leaf_fd, _ in found:
            if leaf_fd >= 0:
                os.close(leaf_fd)


def test_open_leaves_creates_the_missing_directories_when_asked(rank: tuple[Path, int]) -> None:
    root, fd = rank
    (root / "abc").mkdir()
    (root / "lnk").symlink_to(root / "abc")
    found = fs_io.open_leaves(
        fd, [("abc", "de_g0", "f.bin"), ("new", "de_g1", "f.bin"), ("lnk", "de_g0", "f.bin")], 0o700
    )
    try:
        assert [exists for _, exists in found] == [0, 0, 0]
        assert found[2][0] == -errno.ENOTDIR, "a symlink on the way is refused, not followed"
        for (leaf_fd, _), leaf in zip(found, ["abc/de_g0", "new/de_g1"], strict=False):
            assert os.path.samestat(os.fstat(leaf_fd), (root / leaf).stat())
            assert (root / leaf).stat().st_mode & 0o777 == 0o700 & ~_umask()
        assert not (root / "abc" / "de_g0" / "f.bin").exists()
    finally:
        for leaf_fd, _ in found:
            if leaf_fd >= 0:
                os.close(leaf_fd)


_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def test_create_files_creates_exclusively_and_returns_the_inodes(rank: tuple[Path, int]) -> None:
    root, fd = rank
    (root / "taken.tmp").write_bytes(b"")
    created = fs_io.create_files([fd, fd, fd], ["a.tmp", "taken.tmp", "b.tmp"], _NEW, 0o600)
    try:
        assert created[1] == (-errno.EEXIST, 0)
        for (new_fd, ino), name in ((created[0], "a.tmp"), (created[2], "b.tmp")):
            st = (root / name).stat()
            assert new_fd >= 0 and ino == st.st_ino == os.fstat(new_fd).st_ino
            assert st.st_mode & 0o777 == 0o600 & ~_umask()
    finally:
        for new_fd, _ in created:
            if new_fd >= 0:
                os.close(new_fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_publish_files_writes_closes_and_renames_or_says_where_it_stopped(
    rank: tuple[Path, int],
) -> None:
    root, fd = rank
    (root / "busy.bin").mkdir()
    (root / "busy.bin" / "x").write_bytes(b"")  # a non-empty directory: no rename over it
    created = fs_io.create_files([fd] * 3, ["a.tmp", "b.tmp", "c.tmp"], _NEW, 0o600)
    read_only = os.open(root / "c.tmp", os.O_RDONLY)  # writev to it fails
    os.close(created[2][0])
    fds = [created[0][0], created[1][0], read_only]
    headers = memoryview(mmap.mmap(-1, 3 * HEADER_SIZE))
    headers[:] = b"h" * (3 * HEADER_SIZE)
    rows = [memoryview(bytes([i]) * ROW) for i in range(3)]
    codes = fs_io.publish_files(
        fds, headers, rows, [fd] * 3, ["a.tmp", "b.tmp", "c.tmp"],
        ["a.bin", "busy.bin", "c.bin"], True,
    )  # fmt: skip
    assert codes[:2] == [0, 0]
    assert (root / "a.bin").read_bytes() == b"h" * HEADER_SIZE + b"\0" * ROW
    assert not (root / "a.tmp").exists()
    assert codes[2] == 4 and codes[3] in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert (root / "b.tmp").stat().st_size == HEADER_SIZE + ROW, "written, left for the caller"
    assert codes[4:] == [1, errno.EBADF] and not (root / "c.bin").exists()
    for closed in fds:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(closed)


def test_publish_files_touches_nothing_when_its_arguments_are_wrong(
    rank: tuple[Path, int],
) -> None:
    root, fd = rank
    ((new_fd, _),) = fs_io.create_files([fd], ["a.tmp"], _NEW, 0o600)
    headers = memoryview(mmap.mmap(-1, HEADER_SIZE))
    try:
        with pytest.raises(TypeError, match="finals"):
            fs_io.publish_files([new_fd], headers, [memoryview(b"x")], [fd], ["a.tmp"], [1], True)
        os.fstat(new_fd)  # still open
        assert (root / "a.tmp").stat().st_size == 0
    finally:
        os.close(new_fd)


def test_a_full_filesystem_fails_the_batched_store_and_leaves_no_temporary_file(
    make_tier: TierFactory, primary: Primary, tmp_path: Path
) -> None:
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    file_size = HEADER_SIZE + primary.row_bytes
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={3 * file_size + file_size // 2}", "tmpfs",
         str(mount_point)],
        capture_output=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs privileges): {proc.stderr.decode()}")
    try:
        tier = make_tier(root_dir=str(mount_point), min_free_bytes=0)
        keys = [key_of(i) for i in range(5)]
        assert not store(tier, primary, keys, [0, 1, 2, 3, 4])  # room for three and a half
        assert not list(mount_point.rglob("*.tmp"))
        stored = [key for key in keys if Path(block_file(tier, key)).exists()]
        assert 1 <= len(stored) <= 3
        assert all(Path(block_file(tier, k)).stat().st_size == file_size for k in stored)
        assert load(tier, primary, stored, list(range(8, 8 + len(stored))))
        tier.shutdown()
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "o_direct"])
def test_a_tier_stores_and_loads_the_same_with_and_without_them(
    make_tier: TierFactory,
    primary: Primary,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    o_direct: bool,
) -> None:
    keys = [key_of(i) for i in range(6)]
    files: list[dict[bytes, bytes]] = []
    for python in (False, True):
        if python:
            monkeypatch.setenv(DISABLE_ENV, "0")
        tier = make_tier(root_dir=str(tmp_path / f"root{python}"), o_direct=o_direct)
        assert store(tier, primary, keys[:4], [0, 1, 2, 3])
        # The second store finds four files there (skipped) and writes two into new directories.
        assert store(tier, primary, keys, [0, 1, 2, 3, 4, 5])
        assert load(tier, primary, keys, [10, 11, 12, 13, 14, 15])
        assert all(primary.holds(10 + i, key) for i, key in enumerate(keys))
        files.append({key: Path(block_file(tier, key)).read_bytes() for key in keys})
        tier.shutdown()
    assert files[0] == files[1]


def test_a_corrupt_file_read_by_them_is_deleted_by_the_python_path(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier()
    keys = [key_of(1), key_of(2)]
    assert store(tier, primary, keys, [0, 1])
    path = Path(block_file(tier, keys[1]))
    with path.open("r+b") as f:
        f.seek(HEADER_SIZE + 100)
        f.write(b"\xff\xfe")
    assert not load(tier, primary, keys, [4, 5])
    assert primary.holds(4, keys[0])
    assert not path.exists()
    assert tier.get_stats().counters["corrupt_removed"] == 1


def test_the_environment_or_another_build_turns_them_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert load_native_io() is fs_io
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert load_native_io() is None
    monkeypatch.delenv(DISABLE_ENV)
    stale = types.ModuleType(native_io.MODULE)
    stale.ABI_VERSION = native_io.ABI_VERSION + 1  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, native_io.MODULE, stale)
    with caplog.at_level(logging.WARNING, logger=native_io.__name__):
        assert load_native_io() is None
    assert "from another build" in caplog.text
