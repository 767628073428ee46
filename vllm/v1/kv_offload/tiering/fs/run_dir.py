# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Opening a run's directories under ``root_dir`` and probing what the filesystem supports.

``RunDirectory.open`` creates (if needed) ``<root>/<model>_<digest>/`` with its ``config.json``
and ``<root>/<model>_<digest>_r<rank>/``, checks that an existing ``config.json`` describes the
same run, checks that the block directory is writable, and keeps descriptors of the root and of
the block ("rank") directory open: every later path operation is relative to the rank
descriptor, so renaming or replacing ``root_dir`` itself after start does not redirect I/O.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import stat

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.fs.block_io import (
    FileModes,
    buffer_address,
    open_dir,
    probe_o_direct,
    tmp_name,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import CONFIG_FILE, FileMapper
from vllm.v1.kv_offload.tiering.run_identity import canonical_json

logger = init_logger(__name__)

_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DEFAULT_MIN_FREE_CAP = 1 << 30
_DEFAULT_MIN_FREE_DIVISOR = 20  # 5 %


class RunDirectory:
    """Open descriptors of a run's directories (owned; ``close()`` releases them).

    Attributes:
        root_dir: the root path.
        rank_dir: absolute path of the block directory.
        config_path: absolute path of ``config.json``.
        rank_fd: descriptor of the block directory.
    """

    def __init__(
        self, root_dir: str, mapper: FileMapper, root_fd: int, rank_fd: int, modes: FileModes
    ) -> None:
        self.root_dir = root_dir
        self.rank_dir = os.path.join(root_dir, mapper.rank_dir_name)
        self.config_path = os.path.join(root_dir, mapper.base_name, CONFIG_FILE)
        self.modes = modes
        self._root_fd = root_fd
        self.rank_fd = rank_fd

    @classmethod
    def open(cls, root_dir: str, mapper: FileMapper, writer: str, modes: FileModes) -> RunDirectory:
        """Create/open the run's directories and write or check ``config.json``.

        The root, if this call creates it, and every directory and file below get ``modes``
        (its missing parents are created as ``os.makedirs`` does, under the umask). An existing
        root that others may read (``modes.open_bits``) is left as it is, with one WARNING.

        Raises:
            OSError: ``root_dir`` (named in the message) cannot be created, opened or written.
            ValueError: ``config.json`` exists and describes another run.
        """
        root_fd = rank_fd = -1
        try:
            os.makedirs(os.path.dirname(root_dir), exist_ok=True)
            try:
                os.mkdir(root_dir, modes.dirs)
                created = True
            except FileExistsError:
                created = False
            root_fd = os.open(root_dir, _ROOT_FLAGS)
            if created:
                modes.fix_dir(root_fd)
            else:
                _warn_if_open(root_dir, os.fstat(root_fd).st_mode, modes)
            base_fd = open_dir(mapper.base_name, root_fd, create=modes)
            try:
                _write_or_check_config(
                    base_fd, mapper, os.path.join(root_dir, mapper.base_name), writer, modes
                )
            finally:
                os.close(base_fd)
            rank_fd = open_dir(mapper.rank_dir_name, root_fd, create=modes)
            # The block directory itself must be writable (config.json may already exist).
            probe = tmp_name("probe", writer)
            os.close(modes.create_file(probe, _NEW_FILE_FLAGS, rank_fd))
            os.unlink(probe, dir_fd=rank_fd)
        except BaseException as e:
            for fd in (rank_fd, root_fd):
                if fd >= 0:
                    os.close(fd)
            if isinstance(e, OSError):
                raise OSError(
                    e.errno, f"fs tier: root_dir {root_dir!r} is not usable: {e.strerror or e}"
                ) from e
            raise
        return cls(root_dir, mapper, root_fd, rank_fd, modes)

    def decide_o_direct(
        self, mode: bool | str, rows: memoryview, row_bytes: int, writer: str
    ) -> bool:
        """Whether to use O_DIRECT: probed on this filesystem, and rows page-aligned.

        Args:
            mode: ``FsTierConfig.o_direct``.
            rows: the primary view (its address must be page-aligned).
            row_bytes: bytes per row (must be a multiple of the page size).
            writer: writer id for the probe file's name.

        Raises:
            OSError: ``mode`` is True and O_DIRECT is not usable.
        """
        if mode is False:
            return False
        aligned = row_bytes % mmap.PAGESIZE == 0 and (
            len(rows) == 0 or buffer_address(rows) % mmap.PAGESIZE == 0
        )
        works = probe_o_direct(self.rank_fd, writer, self.modes)
        if mode is True and not (works and aligned):
            raise OSError(
                errno.EINVAL,
                f"fs tier: o_direct=true but O_DIRECT is not usable in root_dir "
                f"{self.root_dir!r} (filesystem support: {works}, page-aligned primary rows: "
                f"{aligned})",
            )
        return works and aligned

    def supports_hard_links(self, writer: str) -> bool:
        """Whether ``link(2)`` works in the block directory (capacity slots need it; some FUSE
        and SMB filesystems lack it)."""
        src, dst = tmp_name("probe", writer), tmp_name("probe", writer)
        try:
            os.close(self.modes.create_file(src, _NEW_FILE_FLAGS, self.rank_fd))
            os.link(src, dst, src_dir_fd=self.rank_fd, dst_dir_fd=self.rank_fd,
                    follow_symlinks=False)  # fmt: skip
        except OSError as e:
            logger.info("fs tier: hard links do not work under %s: %s", self.root_dir, e)
            return False
        finally:
            for name in (src, dst):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.rank_fd)
        return True

    def resolve_min_free_bytes(self, configured: int | None) -> int:
        """``configured``, or by default ``min(1 GiB, 5 % of the filesystem)``."""
        if configured is not None:
            return configured
        st = os.statvfs(self.rank_fd)
        return min(_DEFAULT_MIN_FREE_CAP, st.f_blocks * st.f_frsize // _DEFAULT_MIN_FREE_DIVISOR)

    def close(self) -> None:
        """Close the descriptors (idempotent)."""
        for attr in ("rank_fd", "_root_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                with contextlib.suppress(OSError):
                    os.close(fd)


def _warn_if_open(root_dir: str, mode: int, modes: FileModes) -> None:
    """One WARNING if users other than those ``modes`` allows may read the existing root (it is
    not changed: its owner chose its mode)."""
    if not mode & modes.open_bits:
        return
    who = "other users" if modes.permissions == "private" else "users outside its group"
    logger.warning(
        "fs tier: root_dir %s (mode %04o) is open to %s, who may read the cached blocks (KV "
        "caches of every prompt); the tier leaves its mode as it is: `chmod %s %s` to make "
        "it %s",
        root_dir,
        stat.S_IMODE(mode),
        who,
        "700" if modes.permissions == "private" else "o-rwx",
        root_dir,
        "private" if modes.permissions == "private" else "its group's only",
    )


def _write_or_check_config(
    base_fd: int, mapper: FileMapper, base_dir: str, writer: str, modes: FileModes
) -> None:
    expected = mapper.run_config_json
    path = os.path.join(base_dir, CONFIG_FILE)
    try:
        fd = os.open(CONFIG_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)
    except FileNotFoundError:
        existing = None
    else:
        with os.fdopen(fd, "rb") as f:
            existing = f.read()
    if existing is not None:
        try:
            same = canonical_json(json.loads(existing)) == expected
        except (ValueError, TypeError):
            logger.warning("fs tier: rewriting unreadable %s", path)
        else:
            if not same:
                raise ValueError(
                    f"fs tier: {path} describes another run than this one ({expected}); "
                    "remove that directory or use another root_dir"
                )
            return
    # Atomic publication, like block files: concurrent first starts write identical bytes.
    tmp = tmp_name("config", writer)
    fd = modes.create_file(tmp, _NEW_FILE_FLAGS, base_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(expected.encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, CONFIG_FILE, src_dir_fd=base_fd, dst_dir_fd=base_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=base_fd)
        raise
    os.fsync(base_fd)
