"""One host-memory region per engine instance, shared by the scheduler and every worker.

The CPU primary tier keeps offloaded KV blocks in a single file-backed mapping (by default on the
``/dev/shm`` tmpfs) so that the scheduler process, each GPU worker process and the secondary tiers
all address the same bytes without copies.

Layout (``M = num_workers``, ``S = worker_page_bytes``, ``A = BLOCK_SIZE_ALIGNMENT``)::

    row b (b in [0, num_blocks)), row_bytes = round_up(M * S, A) bytes, starting at b * row_bytes
    +-----------------+-----------------+-----+---------------------+-----+
    | worker 0 slot   | worker 1 slot   | ... | worker M-1 slot     | pad |
    | S bytes         | S bytes         |     | S bytes             |     |
    +-----------------+-----------------+-----+---------------------+-----+

    total_bytes = num_blocks * row_bytes (what is mapped), then a metadata area of whole pages:
    +---------------------------------+-----------------------+-------------------+
    | join marks: 1 byte per          | zeros                 | trailer (the last |
    | participant (scheduler, 0..M-1) |                       | _TRAILER.size B)  |
    +---------------------------------+-----------------------+-------------------+

Within a worker's slot, the per-block pages of the worker's KV tensors follow one another in the
order of ``create_next_worker_view`` calls. The trailer holds a magic, the format version, the
geometry, whether the scheduler side takes part, and the creator's identity: pid, start time
(``/proc/<pid>/stat``), pid namespace and boot id, which together survive pid reuse.

Lifetime: nothing of a dead process may stay in the directory (the region is the whole CPU tier,
gigabytes of RAM on a tmpfs that no reboot-less process frees).

* The creator builds the whole file under a temporary name (``vllm_offload_creating-<pid>-
  <start>-<nonce>.tmp``), sizes it, writes the trailer and its own join mark, and only then
  ``link`` s it to the region's name. Joiners therefore never see a half-made file, and whoever
  links first is the creator.
* Each participant (the scheduler side, if ``expect_scheduler``, and every worker rank) marks its
  byte when it joins. The one that completes the set unlinks the name: from then on the file
  lives only as long as some participant holds it open or mapped, so even ``SIGKILL`` of every
  process leaves nothing behind.
* Before joining or creating, every process sweeps the directory: a region file whose creator is
  dead (or whose pid now belongs to another process, or which dates from an earlier boot) and a
  temporary file of a dead creator are removed. This covers a crash in the short window before
  every participant joined.
* A joiner that still finds a region of a dead creator (it died after the sweep), a region of
  another geometry, a file that is not a region of this format, or its own participant slot
  already taken gets a clear error and never maps it.

Ownership and protection:

* Worker ``r`` writes only bytes of its own slot ``[r * S, (r + 1) * S)`` of a row, and only for
  rows the scheduler handed it in a store job. Workers never touch the padding.
* Secondary tiers read or write *whole rows* (every worker's slot of a block at once), and only the
  rows named by a job the scheduler-side manager issued; the manager guarantees that no worker is
  storing into, and no tier is writing, a row that someone else reads or writes at the same time.
* Metadata (join marks) is read and written only under an exclusive ``flock`` of the file, and the
  region's name is only ever unlinked under that lock after checking that it still names the
  same file (so nobody removes a successor's region). The kernel drops the lock of a dead holder.
* The creator also unlinks the name in ``cleanup()`` if it is still there. Unlinking does not
  invalidate mappings still held by peers.
* Nothing locks the rows: the region is plain shared memory and the scheduler's block bookkeeping
  is the only synchronisation.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import operator
import os
import re
import secrets
import stat
import struct
import sys
import time
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import torch
from typing_extensions import Self, override

logger = logging.getLogger(__name__)

_INSTANCE_ID_RE = re.compile(r"[A-Za-z0-9_.-]+")
_FILE_PREFIX = "vllm_offload_"
_FILE_SUFFIX = ".mmap"
_TMP_PREFIX = _FILE_PREFIX + "creating-"
_TMP_SUFFIX = ".tmp"
_TMP_NAME_RE = re.compile(
    re.escape(_TMP_PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+" + re.escape(_TMP_SUFFIX)
)
# Longest name most filesystems accept (NAME_MAX).
_MAX_FILE_NAME = 255
_MAX_INSTANCE_ID_LEN = _MAX_FILE_NAME - len(_FILE_PREFIX) - len(_FILE_SUFFIX)

_MAGIC = b"VLLMKVR\x00"
_FORMAT_VERSION = 1
# magic, version, flags (bit 0: the scheduler side joins), num_workers, num_blocks, row_bytes,
# worker_page_bytes, creator pid, creator start time (clock ticks after boot), creator pid
# namespace (inode), creator boot id, nonce.
_TRAILER = struct.Struct("<8sIIIQQQQQQ16s16s")
_FLAG_EXPECT_SCHEDULER = 1
_JOINED = b"\x01"

_RETRY_INTERVAL_S = 0.005

# MADV_POPULATE_WRITE (Linux >= 5.14) faults pages in writable without writing to them, so it is
# race-free against peers that already store into the region. Older Pythons do not expose the
# constant, hence the literal (the Linux UAPI value).
_MADV_POPULATE_WRITE: int | None = getattr(
    mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None
)
# Rows touched per vectorised chunk by the fallback pre-fault (bounds its temporary memory).
_PREFAULT_CHUNK_ELEMS = 1 << 20


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _positive_int(name: str, value: int) -> int:
    """Return ``value`` as an int if it is an integer (not a bool) > 0, else raise ValueError."""
    if not isinstance(value, bool):
        try:
            as_int = operator.index(value)
        except TypeError:
            pass
        else:
            if as_int > 0:
                return as_int
    raise ValueError(f"{name} must be an integer > 0, got {value!r}")


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a process is, in a way that survives pid reuse and reboots.

    Attributes:
        pid: the process id (in ``pidns``).
        start_ticks: its start time in clock ticks after boot (``/proc/<pid>/stat`` field 22);
            0 where ``/proc`` is unavailable.
        pidns: the inode of its pid namespace (``/proc/self/ns/pid``); 0 if unknown.
        boot_id: the kernel's boot id (16 bytes); zeros if unknown.
    """

    pid: int
    start_ticks: int
    pidns: int
    boot_id: bytes


