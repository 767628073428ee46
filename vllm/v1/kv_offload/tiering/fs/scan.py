# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Reading the rank directory back into the index: the start-up scan and every reconcile pass.

The directory is the index of the filesystem tier: a new tier over an existing root serves the
blocks already there from its first lookup (lookups ``stat`` the files). What a pass rebuilds is
the *accounting* (bytes used, LRU order), and with other instances on the same root it keeps
that accounting converging to the directory: files others wrote are added, files others deleted
are forgotten. ``RankDirWalker.walk`` does one pass, one directory per step; the start-up scan
(``RankDirWalker.scan``) runs a pass at full speed, the reconcile thread (``reconcile``) runs
passes when there is something to learn, a bounded number of entries per interval.

A pass reads the capacity slot directories first (``slots.walk_subdir``: garbage slots freed,
so that the block files below can be adopted), then every leaf directory
``<rank_dir>/<hhh>/<hh>_g<group>/``. In a leaf, under one ticket taken before listing it:

* a block file (well-formed name in the right directory, regular file) of exactly one block
  file's size: indexed (``observe``). A file new to this instance ranks as least recently used,
  unless modified since the previous pass began (another instance just wrote it: recent);
* a block name of any other size: deleted as invalid, counted, never indexed (one 2 GiB file
  named like a block would otherwise make the tier evict every valid block to fit it);
* with capacity slots, a block file that holds none (link count 1: written without
  ``max_bytes``, or from before slots existed): given a free slot, or evicted if none is free;
* a digested block name (``z<digest>.bin``) whose header cannot be read: deleted (nothing could
  ever load it); its key is taken from the header otherwise;
