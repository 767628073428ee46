# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The sweep of shared region files left behind by dead processes.

Before joining or creating a region, every process sweeps the directory: a region file whose
creator is dead (or whose pid now belongs to another process, or which dates from an earlier
boot) and a temporary file of a dead creator are removed. This covers a crash in the short window
before every participant joined (once all joined, the region's name is gone anyway).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat

from vllm.logger import init_logger
from vllm.v1.kv_offload.cpu.shared_region.files import (
    FILE_PREFIX,
    FILE_SUFFIX,
    temp_file_creator,
    unlink_if_names,
)
from vllm.v1.kv_offload.cpu.shared_region.process_identity import process_is_alive
from vllm.v1.kv_offload.cpu.shared_region.trailer import read_trailer

logger = init_logger(__name__)


def _remove_if_stale(path: str) -> bool:
    """Remove region file ``path`` if its trailer names a creator that is certainly dead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone, a symlink, or not ours to read
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live process is joining or removing it right now
        trailer = read_trailer(fd, st.st_size)
        if trailer is None or process_is_alive(trailer.creator) is not False:
            return False  # not a region of ours, or its creator may be alive
        return unlink_if_names(path, st)
    finally:
        os.close(fd)  # also drops the lock


def sweep_stale_regions(directory: str | os.PathLike[str]) -> list[str]:
    """Remove from ``directory`` every region file and temporary file of a dead creator.

    A region file is judged by its trailer's creator identity (pid, start time, pid namespace,
    boot id): it is removed only if that process certainly no longer runs. Files without a valid
    trailer (other programs, older versions), of creators in another pid namespace, or that a
    live process holds locked are left alone. Called by every ``SharedOffloadRegion`` before it
    creates or joins, so a crashed engine's region does not outlive the next start. Best effort:
    errors are logged, never raised.

    Returns:
        The removed paths.
    """
    directory = os.fspath(directory)
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError as e:
        logger.debug("cannot list %s to sweep stale shared regions: %s", directory, e)
        return removed
    for name in names:
        if not name.startswith(FILE_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            creator = temp_file_creator(name)
            if creator is not None:
                # A creator's unpublished file: the name carries its pid and start time.
                if process_is_alive(creator) is False:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        removed.append(path)
            elif name.endswith(FILE_SUFFIX) and _remove_if_stale(path):
                removed.append(path)
        except OSError as e:
            logger.debug("cannot sweep %s: %s", path, e)
    if removed:
        logger.warning(
            "removed %d shared region file(s) of dead processes from %s: %s",
            len(removed),
            directory,
            ", ".join(os.path.basename(p) for p in removed),
        )
    return removed
