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

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.fs.block_io import (
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

    def __init__(self, root_dir: str, mapper: FileMapper, root_fd: int, rank_fd: int) -> None:
        self.root_dir = root_dir
        self.rank_dir = os.path.join(root_dir, mapper.rank_dir_name)
        self.config_path = os.path.join(root_dir, mapper.base_name, CONFIG_FILE)
        self._root_fd = root_fd
        self.rank_fd = rank_fd

    @classmethod
    def open(cls, root_dir: str, mapper: FileMapper, writer: str) -> RunDirectory:
        """Create/open the run's directories and write or check ``config.json``.

        Raises:
            OSError: ``root_dir`` (named in the message) cannot be created, opened or written.
            ValueError: ``config.json`` exists and describes another run.
        """
        root_fd = rank_fd = -1
        try:
            os.makedirs(root_dir, exist_ok=True)
            root_fd = os.open(root_dir, _ROOT_FLAGS)
            base_fd = open_dir(mapper.base_name, root_fd, create=True)
            try:
                _write_or_check_config(
                    base_fd, mapper, os.path.join(root_dir, mapper.base_name), writer
                )
            finally:
                os.close(base_fd)
            rank_fd = open_dir(mapper.rank_dir_name, root_fd, create=True)
            # The block directory itself must be writable (config.json may already exist).
            probe = tmp_name("probe", writer)
            os.close(os.open(probe, _NEW_FILE_FLAGS, 0o644, dir_fd=rank_fd))
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
        return cls(root_dir, mapper, root_fd, rank_fd)

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
        works = probe_o_direct(self.rank_fd, writer)
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
            os.close(os.open(src, _NEW_FILE_FLAGS, 0o644, dir_fd=self.rank_fd))
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


def _write_or_check_config(base_fd: int, mapper: FileMapper, base_dir: str, writer: str) -> None:
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
    fd = os.open(tmp, _NEW_FILE_FLAGS, 0o644, dir_fd=base_fd)
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