* a temporary file that ``is_stale_tmp`` calls a leftover (a dead writer's, or too old): deleted;
* anything else: left alone and not counted;
* an indexed key of this leaf that the listing lacks: forgotten (another instance or an operator
  deleted it). The ticket keeps this tier's own changes made meanwhile.

Indexed keys of directories that no longer exist (the listing of their parent lacks them) are
forgotten too. Symlinks are never followed: directories are opened with ``O_NOFOLLOW`` relative to
their parent.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Generator, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.block_format import BlockFileCorrupt
from vllm.v1.kv_offload.tiering.fs.block_io import (
    TMP_SUFFIX,
    is_stale_tmp,
    open_dir,
    read_header_key,
    unlink_block,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import BlockPath, FileMapper
from vllm.v1.kv_offload.tiering.fs.slots import SlotWalkStats

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.fs.capacity import FileRemover, RankFiles

logger = init_logger(__name__)


@dataclass
class ScanStats:
    """What one pass found and did.

    Attributes:
        blocks: block files indexed (or confirmed).
        bytes: their total size.
        tmp_removed: leftover temporary files deleted.
        invalid_removed: block files deleted because they were of the wrong size or (digested
            names) had an unreadable header.
        adopted: slotless block files given a capacity slot.
        unslotted_removed: slotless block files evicted because no slot was free.
        forgotten: indexed keys whose file was gone.
        entries: directory entries (files and directories) examined.
        errors: directories or files that could not be examined (left alone).
        completed: False if the pass was stopped before the end.
        slots: what the slot walk did.
    """

    blocks: int = 0
    bytes: int = 0
    tmp_removed: int = 0
    invalid_removed: int = 0
    adopted: int = 0
    unslotted_removed: int = 0
    forgotten: int = 0
    entries: int = 0
    errors: int = 0
    completed: bool = False
    slots: SlotWalkStats = field(default_factory=SlotWalkStats)


def leaf_bucket(key: OffloadKey) -> tuple[Hashable, Hashable]:
    """The leaf directory ``(hhh, hh_g<group>)`` of ``key``'s file: the index's bucket."""
    path = FileMapper.block_path(key)
    return (path.dir1, path.dir2)


class RankDirWalker:
    """Walks one rank directory for one tier, a leaf directory per step.

    Thread-safety: one pass at a time (the scan/reconcile thread); the index, remover and slots
    it calls are thread-safe. Borrowed: ``files`` and the remover.

    Args:
        files: the rank directory; its index records the files found (``observe`` under a
            ticket per leaf directory), its mapper's run digest validates the headers of
            digested-name files, its slots (if any) are walked first.
        remover: deletes wrong-sized and unslotted files through the index (events, counters,
            slots); a digested-name file of the wrong size or whose header cannot be read (its
            key unknown) is unlinked directly, counted in ``files.counters``.
        stale_tmp_age_s: passed to ``is_stale_tmp``.
    """

    def __init__(self, files: RankFiles, remover: FileRemover, *, stale_tmp_age_s: float) -> None:
        self._files = files
        self._remover = remover
        self._stale_tmp_age_s = stale_tmp_age_s

    def scan(self, stop: threading.Event) -> ScanStats:
        """One complete pass at full speed (the start-up scan): index files, delete leftovers.

        Args:
            stop: checked between directories; when set the scan returns early
                (``completed=False``).
        """
        stats = ScanStats()
        steps = self.walk(stats, hot_since=None)
        try:
            while not stop.is_set():
                if next(steps, None) is None:
                    return stats
        finally:
            steps.close()
        stats.completed = False
        return stats

    def walk(
        self,
        stats: ScanStats,
        *,
        hot_since: float | None,
    ) -> Generator[int, None, None]:
        """One pass; yields the number of entries examined after each directory.

        Stopping early is closing the generator. ``stats.completed`` is set at the end.

        Args:
            stats: updated as the pass goes.
            hot_since: wall time since which a newly found file counts as recently used (None:
                every newly found file ranks as least recently used).
        """
        slots = self._files.slots
        if slots is not None:
            for sub in slots.subdirs():
                n = slots.walk_subdir(sub, stats.slots)
                stats.entries += n
                yield n
        with os.scandir(self._files.rank_fd) as top:
            top_entries = sorted((e.name, e.is_dir(follow_symlinks=False)) for e in top)
        listed = {name for name, is_dir in top_entries if is_dir}
        for dir1 in self._files.index.outer_buckets():
            if dir1 not in listed:
                self._forget_if_gone(str(dir1), None, stats)
        for dir1, is_dir in top_entries:
            if not is_dir:
                if dir1.endswith(TMP_SUFFIX):
                    self._maybe_remove_tmp(self._files.rank_fd, dir1, stats)
                continue
            if len(dir1) != 3:
                continue
            try:
                fd1 = open_dir(dir1, self._files.rank_fd)
            except OSError as e:
                logger.warning("fs tier scan: cannot open %s: %s", dir1, e)
                stats.errors += 1
                continue
            try:
                with os.scandir(fd1) as it:
                    dir2_names = sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
                listed = set(dir2_names)
                for dir2 in self._files.index.inner_buckets(dir1):
                    if dir2 not in listed:
                        self._forget_if_gone(dir1, str(dir2), stats)
                for dir2 in dir2_names:
                    n = self._leaf(fd1, dir1, dir2, stats, hot_since)
                    stats.entries += n
                    yield n
            finally:
                os.close(fd1)
        stats.completed = True

    # -----------------------------------------------------------------------------------------
    # One leaf directory
    # -----------------------------------------------------------------------------------------

    def _leaf(
        self, fd1: int, dir1: str, dir2: str, stats: ScanStats, hot_since: float | None
    ) -> int:
        index = self._files.index
        ticket = index.ticket()
        try:
            fd2 = open_dir(dir2, fd1)
        except FileNotFoundError:
            return 1
        except OSError as e:
            logger.warning("fs tier scan: cannot open %s/%s: %s", dir1, dir2, e)
            stats.errors += 1
            return 1
        try:
            names = os.listdir(fd2)
            seen: set[OffloadKey] = set()
            for name in names:
                parsed = FileMapper.parse_block_path(dir1, dir2, name)
                try:
                    if name.endswith(TMP_SUFFIX):
                        self._maybe_remove_tmp(fd2, name, stats)
                    elif parsed is not None:
                        key = self._file(fd2, BlockPath(dir1, dir2, name), parsed[0], ticket,
                                         stats, hot_since)  # fmt: skip
                        if key is not None:
                            seen.add(key)
                except OSError as e:
                    # One bad entry must not stop every pass at the same place; its key (if
                    # any) is kept as it is.
                    logger.warning("fs tier scan: cannot examine %s/%s/%s: %s", dir1, dir2, name, e)
                    stats.errors += 1
                    if parsed is not None and parsed[0] is not None:
                        seen.add(parsed[0])
            for key in index.keys_in_bucket(dir1, dir2):
                if key not in seen and not index.observe(
                    key, None, ticket, hot=False, from_walk=True
                ):
                    stats.forgotten += 1
            return len(names) + 1
        finally:
            os.close(fd2)

    def _file(
        self,
        fd2: int,
        path: BlockPath,
        key: OffloadKey | None,
        ticket: int,
        stats: ScanStats,
        hot_since: float | None,
    ) -> OffloadKey | None:
        """Examine one well-named file; returns its key if it still exists (indexed or not)."""
        files = self._files
        name = path.name
        try:
            st = os.stat(name, dir_fd=fd2, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                return key
            if st.st_size != files.file_size:
                if key is not None:
                    if self._remover.remove_wrong_size(fd2, key, path, st):
                        stats.invalid_removed += 1
                    return None
                raise BlockFileCorrupt(
                    f"{st.st_size} bytes instead of {files.file_size}", (st.st_dev, st.st_ino)
                )
            if key is None:
                key = OffloadKey(
                    read_header_key(
                        fd2, name, run_digest=files.mapper.run_digest, payload_len=files.row_bytes
                    )
                )
                if FileMapper.block_path(key) != path:
                    return None  # a valid file in the wrong place: not ours to judge
        except FileNotFoundError:
            return None
        except BlockFileCorrupt as e:
            self._remove_unreadable(fd2, path, e, stats)
            return None
        except OSError as e:
            logger.warning("fs tier scan: cannot examine %s: %s", path.rel, e)
            stats.errors += 1
            return key
        if files.slots is not None and st.st_nlink <= 1:
            try:
                adopted = files.slots.adopt(fd2, name, st)
            except OSError as e:
                logger.warning("fs tier scan: cannot give %s a slot: %s", path.rel, e)
                stats.errors += 1
                return key
            if adopted:
                stats.adopted += 1
            else:
                # No slot is free for it: it is beyond the bound (written without max_bytes, or
                # found at start above a lowered one).
                file_id = (st.st_dev, st.st_ino)
                if self._remover.remove(key, path, file_id, "blocks_evicted", leaf_fd=fd2):
                    stats.unslotted_removed += 1
                return None
        # Only a file new to this instance is placed by its age; a known one keeps its rank.
        hot = hot_since is not None and st.st_mtime >= hot_since and key not in files.index
        if files.index.observe(key, st.st_size, ticket, hot=hot, from_walk=True):
            stats.blocks += 1
            stats.bytes += st.st_size
        return key

    def _remove_unreadable(
        self, fd2: int, path: BlockPath, e: BlockFileCorrupt, stats: ScanStats
    ) -> None:
        logger.warning("fs tier scan: removing invalid %s: %s", path.rel, e)
        # Only the inode found corrupt: a writer may have renamed a good file over it since.
        try:
            removed = unlink_block(fd2, path.name, e.file_id)
        except OSError as unlink_error:
            logger.warning("fs tier scan: cannot remove %s: %s", path.rel, unlink_error)
            stats.errors += 1
            return
        if removed is None:
            return
        stats.invalid_removed += 1
        self._files.counters.incr("corrupt_removed")
        slots = self._files.slots
        if slots is not None:
            with contextlib.suppress(OSError):  # else garbage, freed by a later slot walk
                slots.release_inode(removed.st_ino)

    def _maybe_remove_tmp(self, dir_fd: int, name: str, stats: ScanStats) -> None:
        """Delete ``name`` if it is a leftover temporary file (``is_stale_tmp``); one that held a
        capacity slot (a dead writer's claim) frees it too, so one pass undoes the claim."""
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or not is_stale_tmp(
            name, time.time() - st.st_mtime, self._stale_tmp_age_s
        ):
            return
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        stats.tmp_removed += 1
        slots = self._files.slots
        if slots is not None and st.st_nlink > 1:
            n = slots.slot_of(st.st_ino)  # learnt by this pass's slot walk
            if n is not None and slots.release(n, None):
                stats.slots.reclaimed += 1

    def _forget_if_gone(self, dir1: str, dir2: str | None, stats: ScanStats) -> None:
        """Indexed keys live under ``dir1/dir2`` (``dir2`` None: anywhere under ``dir1``) but
        the listing lacked it: forget them if it is really gone (removed by someone), not just
        created after the listing."""
        rel = dir1 if dir2 is None else f"{dir1}/{dir2}"
        index = self._files.index
        ticket = index.ticket()
        try:
            st = os.stat(rel, dir_fd=self._files.rank_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                return  # created after the listing: the next pass reads it
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError:
            return
        inners = [dir2] if dir2 is not None else index.inner_buckets(dir1)
        for inner in inners:
            for key in index.keys_in_bucket(dir1, inner):
                if not index.observe(key, None, ticket, hot=False, from_walk=True):
                    stats.forgotten += 1
