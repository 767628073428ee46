# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""System-call level I/O of block files: safe directory walks, atomic writes, verified reads.

Symlinks: every directory below the rank directory is opened with ``O_NOFOLLOW | O_DIRECTORY``
relative to its parent's descriptor, and every block file with ``O_NOFOLLOW``, so a symlink
planted anywhere below the rank directory fails the operation (``ELOOP``/``ENOTDIR``) instead of
redirecting it outside the root.

Atomicity: a block is written to a temporary file in its final directory (``O_EXCL``; with
buffered I/O fsynced), and renamed over the final name (``os.replace``, atomic on POSIX
filesystems). A reader therefore
sees either no file or a complete one; a crash leaves at most a temporary file, whose name never
matches a block file name. The durability of the new names (and of new block directories) is
the job's: one directory ``fsync`` when its last block is written (``transfers.JobRecord``; see
docs/fs_tier.md, "Crash safety").

Temporary file names: ``.<stem>.<host>.<pid>.<writer>.<random>.tmp`` where ``<host>`` is 8 hex
digits of the host name's BLAKE2b digest, ``<pid>`` the writing process and ``<writer>`` a random
id of the writing tier instance. The start-up scan uses them to tell a dead writer's leftovers
(delete now) from a live writer's file in progress (leave alone, unless older than a limit).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.block_format import (
    HEADER_SIZE,
    BlockFileCorrupt,
    IntegrityKey,
    decode_header,
    file_size,
    verify_parts,
    write_block_header,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.fs.config import Permissions
    from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath

logger = init_logger(__name__)

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
"""``os.O_DIRECT`` where the platform has it (Linux), else 0."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

HOST_TAG = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
"""This host's tag in temporary file names."""

TMP_SUFFIX = ".tmp"
_TMP_RE = re.compile(
    r"^\.(?P<stem>[0-9a-z]{1,130})\.(?P<host>[0-9a-f]{8})\.(?P<pid>[1-9][0-9]{0,9})"
    r"\.(?P<writer>[0-9a-f]{8})\.[0-9a-f]{8}\.tmp$"
)

CreatedHook = Callable[[str, int], Callable[[], None] | None]
"""``write_block_file``'s ``on_created(tmp, fd)``; returns an undo for an unpublished file."""

# Writer ids of the tier instances alive in this process: their temporary files are in progress.
_live_writers: set[str] = set()
_live_writers_lock = threading.Lock()


# ---------------------------------------------------------------------------------------------
# Temporary files
# ---------------------------------------------------------------------------------------------


def register_writer() -> str:
    """Create the writer id of a new tier instance (until ``unregister_writer``)."""
    writer = secrets.token_hex(4)
    with _live_writers_lock:
        _live_writers.add(writer)
    return writer


def unregister_writer(writer: str) -> None:
    """Forget ``writer``: its leftovers become deletable by scans in this process."""
    with _live_writers_lock:
        _live_writers.discard(writer)


_TMP_SEQ = itertools.count()
"""Numbers this process's temporary names: with the host, the pid and the writer's random id
they are unique, so a name costs no system call (random bytes did: one more GIL hand-off per
stored block on the I/O threads). ``next`` on a count is atomic under the GIL."""


def tmp_name(stem: str, writer: str) -> str:
    """A fresh temporary file name for ``stem`` written by ``writer`` in this process."""
    seq = next(_TMP_SEQ) & 0xFFFFFFFF
    return f".{stem}.{HOST_TAG}.{os.getpid()}.{writer}.{seq:08x}{TMP_SUFFIX}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_stale_tmp(name: str, age_s: float, max_age_s: float) -> bool:
    """Whether the temporary file ``name`` (``age_s`` old) is a leftover that may be deleted.

    A file written on this host by a process that no longer exists, or by this process through a
    tier instance that no longer exists, is stale at once. Any other file of ours (another host,
    or a live process) is stale once older than ``max_age_s``. Names we did not produce are never
    stale.
    """
    match = _TMP_RE.match(name)
    if match is None:
        return False
    return writer_gone(match.group("host"), int(match.group("pid")), match.group("writer")) or (
        age_s >= max_age_s
    )


