# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Creating or joining a shared region file: the publish protocol and its locking.

* The creator builds the whole file under a temporary name, sizes it, writes the trailer and its
  own join mark, and only then ``link`` s it to the region's name. Joiners therefore never see a
  half-made file, and whoever links first is the creator.
* Each participant (the scheduler side, if ``expect_scheduler``, and every worker rank) marks its
  byte when it joins. The one that completes the set unlinks the name: from then on the file
  lives only as long as some participant holds it open or mapped, so even ``SIGKILL`` of every
  process leaves nothing behind.
* Before joining or creating, every process sweeps the directory (``sweep``).
* A joiner that still finds a region of a dead creator (it died after the sweep), a region of
  another geometry, a file that is not a region of this format, or its own participant slot
  already taken gets a ``SharedRegionError`` and never maps it.

Join marks are read and written only under an exclusive ``flock`` of the file; the kernel drops
the lock of a dead holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time

from vllm.logger import init_logger
from vllm.v1.kv_offload.cpu.shared_region.files import names_file, temp_path, unlink_if_names
from vllm.v1.kv_offload.cpu.shared_region.process_identity import current_identity, process_is_alive
from vllm.v1.kv_offload.cpu.shared_region.sweep import sweep_stale_regions
from vllm.v1.kv_offload.cpu.shared_region.trailer import (
    FORMAT_VERSION,
    JOINED,
    TRAILER,
    RegionGeometry,
    all_joined,
    pack_trailer,
    read_trailer,
)

logger = init_logger(__name__)

_RETRY_INTERVAL_S = 0.005


class SharedRegionError(ValueError):
    """A region file cannot be joined: stale (its creator is dead), foreign, or mismatched.

    Nothing was mapped; the file was left alone unless the message says it was removed.
    """


def open_region(
    path: str,
    directory: str,
    geometry: RegionGeometry,
    rank: int | None,
    join_timeout_s: float,
) -> tuple[int, bool]:
    """Create or join the region file ``path`` in ``directory`` as participant ``rank`` (None:
    the scheduler side).

    Returns:
        ``(fd, is_creator)``: a read-write descriptor of the file (unlocked), and whether this
        process published it.

    Raises:
        SharedRegionError, OSError, TimeoutError: see ``SharedOffloadRegion``.
    """
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT,
            f"shared region directory {directory!r} does not exist or is not a directory",
        )
    sweep_stale_regions(directory)
    deadline = time.monotonic() + join_timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            created = _create(path, directory, geometry, rank)
            if created is not None:
                return created, True
            # Another process published the region first: join it.
        else:
            try:
                joined = _join(fd, path, geometry, rank)
            except BaseException:
                os.close(fd)
                raise
            if joined:
                return fd, False
            # The name was removed while we opened it (a creator that gave up): start over.
            os.close(fd)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"timed out after {join_timeout_s} s trying to create or join shared region "
                f"{path!r}: it kept vanishing (a creator failing over and over?)"
            )
        # Another process is mid-way through publishing or removing the name: no event to
        # wait on across processes, so retry shortly.
        time.sleep(_RETRY_INTERVAL_S)


def _create(path: str, directory: str, geometry: RegionGeometry, rank: int | None) -> int | None:
    """Build the region under a temporary name and publish it; its descriptor, or None if
    another process published one first (nothing of ours is left then)."""
    me = current_identity()
    tmp_path = temp_path(directory, me)
    fd = os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        st = os.statvfs(directory)
        available = st.f_bavail * st.f_frsize
        if available < geometry.file_bytes:
            raise OSError(
                errno.ENOSPC,
                f"not enough free space in {directory!r} for shared region {path!r}: needed "
                f"{geometry.file_bytes} bytes, available {available} bytes",
            )
        os.ftruncate(fd, geometry.file_bytes)
        os.pwrite(fd, pack_trailer(geometry, me), geometry.file_bytes - TRAILER.size)
        os.pwrite(fd, JOINED, geometry.mark_offset(rank))
        try:
            os.link(tmp_path, path)
        except FileExistsError:
            os.close(fd)
            return None
        except FileNotFoundError:
            # A sweeper that cannot see us (another pid namespace) took our temporary file.
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            _unlink_name_if_complete(fd, path, geometry)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    except BaseException:
        # Published but unusable: take the name back (as cleanup() of a creator would).
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
            unlink_if_names(path, os.fstat(fd))
        os.close(fd)
        raise
    return fd


def _join(fd: int, path: str, geometry: RegionGeometry, rank: int | None) -> bool:
    """Validate the region ``fd`` and mark participant ``rank`` in it; False if its name was
    removed meanwhile (then nothing was marked)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise SharedRegionError(f"shared region {path!r} is not a regular file")
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if not names_file(path, st):
            return False
        trailer = read_trailer(fd, st.st_size)
        if trailer is None:
            raise SharedRegionError(
                f"{path!r} is not a shared region of this version (no valid trailer): a file of "
                "an older version or of another program; remove it or use another instance id"
            )
        if trailer.version != FORMAT_VERSION:
            raise SharedRegionError(
                f"shared region {path!r} has format version {trailer.version}, this process "
                f"speaks {FORMAT_VERSION}: remove it or use another instance id"
            )
        g = geometry
        theirs = (trailer.num_blocks, trailer.row_bytes, trailer.worker_page_bytes)
        ours = (g.num_blocks, g.row_bytes, g.worker_page_bytes)
        if theirs != ours or trailer.num_workers != g.num_workers or st.st_size != g.file_bytes:
            raise SharedRegionError(
                f"shared region {path!r} was made for num_blocks={trailer.num_blocks}, "
                f"row_bytes={trailer.row_bytes}, worker_page_bytes={trailer.worker_page_bytes}, "
                f"num_workers={trailer.num_workers} ({st.st_size} bytes) but this process needs "
                f"num_blocks={g.num_blocks}, row_bytes={g.row_bytes}, "
                f"worker_page_bytes={g.worker_page_bytes}, num_workers={g.num_workers} "
                f"({g.file_bytes} bytes): another engine's region under the same instance id"
            )
        if trailer.expect_scheduler != g.expect_scheduler:
            raise SharedRegionError(
                f"shared region {path!r} was made with expect_scheduler="
                f"{trailer.expect_scheduler}, this process passes {g.expect_scheduler}: every "
                "participant must agree"
            )
        creator = trailer.creator
        if process_is_alive(creator) is False:
            unlink_if_names(path, st)
            raise SharedRegionError(
                f"shared region {path!r} is stale: its creator (pid {creator.pid}, started at "
                f"tick {creator.start_ticks}) is gone, so its engine is gone too; the file was "
                "removed. Restart the engine instance."
            )
        if os.pread(fd, 1, g.mark_offset(rank)) == JOINED:
            who = "the scheduler side" if rank is None else f"worker rank {rank}"
            raise SharedRegionError(
                f"{who} already joined shared region {path!r} (created by pid {creator.pid}): "
                "two processes with the same rank, or an instance id reused while its engine "
                "still runs"
            )
        os.pwrite(fd, JOINED, g.mark_offset(rank))
        _unlink_name_if_complete(fd, path, g)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return True


def _unlink_name_if_complete(fd: int, path: str, geometry: RegionGeometry) -> None:
    """Remove the region's name once every expected participant has joined (holding the file's
    lock): from then on only open descriptors and mappings keep it alive."""
    if all_joined(fd, geometry):
        unlink_if_names(path, os.fstat(fd))
        logger.debug("every participant joined %s: its name is removed", path)
