"""The start-up scan: rebuild the capacity index from the rank directory and clean leftovers.

The directory is the index of the filesystem tier: a new tier over an existing root serves the
blocks already there from its first lookup (lookups ``stat`` the files). What the scan rebuilds is
the *accounting* (bytes used, LRU order) needed to enforce ``max_bytes``. It runs on its own
daemon thread, so it never delays the scheduler; until it ends, ``max_bytes`` applies to the
files known so far, and it evicts down to the bound when it ends.

What it does with each entry below ``<rank_dir>/<hhh>/<hh>_g<group>/``:

* a block file (well-formed name in the right directory, regular file): indexed with its size,
  as least recently used (files found at start rank colder than anything used since);
* a temporary file that ``is_stale_tmp`` calls a leftover (a dead writer's, or too old): deleted;
* a block name whose file is not exactly one block file of this run's geometry (header plus one
  primary row): deleted, counted as invalid, never indexed (one 2 GiB file named like a block
  would otherwise make the tier evict every valid block to get under ``max_bytes``);
* a digested block name (``z<digest>.bin``) whose header cannot be read: deleted (nothing could
  ever load it); its key is taken from the header otherwise;
* anything else: left alone and not counted.

Symlinks are never followed: directories are opened with ``O_NOFOLLOW`` relative to their parent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.fs.block_file import BlockFileCorrupt, file_size
from vllm.v1.kv_offload.tiering.fs.block_io import (
    TMP_SUFFIX,
    is_stale_tmp,
    open_dir,
    read_header_key,
    unlink_if_same,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath, FileMapper
from vllm.v1.kv_offload.tiering.fs.index import CapacityIndex

logger = logging.getLogger(__name__)


@dataclass
class ScanStats:
    """What one scan found.

    Attributes:
        blocks: block files indexed.
        bytes: their total size.
        tmp_removed: leftover temporary files deleted.
        invalid_removed: block files deleted because they were of the wrong size or (digested
            names) had an unreadable header.
        errors: directories or files that could not be examined (left alone).
        completed: False if the scan was stopped before the end.
    """

    blocks: int = 0
    bytes: int = 0
    tmp_removed: int = 0
    invalid_removed: int = 0
    errors: int = 0
    completed: bool = False


def _maybe_remove_tmp(dir_fd: int, name: str, max_age_s: float, stats: ScanStats) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        return
    if is_stale_tmp(name, time.time() - st.st_mtime, max_age_s):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
            stats.tmp_removed += 1


def scan_rank_dir(
    rank_fd: int,
    index: CapacityIndex,
    *,
    run_digest: bytes,
    payload_len: int,
    stale_tmp_age_s: float,
    stop: threading.Event,
    on_progress: Callable[[ScanStats], None] | None = None,
) -> ScanStats:
    """Walk the rank directory once; index block files and delete leftovers.

    Args:
        rank_fd: descriptor of ``<root>/<model>_<digest>_r<rank>`` (not closed here).
        index: where found files are recorded (``observe`` with a ticket per file).
        run_digest: to validate headers of digested-name files.
        payload_len: payload bytes of a block file.
        stale_tmp_age_s: passed to ``is_stale_tmp``.
        stop: checked between entries; when set the scan returns early (``completed=False``).
        on_progress: called after each ``<hhh>`` directory (tests).
    """
    stats = ScanStats()
    with os.scandir(rank_fd) as top:
        top_entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in top]
    for dir1, is_dir in top_entries:
        if stop.is_set():
            return stats
        if not is_dir:
            if dir1.endswith(TMP_SUFFIX):
                _maybe_remove_tmp(rank_fd, dir1, stale_tmp_age_s, stats)
            continue
        if len(dir1) != 3:
            continue
        try:
            fd1 = open_dir(dir1, rank_fd, create=False)
        except OSError as e:
            logger.warning("fs tier scan: cannot open %s: %s", dir1, e)
            stats.errors += 1
            continue
        try:
            _scan_dir1(fd1, dir1, index, run_digest, payload_len, stale_tmp_age_s, stop, stats)
        finally:
            os.close(fd1)
        if on_progress is not None:
            on_progress(stats)
    stats.completed = not stop.is_set()
    return stats


def _scan_dir1(
    fd1: int,
    dir1: str,
    index: CapacityIndex,
    run_digest: bytes,
    payload_len: int,
    stale_tmp_age_s: float,
    stop: threading.Event,
    stats: ScanStats,
) -> None:
    with os.scandir(fd1) as it:
        dir2_names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
    for dir2 in dir2_names:
        if stop.is_set():
            return
        try:
            fd2 = open_dir(dir2, fd1, create=False)
        except OSError as e:
            logger.warning("fs tier scan: cannot open %s/%s: %s", dir1, dir2, e)
            stats.errors += 1
            continue
        try:
            with os.scandir(fd2) as it:
                names = [e.name for e in it]
            for name in names:
                if name.endswith(TMP_SUFFIX):
                    _maybe_remove_tmp(fd2, name, stale_tmp_age_s, stats)
                    continue
                parsed = FileMapper.parse_block_path(dir1, dir2, name)
                if parsed is None:
                    continue
                key: OffloadKey | None = parsed[0]
                ticket = index.ticket()
                try:
                    st = os.stat(name, dir_fd=fd2, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if st.st_size != file_size(payload_len):
                        # Never indexed at its size: one huge file would evict every valid block.
                        raise BlockFileCorrupt(
                            f"{st.st_size} bytes instead of {file_size(payload_len)}",
                            (st.st_dev, st.st_ino),
                        )
                    if key is None:
                        key = OffloadKey(
                            read_header_key(
                                fd2, name, run_digest=run_digest, payload_len=payload_len
                            )
                        )
                        if FileMapper.block_path(key) != BlockPath(dir1, dir2, name):
                            continue  # a valid file in the wrong place: not ours to judge
                except FileNotFoundError:
                    continue
                except BlockFileCorrupt as e:
                    logger.warning(
                        "fs tier scan: removing invalid %s/%s/%s: %s", dir1, dir2, name, e
                    )
                    # Only the inode found corrupt: a writer may have renamed a good file
                    # over it since.
                    try:
                        if unlink_if_same(fd2, name, e.file_id):
                            stats.invalid_removed += 1
                    except OSError as unlink_error:
                        logger.warning(
                            "fs tier scan: cannot remove %s/%s/%s: %s",
                            dir1,
                            dir2,
                            name,
                            unlink_error,
                        )
                        stats.errors += 1
                    continue
                except OSError as e:
                    logger.warning("fs tier scan: cannot examine %s/%s/%s: %s", dir1, dir2, name, e)
                    stats.errors += 1
                    continue
                if index.observe(key, st.st_size, ticket, hot=False):
                    stats.blocks += 1
                    stats.bytes += st.st_size
        finally:
            os.close(fd2)