def writer_gone(host: str, pid: int, writer: str) -> bool:
    """Whether the tier instance ``writer`` of process ``pid`` on host ``host`` (its tag) is
    known to be gone: on this host, the process no longer exists, or it is this process and the
    instance was unregistered. False for other hosts (nothing can tell from here)."""
    if host != HOST_TAG:
        return False
    if pid == os.getpid():
        with _live_writers_lock:
            return writer not in _live_writers
    return not _pid_alive(pid)


def is_stale_tmp_file(dir_fd: int, name: str, max_age_s: float) -> bool:
    """Whether ``name`` in ``dir_fd`` is a regular file (not followed if a link) that
    ``is_stale_tmp`` calls a leftover, its age taken from its mtime; False if it is gone."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and is_stale_tmp(name, time.time() - st.st_mtime, max_age_s)


# ---------------------------------------------------------------------------------------------
# Permissions
# ---------------------------------------------------------------------------------------------

_SETGID = stat.S_ISGID


def process_umask() -> int:
    """The process's file mode creation mask.

    Read from ``/proc/self/status`` where the kernel reports it (Linux >= 4.7): setting and
    restoring it, the only portable way, would briefly apply another mask to files other threads
    create meanwhile.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


@dataclass(frozen=True)
class FileModes:
    """The modes of every directory and file the tier creates, exact whatever the umask.

    Block files, their slot links (hard links: the same inode), ``config.json``, presence and
    probe files get ``files``; every directory, the root included when the tier creates it,
    gets ``dirs``. The umask is read once, when the tier starts: a mode it would narrow is set
    again with ``fchmod`` right after creation, and so is a directory mode with the set-group-ID
    bit that ``"group"`` uses (``mkdir`` ignores it). Otherwise creation gives the exact mode and
    no ``fchmod`` follows: on a fresh root a stored block creates one or two directories.

    Attributes:
        permissions: the config value these modes implement.
        dirs: mode of directories: 0700, or 2770 for ``"group"`` (set-group-ID, so that every
            directory and file below the root gets the root's group).
        files: mode of files: 0600, or 0660 for ``"group"``.
        open_bits: mode bits of an existing root that let users read it who should not: group
            and others for ``"private"``, others for ``"group"``.
        umask: the process's umask when the tier started.
    """

    permissions: Permissions
    dirs: int
    files: int
    open_bits: int
    umask: int

    @classmethod
    def of(cls, permissions: Permissions) -> FileModes:
        """The modes of ``permissions``, with the process's umask read now."""
        if permissions == "group":
            return cls(permissions, _SETGID | 0o770, 0o660, 0o007, process_umask())
        return cls(permissions, 0o700, 0o600, 0o077, process_umask())

    @property
    def mkdir_is_exact(self) -> bool:
        """Whether ``mkdir`` with ``dirs`` gives exactly ``dirs``: the umask narrows nothing and
        ``dirs`` has no special bit."""
        return not self.dirs & (self.umask | ~0o777)

    def fix_dir(self, fd: int) -> None:
        """Give a directory this tier just created (``mkdir`` with ``dirs``) exactly ``dirs``
        (a no-op where ``mkdir_is_exact``)."""
        if not self.mkdir_is_exact:
            os.fchmod(fd, self.dirs)

    def fix_file(self, fd: int) -> None:
        """Give a file this tier just created exactly ``files`` (a no-op unless the umask
        narrowed it)."""
        if self.files & self.umask:
            os.fchmod(fd, self.files)

    def create_file(self, name: str, flags: int, dir_fd: int) -> int:
        """``os.open(name, flags | O_CREAT ...)`` of a new file with exactly ``files``."""
        fd = os.open(name, flags, self.files, dir_fd=dir_fd)
        try:
            self.fix_file(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd


# ---------------------------------------------------------------------------------------------
# Directories
# ---------------------------------------------------------------------------------------------


def open_dir(
    name: str, dir_fd: int, *, create: FileModes | None = None, durable: bool = True
) -> int:
    """Open directory ``name`` under ``dir_fd`` without following a symlink; maybe create it.

    A directory this call creates gets exactly ``create.dirs`` (whatever the umask), and, if
    ``durable``, its entry is made durable (the parent is fsynced).

    Args:
        name: the directory's name.
        dir_fd: its parent.
        create: create it with these modes if absent; None: never create.
        durable: fsync the parent after creating it (block directories leave that to the
            job's directory fsync).

    Raises:
        OSError: ``FileNotFoundError`` if absent and not ``create``; ``ELOOP``/``ENOTDIR`` if
            ``name`` is a symlink or not a directory; any other error of the system calls.
    """
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if create is None:
            raise
    try:
        os.mkdir(name, create.dirs, dir_fd=dir_fd)
        created = True
    except FileExistsError:
        created = False  # a concurrent writer made it
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    if created:
        try:
            create.fix_dir(fd)
            if durable:
                os.fsync(dir_fd)
        except BaseException:
            os.close(fd)
            raise
    return fd


def open_block_dir(rank_fd: int, path: BlockPath, *, create: FileModes | None = None) -> int:
    """Open (or create) ``<hhh>/<hh>_g<group>`` under the rank directory; returns its fd. New
    directories are not fsynced here: the storing job's directory fsync covers them."""
    fd1 = open_dir(path.dir1, rank_fd, create=create, durable=False)
    try:
        return open_dir(path.dir2, fd1, create=create, durable=False)
    finally:
        os.close(fd1)


def regular_file_stat(dir_fd: int, name: str) -> os.stat_result | None:
    """``stat`` of regular file ``name`` under ``dir_fd`` (no symlink followed); None if absent
    or not a regular file.

    Raises:
        OSError: any error other than the file (or a directory above it) being absent.
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def regular_file_size(dir_fd: int, name: str) -> int | None:
    """Size of regular file ``name`` under ``dir_fd`` (see ``regular_file_stat``)."""
    st = regular_file_stat(dir_fd, name)
    return None if st is None else st.st_size


# ---------------------------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------------------------


class HeaderBuffers(threading.local):
    """One page-aligned ``HEADER_SIZE`` buffer per thread (O_DIRECT needs aligned buffers), and
    on request a run of them (the headers of a batched task).

    Attributes:
        header: writable memoryview of ``HEADER_SIZE`` bytes, page-aligned.
    """

    def __init__(self) -> None:
        self._mm = mmap.mmap(-1, HEADER_SIZE)
        self.header = memoryview(self._mm)
        self._batch: memoryview | None = None

    def many(self, n: int) -> memoryview:
        """``n`` consecutive page-aligned ``HEADER_SIZE`` buffers, as one view (this thread's;
        overwritten by its next call)."""
        size = n * HEADER_SIZE
        if self._batch is None or len(self._batch) < size:
            self._batch = memoryview(mmap.mmap(-1, size))
        return self._batch[:size]


def buffer_address(buf: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer."""
    import numpy as np  # local: only needed once, at tier start

    arr = np.frombuffer(buf, dtype=np.uint8)
    try:
        return int(arr.ctypes.data)
    finally:
        del arr


# ---------------------------------------------------------------------------------------------
# Whole-buffer I/O
# ---------------------------------------------------------------------------------------------


def _advance(bufs: list[memoryview], n: int) -> None:
    while n and bufs:
        first = len(bufs[0])
        if n >= first:
            n -= first
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][n:]
            n = 0


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    while bufs:
        written = os.writev(fd, bufs)
        if written <= 0:
            raise OSError(errno.EIO, "writev wrote no byte")
        _advance(bufs, written)