def _read_start_ticks(pid: int) -> tuple[str, int] | None:
    """``(state, start_ticks)`` of process ``pid`` from ``/proc``; None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
    # ")"; state is field 3 and starttime field 22 of the whole line.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _current_identity_uncached() -> ProcessIdentity:
    pid = os.getpid()
    start_ticks = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        found = _read_start_ticks(pid)
        if found is not None:
            start_ticks = found[1]
    pidns = 0
    with contextlib.suppress(OSError):
        pidns = os.stat("/proc/self/ns/pid").st_ino
    boot_id = bytes(16)
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    return ProcessIdentity(pid, start_ticks, pidns, boot_id)


_identity_cache: ProcessIdentity | None = None


def current_identity() -> ProcessIdentity:
    """This process's identity (recomputed after a fork)."""
    global _identity_cache
    identity = _identity_cache
    if identity is None or identity.pid != os.getpid():
        identity = _identity_cache = _current_identity_uncached()
    return identity


def process_is_alive(identity: ProcessIdentity) -> bool | None:
    """Whether the process ``identity`` still runs: True, False, or None when this process
    cannot tell (it lives in another pid namespace, or its ``/proc`` entry is unreadable)."""
    me = current_identity()
    no_boot_id = bytes(16)
    if no_boot_id not in (identity.boot_id, me.boot_id) and identity.boot_id != me.boot_id:
        return False  # from an earlier boot
    if identity.pidns and me.pidns and identity.pidns != me.pidns:
        return None
    if identity.pid <= 0:
        return False
    if not os.path.isdir("/proc/self"):
        # No procfs: only whether the pid exists.
        try:
            os.kill(identity.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        found = _read_start_ticks(identity.pid)
    except (OSError, ValueError, IndexError):
        return None
    if found is None:
        return False
    state, start_ticks = found
    if state in ("Z", "X"):
        return False  # exited, not reaped yet
    # A different start time: the pid now belongs to another process.
    return not identity.start_ticks or start_ticks == identity.start_ticks


def _names_file(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` (not following a symlink) is still the file ``st`` describes."""
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino)


def _unlink_if_names(path: str, st: os.stat_result) -> bool:
    """Unlink ``path`` if it still names the file ``st``; whether it did.

    Callers hold the file's ``flock``, and every removal of a region's name happens under it, so
    nobody can remove the name and publish a successor between the check and the unlink.
    """
    if not _names_file(path, st):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


_TrailerInfo = tuple[int, int, int, int, int, int, ProcessIdentity]


def _read_trailer(fd: int, size: int) -> _TrailerInfo | None:
    """``(version, flags, num_workers, num_blocks, row_bytes, worker_page_bytes, creator)`` from
    the trailer of the file ``fd`` of ``size`` bytes; None if it has no valid trailer."""
    if size < _TRAILER.size:
        return None
    data = os.pread(fd, _TRAILER.size, size - _TRAILER.size)
    if len(data) != _TRAILER.size:
        return None
    (
        magic,
        version,
        flags,
        num_workers,
        num_blocks,
        row_bytes,
        worker_page_bytes,
        pid,
        start_ticks,
        pidns,
        boot_id,
        _nonce,
    ) = _TRAILER.unpack(data)
    if magic != _MAGIC:
        return None
    creator = ProcessIdentity(pid, start_ticks, pidns, boot_id)
    return version, flags, num_workers, num_blocks, row_bytes, worker_page_bytes, creator


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
        info = _read_trailer(fd, st.st_size)
        if info is None or process_is_alive(info[-1]) is not False:
            return False  # not a region of ours, or its creator may be alive
        return _unlink_if_names(path, st)
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
        if not name.startswith(_FILE_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            match = _TMP_NAME_RE.fullmatch(name)
            if match is not None:
                # A creator's unpublished file: the name carries its pid and start time.
                creator = ProcessIdentity(int(match[1]), int(match[2]), 0, bytes(16))
                if process_is_alive(creator) is False:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        removed.append(path)
            elif name.endswith(_FILE_SUFFIX) and _remove_if_stale(path):
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


class SharedRegionError(ValueError):
    """A region file cannot be joined: stale (its creator is dead), foreign, or mismatched.

    Nothing was mapped; the file was left alone unless the message says it was removed.
    """


class SharedOffloadRegion:
    """A ``MAP_SHARED`` file mapping holding ``num_blocks`` rows of offloaded KV data.

    Every process of an engine instance constructs one over the same file: the scheduler with
    ``rank=None`` (if ``expect_scheduler``) and each worker with its rank. Whoever publishes the
    file first is the creator; the others join it. Once every participant joined, the file's
    name is removed (see the module docstring), so the region's memory is freed when the last
    participant unmaps it, however the processes end.

    Args:
        instance_id: engine-instance id (unique per DP replica); only ``[A-Za-z0-9_.-]`` so the
            file name cannot leave ``directory``.
        num_blocks: number of rows (offloaded blocks), > 0.
        worker_page_bytes: bytes of one worker's slot in a row, > 0.
        num_workers: number of worker slots per row (the TP/PP world size), > 0.
        rank: the worker's rank in ``[0, num_workers)``, or None for the scheduler side.
        directory: where the backing file lives; a tmpfs such as ``/dev/shm`` keeps it in RAM.
        join_timeout_s: how long to keep retrying when the file vanishes under a joiner (its
            creator gave up) before giving up too.
        expect_scheduler: whether the scheduler side (``rank=None``) maps the region too, besides
            every worker rank; the same for every participant (it is recorded by the creator and
            checked by joiners). The name is removed once all expected participants joined.
        prefault: fault the pages in up front (a worker its own slot of every row, the scheduler
            the whole region) so the first transfers do not pay for page faults.

    Raises:
        ValueError: invalid arguments.
        SharedRegionError: the file under the region's name belongs to a dead creator, was made
            for another geometry or participant set, is not a region of this format, or already
            has a participant of this rank.
        OSError: the directory lacks free space (``ENOSPC``) or any system call failed.
        TimeoutError: the file kept vanishing under this joiner for ``join_timeout_s``.

    Not thread-safe: one owner per object. Code that registered ``base_ptr`` with the CUDA driver
    (``cudaHostRegister``) must unregister it before calling ``cleanup()``.
    """

    BLOCK_SIZE_ALIGNMENT: int = mmap.PAGESIZE
    """Rows are padded to a multiple of the page size, keeping O_DIRECT tier I/O aligned."""

    def __init__(
        self,
        instance_id: str,
        num_blocks: int,
        worker_page_bytes: int,
        num_workers: int = 1,
        rank: int | None = None,
        directory: str | os.PathLike[str] = "/dev/shm",
        join_timeout_s: float = 30.0,
        *,
        expect_scheduler: bool = True,
        prefault: bool = True,
    ) -> None:
        # Set first so cleanup()/__del__ work whatever fails below.
        self._fd: int | None = None
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._memoryviews: list[memoryview] = []
        self._is_creator = False
        self._closed = False
        self._owner_pid = os.getpid()
        self._worker_offset = 0
        self._base_ptr = 0
        self._path = ""

        num_blocks = _positive_int("num_blocks", num_blocks)
        worker_page_bytes = _positive_int("worker_page_bytes", worker_page_bytes)
        num_workers = _positive_int("num_workers", num_workers)
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_workers:
                raise ValueError(
                    f"rank must be None or an integer in [0, {num_workers}), got {rank!r}"
                )
            rank = int(rank)
        if not join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be > 0, got {join_timeout_s!r}")
        if rank is None and not expect_scheduler:
            raise ValueError("the scheduler side (rank=None) needs expect_scheduler=True")

        self._path = self.region_path(instance_id, directory)
        self._directory = os.fspath(directory)
        self._num_blocks = num_blocks
        self._worker_page_bytes = worker_page_bytes
        self._num_workers = num_workers
        self._rank = rank
        self._row_bytes = _round_up(num_workers * worker_page_bytes, self.BLOCK_SIZE_ALIGNMENT)
        self._total_bytes = num_blocks * self._row_bytes
        self._expect_scheduler = bool(expect_scheduler)
        # Join marks (one byte per participant: the scheduler, then ranks 0..M-1) and the trailer.
        self._meta_bytes = _round_up(num_workers + 1 + _TRAILER.size, self.BLOCK_SIZE_ALIGNMENT)
        self._file_bytes = self._total_bytes + self._meta_bytes

        try:
            self._open(join_timeout_s)
            assert self._fd is not None
            self._mm = mmap.mmap(
                self._fd,
                self._total_bytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
            if prefault:
                self._prefault()
            # The base tensor keeps a reference to the mmap object, so the mapping outlives any
            # view handed out even if the caller keeps one past cleanup().
            self._base = torch.frombuffer(self._mm, dtype=torch.int8)
            self._base_ptr = self._base.data_ptr()
        except BaseException:
            self.cleanup()
            raise

    # -----------------------------------------------------------------------------------------
    # Creation / joining
    # -----------------------------------------------------------------------------------------

    @staticmethod
    def region_path(instance_id: str, directory: str | os.PathLike[str] = "/dev/shm") -> str:
        """Return the backing-file path of ``instance_id`` in ``directory``.

        Raises:
            ValueError: ``instance_id`` is empty, too long, or has a character outside
                ``[A-Za-z0-9_.-]``.
        """
        if not isinstance(instance_id, str) or not _INSTANCE_ID_RE.fullmatch(instance_id):
            raise ValueError(
                f"instance_id={instance_id!r} is invalid: expected a non-empty string of "
                "[A-Za-z0-9_.-] characters"
            )
        if len(instance_id) > _MAX_INSTANCE_ID_LEN:
            raise ValueError(
                f"instance_id={instance_id!r} is too long: at most {_MAX_INSTANCE_ID_LEN} "
                "characters"
            )
        return os.path.join(os.fspath(directory), f"{_FILE_PREFIX}{instance_id}{_FILE_SUFFIX}")

    def _open(self, join_timeout_s: float) -> None:
        if not os.path.isdir(self._directory):
            raise FileNotFoundError(
                errno.ENOENT,
                f"shared region directory {self._directory!r} does not exist or is not a directory",
            )
        sweep_stale_regions(self._directory)
        deadline = time.monotonic() + join_timeout_s
        while True:
            try:
                fd = os.open(self._path, os.O_RDWR | os.O_NOFOLLOW)
            except FileNotFoundError:
                if self._create():
                    return
                # Another process published the region first: join it.
            else:
                try:
                    joined = self._join(fd)
                except BaseException:
                    os.close(fd)
                    raise
                if joined:
                    self._fd = fd
                    return
                # The name was removed while we opened it (a creator that gave up): start over.
                os.close(fd)
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"timed out after {join_timeout_s} s trying to create or join shared region "
                    f"{self._path!r}: it kept vanishing (a creator failing over and over?)"
                )
            # Another process is mid-way through publishing or removing the name: no event to
            # wait on across processes, so retry shortly.
            time.sleep(_RETRY_INTERVAL_S)

    def _slot(self) -> int:
        """This participant's join-mark index: 0 for the scheduler, 1 + rank for a worker."""
        return 0 if self._rank is None else 1 + self._rank

    def _trailer(self) -> bytes:
        me = current_identity()
        return _TRAILER.pack(
            _MAGIC,
            _FORMAT_VERSION,
            _FLAG_EXPECT_SCHEDULER if self._expect_scheduler else 0,
            self._num_workers,
            self._num_blocks,
            self._row_bytes,
            self._worker_page_bytes,
            me.pid,
            me.start_ticks,
            me.pidns,
            me.boot_id,
            secrets.token_bytes(16),
        )

    def _create(self) -> bool:
        """Build the region under a temporary name and publish it; False if another process
        published one first (nothing of ours is left then)."""
        me = current_identity()
        tmp_path = os.path.join(
            self._directory,
            f"{_TMP_PREFIX}{me.pid}-{me.start_ticks}-{secrets.token_hex(8)}{_TMP_SUFFIX}",
        )
        fd = os.open(tmp_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            st = os.statvfs(self._directory)
            available = st.f_bavail * st.f_frsize
            if available < self._file_bytes:
                raise OSError(
                    errno.ENOSPC,
                    f"not enough free space in {self._directory!r} for shared region "
                    f"{self._path!r}: needed {self._file_bytes} bytes, available {available} "
                    "bytes",
                )
            os.ftruncate(fd, self._file_bytes)
            os.pwrite(fd, self._trailer(), self._file_bytes - _TRAILER.size)
            os.pwrite(fd, _JOINED, self._total_bytes + self._slot())
            try:
                os.link(tmp_path, self._path)
            except FileExistsError:
                os.close(fd)
                return False
            except FileNotFoundError:
                # A sweeper that cannot see us (another pid namespace) took our temporary file.
                os.close(fd)
                return False
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp_path)
        self._fd = fd
        self._is_creator = True
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            self._unlink_name_if_complete(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def _join(self, fd: int) -> bool:
        """Validate the region ``fd`` and mark this participant in it; False if its name was
        removed meanwhile (then nothing was marked)."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SharedRegionError(f"shared region {self._path!r} is not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            if not _names_file(self._path, st):
                return False
            info = _read_trailer(fd, st.st_size)
            if info is None:
                raise SharedRegionError(
                    f"{self._path!r} is not a shared region of this version (no valid trailer): "
                    "a file of an older version or of another program; remove it or use another "
                    "instance id"
                )
            version, flags, num_workers, num_blocks, row_bytes, worker_page_bytes, creator = info
            if version != _FORMAT_VERSION:
                raise SharedRegionError(
                    f"shared region {self._path!r} has format version {version}, this process "
                    f"speaks {_FORMAT_VERSION}: remove it or use another instance id"
                )
            theirs = (num_blocks, row_bytes, worker_page_bytes, num_workers)
            ours = (self._num_blocks, self._row_bytes, self._worker_page_bytes, self._num_workers)
            if theirs != ours or st.st_size != self._file_bytes:
                raise SharedRegionError(
                    f"shared region {self._path!r} was made for num_blocks={num_blocks}, "
                    f"row_bytes={row_bytes}, worker_page_bytes={worker_page_bytes}, "
                    f"num_workers={num_workers} ({st.st_size} bytes) but this process needs "
                    f"num_blocks={self._num_blocks}, row_bytes={self._row_bytes}, "
                    f"worker_page_bytes={self._worker_page_bytes}, "
                    f"num_workers={self._num_workers} ({self._file_bytes} bytes): another "
                    "engine's region under the same instance id"
                )
            if bool(flags & _FLAG_EXPECT_SCHEDULER) != self._expect_scheduler:
                raise SharedRegionError(
                    f"shared region {self._path!r} was made with expect_scheduler="
                    f"{bool(flags & _FLAG_EXPECT_SCHEDULER)}, this process passes "
                    f"{self._expect_scheduler}: every participant must agree"
                )
            alive = process_is_alive(creator)
            if alive is False:
                _unlink_if_names(self._path, st)
                raise SharedRegionError(
                    f"shared region {self._path!r} is stale: its creator (pid {creator.pid}, "
                    f"started at tick {creator.start_ticks}) is gone, so its engine is gone "
                    "too; the file was removed. Restart the engine instance."
                )
            slot = self._slot()
            mark = os.pread(fd, 1, self._total_bytes + slot)
            if mark == _JOINED:
                who = "the scheduler side" if self._rank is None else f"worker rank {self._rank}"
                raise SharedRegionError(
                    f"{who} already joined shared region {self._path!r} (created by pid "
                    f"{creator.pid}): two processes with the same rank, or an instance id "
                    "reused while its engine still runs"
                )
            os.pwrite(fd, _JOINED, self._total_bytes + slot)
            self._unlink_name_if_complete(fd)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def _unlink_name_if_complete(self, fd: int) -> None:
        """Remove the region's name once every expected participant has joined (holding the
        file's lock): from then on only open descriptors and mappings keep it alive."""
        marks = os.pread(fd, self._num_workers + 1, self._total_bytes)
        expected = marks if self._expect_scheduler else marks[1:]
        if expected.count(_JOINED) == len(expected):
            _unlink_if_names(self._path, os.fstat(fd))
            logger.debug("every participant joined %s: its name is removed", self._path)

    # -----------------------------------------------------------------------------------------
    # Pre-faulting
    # -----------------------------------------------------------------------------------------

    def _prefault(self) -> None:
        """Fault in the pages this process will touch, preserving every byte already written."""
        assert self._mm is not None
        page = self.BLOCK_SIZE_ALIGNMENT
        if self._rank is None:
            # Whole rows: one contiguous range.
            row_lo, row_hi = 0, self._row_bytes
        else:
            slot_lo = self._rank * self._worker_page_bytes
            row_lo = slot_lo // page * page
            row_hi = _round_up(slot_lo + self._worker_page_bytes, page)
        if self._madvise_populate(row_lo, row_hi):
            return
        self._touch_pages()

    def _madvise_populate(self, row_lo: int, row_hi: int) -> bool:
        """Populate ``[row_lo, row_hi)`` of every row (page-aligned); False if unsupported.

        Other failures (e.g. the tmpfs cannot back the pages) raise: the fallback would instead
        die of SIGBUS on the first touch of a page that cannot be allocated.
        """
        assert self._mm is not None
        if _MADV_POPULATE_WRITE is None or not hasattr(self._mm, "madvise"):
            return False
        if row_lo == 0 and row_hi == self._row_bytes:
            ranges = [(0, self._total_bytes)]
        else:
            ranges = [
                (b * self._row_bytes + row_lo, row_hi - row_lo) for b in range(self._num_blocks)
            ]
        for start, length in ranges:
            try:
                self._mm.madvise(_MADV_POPULATE_WRITE, start, length)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    logger.debug("MADV_POPULATE_WRITE unsupported (%s); touching pages", e)
                    return False
                raise OSError(
                    e.errno,
                    f"could not pre-fault shared region {self._path!r} "
                    f"({self._total_bytes} bytes): {e.strerror}; is {self._directory!r} full?",
                ) from e
        return True

    def _touch_pages(self) -> None:
        """Fallback pre-fault: touch one byte of each page this process uses.

        A worker rewrites (read-modify-write with the same value) one byte *of its own slot* per
        page, so it can never clobber a byte a peer writes concurrently. The scheduler only reads
        one byte per page: that allocates the page without any write, so it cannot race with
        workers already storing; the remaining write fault later is a cheap permission upgrade.
        """
        assert self._mm is not None
        page = self.BLOCK_SIZE_ALIGNMENT
        if self._rank is None:
            in_row = np.arange(0, self._row_bytes, page, dtype=np.int64)
        else:
            slot_lo = self._rank * self._worker_page_bytes
            slot_hi = slot_lo + self._worker_page_bytes
            # Rows start page-aligned, so the offsets within a row are the same for every row:
            # the slot's first byte, then the first byte of each later page inside the slot.
            in_row = np.concatenate(
                [
                    np.array([slot_lo], dtype=np.int64),
                    np.arange(_round_up(slot_lo + 1, page), slot_hi, page, dtype=np.int64),
                ]
            )
        arr = np.frombuffer(self._mm, dtype=np.uint8)
        try:
            rows_per_chunk = max(1, _PREFAULT_CHUNK_ELEMS // len(in_row))
            for first in range(0, self._num_blocks, rows_per_chunk):
                rows = np.arange(
                    first, min(first + rows_per_chunk, self._num_blocks), dtype=np.int64
                )
                idx = (rows[:, None] * self._row_bytes + in_row[None, :]).ravel()
                if self._rank is None:
                    arr.take(idx)  # the gather reads, hence faults in, every page
                else:
                    arr[idx] = arr[idx]
        finally:
            del arr

    # -----------------------------------------------------------------------------------------
    # Views
    # -----------------------------------------------------------------------------------------

    def _require_open(self) -> mmap.mmap:
        if self._mm is None or self._closed:
            raise RuntimeError(f"shared region {self._path!r} is closed")
        return self._mm

    def create_kv_memoryview(self) -> memoryview:
        """Return a zero-copy byte view of the whole region, one row per block.

        Layout: format ``"B"``, shape ``(num_blocks, row_bytes)``, C-contiguous; row ``b`` holds
        every worker's slot of block ``b`` followed by padding. For the scheduler side and
        secondary tiers, which move whole rows named by their jobs.

        The view is released by ``cleanup()``; using it afterwards raises ``ValueError``.
        """
        mm = self._require_open()
        flat = memoryview(mm)
        view = flat.cast("B", (self._num_blocks, self._row_bytes))
        self._memoryviews += [view, flat]
        return view

    def create_next_worker_view(self, tensor_page_bytes: int) -> torch.Tensor:
        """Return the next per-block page view inside this worker's slot.

        Layout: ``int8`` tensor of shape ``(num_blocks, tensor_page_bytes)``, stride
        ``(row_bytes, 1)`` and storage offset ``rank * worker_page_bytes + o``, where ``o`` is
        the sum of the ``tensor_page_bytes`` of earlier calls. ``int8`` makes strides and offsets
        byte counts, so callers need no dtype arithmetic. Only this worker may write these bytes.

        Raises:
            ValueError: ``tensor_page_bytes`` is not > 0, or the view would overrun the slot.
            RuntimeError: called on the scheduler side (``rank is None``) or after ``cleanup()``.
        """
        self._require_open()
        if self._rank is None:
            raise RuntimeError("create_next_worker_view needs a worker region (rank is None)")
        tensor_page_bytes = _positive_int("tensor_page_bytes", tensor_page_bytes)
        end = self._worker_offset + tensor_page_bytes
        if end > self._worker_page_bytes:
            raise ValueError(
                f"tensor_page_bytes={tensor_page_bytes} at offset {self._worker_offset} overruns "
                f"worker {self._rank}'s slot of {self._worker_page_bytes} bytes "
                f"({self._worker_page_bytes - self._worker_offset} bytes left)"
            )
        assert self._base is not None
        view = torch.as_strided(
            self._base,
            (self._num_blocks, tensor_page_bytes),
            (self._row_bytes, 1),
            self._rank * self._worker_page_bytes + self._worker_offset,
        )
        self._worker_offset = end
        self._views.append(view)
        return view

    # -----------------------------------------------------------------------------------------
    # Properties
    # -----------------------------------------------------------------------------------------

    @property
    def path(self) -> str:
        """Path of the backing file."""
        return self._path

    @property
    def num_blocks(self) -> int:
        """Number of rows (offloaded blocks)."""
        return self._num_blocks

    @property
    def row_bytes(self) -> int:
        """Bytes per row: ``round_up(num_workers * worker_page_bytes, BLOCK_SIZE_ALIGNMENT)``."""
        return self._row_bytes

    @property
    def worker_page_bytes(self) -> int:
        """Bytes of one worker's slot in a row."""
        return self._worker_page_bytes

    @property
    def num_workers(self) -> int:
        """Number of worker slots per row."""
        return self._num_workers

    @property
    def rank(self) -> int | None:
        """This worker's rank, or None on the scheduler side."""
        return self._rank

    @property
    def total_bytes(self) -> int:
        """Size of the mapping: ``num_blocks * row_bytes``."""
        return self._total_bytes

    @property
    def file_bytes(self) -> int:
        """Size of the backing file: ``total_bytes`` plus the metadata pages (not mapped)."""
        return self._file_bytes

    @property
    def expect_scheduler(self) -> bool:
        """Whether the scheduler side is one of the region's participants."""
        return self._expect_scheduler

    @property
    def is_creator(self) -> bool:
        """Whether this object created (and so will unlink) the backing file."""
        return self._is_creator

    @property
    def base_ptr(self) -> int:
        """Virtual address of the mapping in this process (e.g. for ``cudaHostRegister``)."""
        self._require_open()
        return self._base_ptr

    @property
    def closed(self) -> bool:
        """Whether ``cleanup()`` ran."""
        return self._closed

    # -----------------------------------------------------------------------------------------
    # Teardown
    # -----------------------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Release the mapping and the file descriptor; the creator also unlinks the file.

        Idempotent. Views handed out by this object are dropped first. If a caller still holds
        a tensor over the region (torch keeps the mmap object alive through it), the mapping is
        not closed explicitly, which would leave that tensor dangling: it is unmapped when the
        last such reference goes away. Only the creating process unlinks, so a forked child that
        inherits the object cannot remove a file its parent still serves.
        """
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        self._base = None
        for view in self._memoryviews:
            try:
                view.release()
            except BufferError:
                logger.warning(
                    "a buffer exported from a memoryview of %s is still alive; the mapping is "
                    "released when it is",
                    self._path,
                )
        self._memoryviews.clear()
        mm, self._mm = self._mm, None
        if mm is not None:
            # Our local and getrefcount's argument: any other reference is a live tensor storage
            # or memoryview over the mapping, which mm.close() would leave dangling.
            if sys.getrefcount(mm) <= 2:
                mm.close()
            else:
                logger.warning(
                    "tensors over %s are still alive after cleanup(); the mapping is unmapped "
                    "when they are released",
                    self._path,
                )
            del mm
        fd, self._fd = self._fd, None
        if fd is not None:
            if self._is_creator and os.getpid() == self._owner_pid:
                # Under the lock, and only if the name is still ours (it is gone already once
                # every participant joined).
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    _unlink_if_names(self._path, os.fstat(fd))
                except OSError as e:
                    logger.warning("could not remove shared region %s: %s", self._path, e)
            os.close(fd)  # also drops the lock

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()

    def __del__(self) -> None:
        # Safety net only; owners call cleanup(). Must never raise (interpreter shutdown included).
        try:
            if not getattr(self, "_closed", True):
                self.cleanup()
        except Exception:
            pass

    @override
    def __repr__(self) -> str:
        return (
            f"SharedOffloadRegion(path={self._path!r}, num_blocks={self._num_blocks}, "
            f"row_bytes={self._row_bytes}, worker_page_bytes={self._worker_page_bytes}, "
            f"num_workers={self._num_workers}, rank={self._rank}, "
            f"is_creator={self._is_creator}, closed={self._closed})"
        )