def _read_all(fd: int, bufs: list[memoryview]) -> int:
    """Fill ``bufs`` from ``fd``; returns the bytes read (fewer only at end of file)."""
    total = 0
    while bufs:
        got = os.readv(fd, bufs)
        if got == 0:
            break
        total += got
        _advance(bufs, got)
    return total


def new_file_flags(o_direct: bool) -> int:
    """``os.open`` flags of a new temporary block file: created, exclusive, no link followed;
    ``O_DIRECT`` if asked."""
    return _WRITE_FLAGS | (O_DIRECT if o_direct else 0)


def write_block_file(
    leaf_fd: int,
    path: BlockPath,
    tmp: str,
    header_buf: memoryview,
    payload: memoryview,
    *,
    key: bytes,
    run_digest: bytes,
    o_direct: bool,
    modes: FileModes,
    integrity: IntegrityKey | None = None,
    on_created: CreatedHook | None = None,
) -> None:
    """Publish ``payload`` as block file ``path.name`` in ``leaf_fd``, atomically.

    Steps: checksum the payload, create ``tmp`` (``O_EXCL``; ``O_DIRECT`` if asked, which needs
    ``payload`` page-aligned and a multiple of the page size), call ``on_created``, write header
    + payload, with buffered I/O ``fsync`` (with O_DIRECT the bytes are on the device when the
    write returns), close, rename onto the final name. The name, and the bytes' way out of the
    device's write cache, are made durable by the caller's ``fsync`` of ``leaf_fd``, once per job
    (docs/fs_tier.md, "Crash safety"). On any failure before the rename the temporary file is
    removed (after ``on_created``'s undo, if any) and the error re-raised; the final name is then
    untouched.

    Args:
        leaf_fd: the ``<hh>_g<group>`` directory.
        path: the block's path (only ``name`` is used).
        tmp: the temporary file name (from ``tmp_name``).
        header_buf: ``HEADER_SIZE``-byte scratch buffer (page-aligned for O_DIRECT).
        payload: the primary row to store, read-only use.
        key: the block's key (stamped into the header).
        run_digest: the run digest (stamped into the header).
        o_direct: use O_DIRECT.
        modes: the file's mode (``modes.files``).
        integrity: sign the block with this fleet key (a MAC in the header); None: CRCs only.
        on_created: called with ``(tmp, fd)`` once the empty temporary file exists, before any
            byte is written (the capacity slot is claimed there); it may raise to abandon the
            write. What it returns, if not None, is called if the file is not published, while
            ``tmp`` still names it (the slot is released there).

    Raises:
        OSError: from any system call before the rename (ENOSPC, EDQUOT, EIO, ...).
        Exception: whatever ``on_created`` raises.
    """
    write_block_header(header_buf, payload, key=key, run_digest=run_digest, integrity=integrity)
    fd = modes.create_file(tmp, new_file_flags(o_direct), leaf_fd)
    published = False
    undo: Callable[[], None] | None = None
    try:
        try:
            if on_created is not None:
                undo = on_created(tmp, fd)
            _write_all(fd, [header_buf, payload])
            if not o_direct:
                os.fsync(fd)  # the page cache's bytes on the device before the name exists
        finally:
            os.close(fd)
        os.replace(tmp, path.name, src_dir_fd=leaf_fd, dst_dir_fd=leaf_fd)
        published = True
    finally:
        if not published:
            discard_unpublished(leaf_fd, tmp, undo)


def discard_unpublished(leaf_fd: int, tmp: str, undo: Callable[[], object] | None) -> None:
    """Undo a temporary block file that will not be published (already closed): ``undo`` (the
    capacity slot's release, if it was claimed; a failure is logged, not raised), then remove
    ``tmp`` from ``leaf_fd`` if it is there. A temporary name is its writer's own, so removing
    it never removes another process's file."""
    if undo is not None:
        try:
            undo()
        except OSError as e:
            # The slot stays, as garbage once the file is gone: the reconcile frees it.
            logger.warning("fs tier: cannot undo the claim of %s: %s", tmp, e)
    with contextlib.suppress(OSError):
        os.unlink(tmp, dir_fd=leaf_fd)


def read_block_file(
    leaf_fd: int,
    name: str,
    header_buf: memoryview,
    payload: memoryview,
    *,
    key: bytes,
    run_digest: bytes,
    o_direct: bool,
    integrity: IntegrityKey | None = None,
) -> None:
    """Read and verify block file ``name`` into ``payload`` (a primary row).

    ``payload`` may be partly written when this raises; the caller must not mark it valid.

    Args:
        integrity: the fleet key the block must be signed with (its MAC is checked); None: the
            CRCs of any block.

    Raises:
        BlockFileCorrupt: wrong size, short read, bad header or checksum, or (``BlockForged``) a
            MAC that does not verify; ``file_id`` names the inode that was read, so only that
            file is deleted.
        BlockNotAuthenticated: ``integrity`` is set and the file was written without it (no key,
            or another key id).
        OSError: a system-call error (``FileNotFoundError`` when the file vanished), or
            ``EINVAL`` when ``name`` is not a regular file.
    """
    fd = os.open(name, _READ_FLAGS | (O_DIRECT if o_direct else 0), dir_fd=leaf_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        file_id = (st.st_dev, st.st_ino)
        expected = file_size(len(payload))
        if st.st_size != expected:
            raise BlockFileCorrupt(f"file size {st.st_size}, expected {expected}", file_id)
        got = _read_all(fd, [header_buf, payload])
        if got != expected:
            raise BlockFileCorrupt(f"read {got} of {expected} bytes (truncated)", file_id)
        try:
            verify_parts(header_buf, payload, key=key, run_digest=run_digest, integrity=integrity)
        except BlockFileCorrupt as e:
            raise type(e)(e.reason, file_id) from None
    finally:
        os.close(fd)


def read_header_key(dir_fd: int, name: str, *, run_digest: bytes, payload_len: int) -> bytes:
    """Return the key stamped in block file ``name`` (header validated, payload not read).

    Raises:
        BlockFileCorrupt: bad header or size.
        OSError: system-call errors.
    """
    fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", name)
        file_id = (st.st_dev, st.st_ino)
        if st.st_size != file_size(payload_len):
            raise BlockFileCorrupt(f"file size {st.st_size}", file_id)
        header = os.pread(fd, HEADER_SIZE, 0)
        try:
            key, _ = decode_header(
                memoryview(header), key=None, run_digest=run_digest, payload_len=payload_len
            )
        except BlockFileCorrupt as e:
            raise BlockFileCorrupt(e.reason, file_id) from None
        return key
    finally:
        os.close(fd)


def unlink_block(dir_fd: int, name: str, file_id: tuple[int, int] | None) -> os.stat_result | None:
    """Unlink ``name`` if it is still the inode ``file_id`` (any file if None).

    Guards against deleting a fresh file that another writer renamed into place after the
    caller found the old one corrupt (up to the few microseconds between the ``stat`` and the
    ``unlink``: POSIX has no unlink-by-inode).

    Returns:
        The ``stat`` of the file unlinked (its inode tells the caller which slot to release);
        None if the name is absent or now refers to another file.

    Raises:
        OSError: errors other than absence.
    """
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if file_id is not None and (st.st_dev, st.st_ino) != file_id:
        return None
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    return st


# ---------------------------------------------------------------------------------------------
# Capability probe
# ---------------------------------------------------------------------------------------------


def probe_o_direct(dir_fd: int, writer: str, modes: FileModes) -> bool:
    """Whether O_DIRECT works in directory ``dir_fd``: write, fsync and read back one page.

    False on platforms without O_DIRECT and on filesystems that reject it (tmpfs, overlayfs,
    some NFS mounts).
    """
    if not O_DIRECT:
        return False
    page = mmap.PAGESIZE
    name = tmp_name("probe", writer)
    src_mm = mmap.mmap(-1, page)
    dst_mm = mmap.mmap(-1, page)
    src, dst = memoryview(src_mm), memoryview(dst_mm)
    try:
        src[:] = secrets.token_bytes(page)
        fd = modes.create_file(name, _WRITE_FLAGS | O_DIRECT, dir_fd)
        try:
            _write_all(fd, [src])
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(name, _READ_FLAGS | O_DIRECT, dir_fd=dir_fd)
        try:
            got = _read_all(fd, [dst])
        finally:
            os.close(fd)
        return got == page and src == dst
    except OSError as e:
        logger.info("fs tier: O_DIRECT is not usable here (%s); using buffered I/O", e)
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        src.release()
        dst.release()
        src_mm.close()
        dst_mm.close()
