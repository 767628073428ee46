# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Capacity slots: the hard ``max_bytes`` bound of a run directory shared by any number of tiers.

Every instance that shares a root (processes, or hosts on a shared filesystem such as NFS) sees
the others' files only when it reads the directory, so bounding the directory by each
instance's own view lets it grow by whatever the others wrote since (``N x max_bytes`` with N
writers). The bound is instead kept by the filesystem itself, with one atomic primitive:

* ``C = max_bytes // block file size`` slot names, ``slots/<hi>/<lo>`` under the rank directory
  (``hi = n >> 10`` and ``lo = n & 1023`` in hex).
* Every block-file inode a bounded tier creates is hard-linked to one free slot name *before* its
  first payload byte is written (``claim``), and keeps that name until its block name is gone.
  ``link(2)`` fails with EEXIST when the name exists, atomically on local filesystems and on NFS,
  where the server serialises it; it is the lock-file recipe of open(2), which also covers a
  retransmitted NFS request (after an error, a link count of 2 on the source means the link was
  made). No lock (``flock``/``fcntl``) is needed, so none of their NFS caveats apply.
* Hence at most ``C`` block-file inodes hold a slot, i.e. at most ``C x file size <= max_bytes``
  bytes; an inode without a slot exists only while a release is in progress (below), or if it
  was made outside this protocol (a tier without ``max_bytes``, an operator, a slot link lost by
  a power failure), in which case the reconcile adopts or deletes it.
* A slot is released by ``rename(2)``-ing its name to a private temporary name first ("grab"),
  checking that the grabbed inode is the one meant, then unlinking it. The rename is atomic, so
  exactly one releaser gets a given slot name: a releaser working from stale knowledge can grab
  a slot another writer just claimed, but then sees the wrong inode and puts it back; it can
  never silently remove it (which a stat-then-unlink could). Between the grab and the unlink, the
  slot number may be claimed again while the grabbed inode still holds its bytes: the directory
  may then exceed ``max_bytes`` by the files being released at that instant ("in flight").
* A *garbage* slot is one whose inode has no other name (link count 1): its block file was
  replaced by another writer's rename, deleted as corrupt or by an operator, or its writer died
  before publishing and the temporary file was removed. Garbage is reclaimed by the reconcile
  walk (``walk_subdir``) and by a claim that collides with it.

Damage: the slot directories are the tier's own. A name among them that is not a directory (a
regular file or a symlink planted at ``slots/000``, say) would fail every claim of its 1024
slots, i.e. every store of a small cache: the tier replaces it with an empty directory and logs
a WARNING naming the path, at start-up and whenever a store meets it; a slot directory it cannot
use (not writable) makes the tier refuse to start, with its path in the message.

Thread-safety: every method may be called from any thread; the bookkeeping (which slots are
known taken, which inode holds which slot: ``SlotHints``) is a hint guarded by its own lock,
never held across a system call. The filesystem is the truth: a stale hint costs a retry, never
the bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.block_format import BlockFileCorrupt, file_size
from vllm.v1.kv_offload.tiering.fs.block_io import (
    TMP_SUFFIX,
    FileModes,
    is_stale_tmp_file,
    open_block_dir,
    open_dir,
    read_header_key,
    tmp_name,
    unlink_block,
)
from vllm.v1.kv_offload.tiering.fs.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.slot_hints import SlotHints

logger = init_logger(__name__)

SLOTS_DIR = "slots"
"""Name of the slot directory under the rank directory."""
SLOTS_PER_SUBDIR = 1024
_MAX_CACHED_SUBDIRS = 64
"""Slot subdirectories whose descriptors stay open (64 Ki slots); beyond, they are opened per
use, so that a huge ``max_bytes`` does not use up the process's descriptors."""
_MAX_COLLISIONS = 16
"""Slots tried per ``try_claim`` before it reports that none is free (the caller evicts)."""
_BLIND_PROBES = 4
"""Slots believed taken that ``try_claim`` also tries when none is known free: others may have
freed them since the last walk."""
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_NOT_A_DIRECTORY = (errno.ENOTDIR, errno.ELOOP)
"""What opening a name with ``O_DIRECTORY | O_NOFOLLOW`` fails with when it is not a directory
(a file, a fifo: ENOTDIR; a symlink: ELOOP)."""

RemoveBlock = Callable[[OffloadKey, tuple[int, int]], bool]
"""``(key, (st_dev, st_ino)) -> removed``: see ``CapacitySlots.evict_unknown``."""


@dataclass
class SlotWalkStats:
    """What walking slot directories did (cumulative).

    Attributes:
        slots: slot names seen.
        reclaimed: garbage slots released.
        moved: files moved from a slot beyond this tier's capacity to a free one.
        dropped: block files removed because no slot was left for them.
        leftovers: stale grab names of dead releasers recovered.
        doubles: second slot names of one inode released.
        errors: slot names that could not be examined (left alone).
    """

    slots: int = 0
    reclaimed: int = 0
    doubles: int = 0
    errors: int = 0
    moved: int = 0
    dropped: int = 0
    leftovers: int = 0


def slot_location(n: int) -> tuple[str, str]:
    """``(subdir, name)`` of slot ``n`` under ``slots/``."""
    return f"{n // SLOTS_PER_SUBDIR:03x}", f"{n % SLOTS_PER_SUBDIR:03x}"


def parse_slot(subdir: str, name: str) -> int | None:
    """Slot number of ``slots/<subdir>/<name>``, or None if it is not a slot name."""
    if not (3 <= len(subdir) <= 8 and len(name) == 3):
        return None
    try:
        hi, lo = int(subdir, 16), int(name, 16)
    except ValueError:
        return None
    if lo >= SLOTS_PER_SUBDIR or slot_location(hi * SLOTS_PER_SUBDIR + lo) != (subdir, name):
        return None
    return hi * SLOTS_PER_SUBDIR + lo


class CapacitySlots:
    """The slot directory of one run directory, as used by one tier instance.

    Ownership: owns the descriptor of ``slots/`` (``close()``); borrows ``rank_fd``.

    Args:
        rank_fd: the rank directory.
        capacity: slots this instance may claim (``max_bytes // file size``, >= 1).
        writer: this instance's writer id (temporary names).
        mapper: to find a slot's block file from the key in its header.
        payload_len: payload bytes of a block file (to validate headers).
        stale_tmp_age_s: age after which a grab name of a possibly live releaser is recovered.
        rank_dir: the rank directory's path (for messages).
        modes: of the directories it creates.

    Raises:
        OSError: naming the directory, if ``slots/`` or one of its subdirectories below
            ``capacity`` cannot be made a writable directory.
    """

    def __init__(
        self,
        rank_fd: int,
        capacity: int,
        writer: str,
        mapper: FileMapper,
        payload_len: int,
        stale_tmp_age_s: float,
        rank_dir: str,
        modes: FileModes,
    ) -> None:
        assert capacity >= 1, f"capacity={capacity}"
        self._rank_fd = rank_fd
        self._modes = modes
        self._slots_path = os.path.join(rank_dir, SLOTS_DIR)
        self.capacity = capacity
        self._writer = writer
        self._mapper = mapper
        self._payload_len = payload_len
        self._file_size = file_size(payload_len)
        self._stale_tmp_age_s = stale_tmp_age_s
        self._hints = SlotHints(capacity)
        self._remove: RemoveBlock | None = None
        # Descriptors of slots/ and of the subdirectories below ``capacity`` (every store uses
        # them), opened once. A descriptor is closed only by close(): one a repair replaced is
        # kept in ``_retired``, because a thread may still be using it.
        self._dirs_lock = threading.Lock()
        self._retired: list[int] = []
        self._sub_fds: dict[str, int] = {}
        self._num_subdirs = -(-capacity // SLOTS_PER_SUBDIR)
        self._slots_fd = _open_repairing(rank_fd, SLOTS_DIR, self._slots_path, modes)
        try:
            for hi in range(self._num_subdirs):
                sub = f"{hi:03x}"
                fd = _open_repairing(self._slots_fd, sub, self._sub_path(sub), self._modes)
                if hi < _MAX_CACHED_SUBDIRS:
                    self._sub_fds[sub] = fd
                else:
                    os.close(fd)
                if not os.access(sub, os.W_OK | os.X_OK, dir_fd=self._slots_fd):
                    raise OSError(
                        errno.EACCES,
                        f"fs tier: slot directory {self._sub_path(sub)} is not writable: fix "
                        "its permissions or remove it",
                    )
        except BaseException:
            self.close()
            raise

    def bind_remover(self, remove: RemoveBlock) -> None:
        """Remove block files through ``remove`` (the store: index, events, counters) when a
        slot must lose its file; until then they are unlinked directly."""
        self._remove = remove

    def close(self) -> None:
        """Close the slot directories (idempotent)."""
        with self._dirs_lock:
            fds = [self._slots_fd, *self._sub_fds.values(), *self._retired]
            self._slots_fd = -1
            self._sub_fds.clear()
            self._retired.clear()
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -----------------------------------------------------------------------------------------
    # Slot directories
    # -----------------------------------------------------------------------------------------

    def _sub_path(self, sub: str) -> str:
        return os.path.join(self._slots_path, sub)

    def _open_sub(self, sub: str, *, own: bool = False) -> tuple[int, bool]:
        """``(descriptor of slots/<sub>, cached)``; the caller closes one that is not cached.

        Args:
            sub: the subdirectory.
            own: it holds slots below ``capacity``: (re)made a directory if it is not one.

        Raises:
            FileNotFoundError: ``sub`` is not ``own`` and does not exist.
        """
        fd = self._sub_fds.get(sub)
        if fd is not None:
            return fd, True
        if own:
            return _open_repairing(self._slots_fd, sub, self._sub_path(sub), self._modes), False
        return open_dir(sub, self._slots_fd), False

    def _repair(self, sub: str, fd: int) -> bool:
        """A system call in ``slots/<sub>`` (descriptor ``fd``) failed as if the directory were
        gone. If it is (an operator or a tool removed it, or replaced it with a file or a
        symlink), make it a directory again and return True: the caller retries. False if the
        directory is fine (the error meant something else) or is not one of this tier's."""
        with self._dirs_lock:
            current = self._sub_fds.get(sub)
            if current is None:
                return False
            if current != fd:
                return True  # another thread repaired it meanwhile
            if os.fstat(fd).st_nlink > 0:
                return False
            if os.fstat(self._slots_fd).st_nlink == 0:
                logger.warning("fs tier: %s was removed; recreating it", self._slots_path)
                self._retired.append(self._slots_fd)
                self._slots_fd = _open_repairing(
                    self._rank_fd, SLOTS_DIR, self._slots_path, self._modes
                )
            logger.warning("fs tier: %s was removed; recreating it", self._sub_path(sub))
            self._retired.append(fd)
            self._sub_fds[sub] = _open_repairing(
                self._slots_fd, sub, self._sub_path(sub), self._modes
            )
        return True

    # -----------------------------------------------------------------------------------------
    # Bookkeeping (hints)
    # -----------------------------------------------------------------------------------------

    def slot_of(self, ino: int) -> int | None:
        """The slot believed to hold inode ``ino``."""
        return self._hints.slot_of(ino)

    def holds(self, n: int, ino: int) -> bool:
        """Whether slot ``n`` names inode ``ino`` now (one ``stat``).

        Raises:
            OSError: other than the slot being absent.
        """
        sub, slot_name = slot_location(n)
        try:
            st = os.stat(f"{sub}/{slot_name}", dir_fd=self._slots_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return st.st_ino == ino

    # -----------------------------------------------------------------------------------------
    # Claim
    # -----------------------------------------------------------------------------------------

    def try_claim(self, dir_fd: int, name: str, ino: int) -> int | None:
        """Link file ``name`` (inode ``ino``) in ``dir_fd`` to a free slot.

        Tries slots believed free (up to ``_MAX_COLLISIONS`` of them turning out taken), then a
        few believed taken (``_BLIND_PROBES``): others may have freed them since the last walk.
        A taken slot whose inode has no other name (garbage) is reclaimed and tried again.
        ``name`` may have other names (an inode being re-homed): only the slot is added.

        Returns:
            The slot, or None if no free slot was found (the caller evicts and retries).

        Raises:
            OSError: a system-call error other than the slot being taken (the file may or may
                not have been linked: if its caller then unlinks it, the slot is garbage).
        """
        collisions = blind = repairs = 0
        retry: int | None = None
        while True:
            n = retry
            retry = None
            if n is None and collisions < _MAX_COLLISIONS:
                n = self._hints.pick(blind=False)
            if n is None:
                if blind >= _BLIND_PROBES:
                    return None
                blind += 1
                n = self._hints.pick(blind=True)
                assert n is not None
            sub, slot_name = slot_location(n)
            sub_fd, cached = self._open_sub(sub, own=True)  # n < capacity
            try:
                os.link(name, slot_name, src_dir_fd=dir_fd, dst_dir_fd=sub_fd,
                        follow_symlinks=False)  # fmt: skip
            except FileNotFoundError:
                if repairs < 2 and self._repair(sub, sub_fd):
                    repairs += 1
                    retry = n
                    continue
                raise
            except FileExistsError:
                try:
                    held = os.stat(slot_name, dir_fd=sub_fd, follow_symlinks=False)
                except FileNotFoundError:
                    retry = n  # freed meanwhile
                    continue
                # The slot names our inode: on NFS, our retransmitted link was made and only its
                # reply was lost. (Not the link count of the source: an inode being re-homed has
                # other names already.)
                if held.st_ino != ino:
                    collisions += 1
                    if held.st_nlink <= 1 and self.release(n, None):
                        retry = n  # garbage freed: try it at once (another writer may be faster)
                    continue
            finally:
                if not cached:
                    os.close(sub_fd)
            self._hints.note_taken(n, ino)
            return n

    def adopt(self, dir_fd: int, name: str, st: os.stat_result) -> bool:
        """Give an existing slotless block file (``stat`` ``st``) a free slot; never evicts.

        Returns:
            False if no slot is free (the caller removes the file: it is beyond the bound).
        """
        n = self.try_claim(dir_fd, name, st.st_ino)
        if n is None:
            return False
        # The block name may have been replaced since ``st`` (by a slotted file): then we linked
        # that one a second time; undo it.
        sub, slot_name = slot_location(n)
        try:
            linked = os.stat(f"{sub}/{slot_name}", dir_fd=self._slots_fd, follow_symlinks=False)
        except OSError:
            return True
        if linked.st_ino != st.st_ino:
            self.release(n, linked.st_ino)
        return True

    # -----------------------------------------------------------------------------------------
    # Release
    # -----------------------------------------------------------------------------------------

    def release_inode(self, ino: int) -> bool:
        """Release the slot believed to hold inode ``ino`` (after its block name was removed).

        An unknown slot stays (garbage, reclaimed by the walk). Returns whether one was freed.
        """
        n = self.slot_of(ino)
        return n is not None and self.release(n, ino)

    def release(self, n: int, ino: int | None) -> bool:
        """Free slot ``n`` if it holds inode ``ino`` (``None``: if its inode has no other name).

        Returns:
            True if this call removed the slot name; False if it was already free, or holds
            another (live) inode, which is left in place (or moved to another free slot if the
            slot number was claimed again meanwhile).
        """
        sub, slot_name = slot_location(n)
        try:
            sub_fd, cached = self._open_sub(sub)
        except FileNotFoundError:
            self._hints.note_free(n)
            return False
        try:
            # Look before grabbing: stale knowledge (an inode number the filesystem reused, a
            # slot freed and claimed again since) must not even briefly take a live slot away.
            st = self._stat_slot(sub_fd, slot_name, n)
            if st is None:
                return False
            if (st.st_ino != ino) if ino is not None else (st.st_nlink > 1):
                if ino is not None:
                    self._hints.note_taken(n, st.st_ino, seq=self._hints.seq())
                return False
            grab = self._grab_slot(sub_fd, slot_name, n)
            if grab is None:
                return False
            # From here on this call alone holds the grabbed inode's slot name. It is almost
            # always the inode just looked at; if not (freed and claimed again in between), the
            # check below puts it back.
            return self._settle_grab(sub_fd, grab, n, ino)
        finally:
            if not cached:
                os.close(sub_fd)

    def _stat_slot(self, sub_fd: int, slot_name: str, n: int) -> os.stat_result | None:
        """``lstat`` of slot ``n``'s name; None, noted free, if it has none."""
        try:
            return os.stat(slot_name, dir_fd=sub_fd, follow_symlinks=False)
        except FileNotFoundError:
            self._hints.note_free(n)
            return None

    def _grab_slot(self, sub_fd: int, slot_name: str, n: int) -> str | None:
        """Rename slot ``n``'s name to a fresh grab name, returned; None, noted free, if it has
        none (someone else freed it)."""
        grab = tmp_name(f"g{n:x}", self._writer)
        try:
            os.rename(slot_name, grab, src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
        except FileNotFoundError:
            self._hints.note_free(n)
            return None
        return grab

    def _settle_grab(self, sub_fd: int, grab: str, n: int | None, ino: int | None) -> bool:
        """Unlink grabbed name ``grab`` (taken from slot ``n``) if it holds ``ino`` (or, ``ino``
        None, is garbage); otherwise give its inode a slot again, or drop its block file."""
        try:
            st = _fresh_stat(sub_fd, grab)
        except FileNotFoundError:
            if n is not None:
                self._hints.note_free(n)
            return n is not None
        released = st.st_ino == ino if ino is not None else st.st_nlink <= 1
        try:
            if not released:
                self._rehome(sub_fd, grab, n, st)
        finally:
            # Never leave a grab behind: if re-homing failed, the inode is without a slot until
            # its writer's check (a file being written) or the reconcile (a block file) fixes it.
            _unlink_quietly(sub_fd, grab)
        if n is not None:
            self._hints.note_free(n)
        return released

    def _rehome(self, sub_fd: int, grab: str, n: int | None, st: os.stat_result) -> None:
        """The grabbed inode is live: link it back to slot ``n``, else to a free slot, else remove
        its block name (the directory is full: it cannot stay)."""
        if n is not None:
            _, slot_name = slot_location(n)
            try:
                os.link(grab, slot_name, src_dir_fd=sub_fd, dst_dir_fd=sub_fd,
                        follow_symlinks=False)  # fmt: skip
                self._hints.note_taken(n, st.st_ino)
                return
            except FileExistsError:
                pass  # claimed again meanwhile
        if self.try_claim(sub_fd, grab, st.st_ino) is None:
            self._drop_block(sub_fd, grab, st)

    def _drop_block(self, sub_fd: int, name: str, st: os.stat_result) -> bool:
        """Remove the block name of the inode ``name`` (in a slot directory) holds; True if
        removed. The key comes from the file's header."""
        key = self._key_of(sub_fd, name)
        if key is None:
            return False
        if self._remove is not None:
            return self._remove(key, (st.st_dev, st.st_ino))
        path = self._mapper.block_path(key)
        try:
            leaf_fd = open_block_dir(self._rank_fd, path)
        except OSError:
            return False
        try:
            return unlink_block(leaf_fd, path.name, (st.st_dev, st.st_ino)) is not None
        except OSError as e:
            logger.warning("fs tier: cannot remove %s: %s", path.rel, e)
            return False
        finally:
            os.close(leaf_fd)

    def evict_unknown(self, remove: RemoveBlock) -> bool:
        """Free a random slot below ``capacity`` by removing whatever block file holds it: the
        fallback of a store when every slot is held by files this instance has not indexed yet
        (written by others since its last reconcile pass).

        Args:
            remove: ``(key, file id) -> removed``: removes ``key``'s block name if it still names
                that file (through the index, so events and counters stay exact).

        Returns:
            Whether a slot was freed.
        """
        n = self._hints.pick(blind=True)
        assert n is not None
        sub, slot_name = slot_location(n)
        sub_fd, cached = self._open_sub(sub, own=True)  # n < capacity
        try:
            seen = self._stat_slot(sub_fd, slot_name, n)
            if seen is None:
                return True  # free already
            if seen.st_nlink > 1 and seen.st_size != self._file_size:
                return False  # a file still being written: not a victim
            grab = self._grab_slot(sub_fd, slot_name, n)
            if grab is None:
                return True  # free already
            try:
                st = _fresh_stat(sub_fd, grab)
                if st.st_nlink > 1:
                    key = self._key_of(sub_fd, grab)
                    if key is None or not remove(key, (st.st_dev, st.st_ino)):
                        self._rehome(sub_fd, grab, n, st)
                        return False
            finally:
                _unlink_quietly(sub_fd, grab)
            self._hints.note_free(n)
            return True
        finally:
            if not cached:
                os.close(sub_fd)

    def _key_of(self, dir_fd: int, name: str) -> OffloadKey | None:
        """The key in the header of the block file ``name`` names; None if unreadable."""
        try:
            return OffloadKey(
                read_header_key(
                    dir_fd, name, run_digest=self._mapper.run_digest, payload_len=self._payload_len
                )
            )
        except (OSError, BlockFileCorrupt) as e:
            logger.warning("fs tier: cannot read the key of slot file %s: %s", name, e)
            return None

    # -----------------------------------------------------------------------------------------
    # Walk (reconcile thread)
    # -----------------------------------------------------------------------------------------

    def subdirs(self) -> list[str]:
        """The slot subdirectories that exist, sorted."""
        with os.scandir(self._slots_fd) as it:
            return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))

    def walk_subdir(self, sub: str, stats: SlotWalkStats) -> int:
        """Re-read one slot subdirectory: refresh the hints, reclaim garbage, recover stale grab
        names, and move (or drop) files of slots beyond this instance's capacity.

        Returns:
            The number of entries examined.
        """
        seq = self._hints.seq()
        try:
            sub_fd, cached = self._open_sub(sub)
        except FileNotFoundError:
            return 1
        try:
            names = os.listdir(sub_fd)
            present: set[int] = set()
            for name in names:
                try:
                    self._walk_entry(sub_fd, sub, name, present, seq, stats)
                except OSError as e:
                    # One bad entry must not stop every pass at the same place.
                    logger.warning("fs tier: cannot examine slot %s/%s: %s", sub, name, e)
                    stats.errors += 1
                    with contextlib.suppress(ValueError):
                        present.add(int(sub, 16) * SLOTS_PER_SUBDIR + int(name, 16))
            base = int(sub, 16) * SLOTS_PER_SUBDIR
            listed = range(base, min(base + SLOTS_PER_SUBDIR, self.capacity))
            self._hints.note_absent(listed, present, seq)
            return len(names) + 1
        finally:
            if not cached:
                os.close(sub_fd)

    def _walk_entry(
        self, sub_fd: int, sub: str, name: str, present: set[int], seq: int, stats: SlotWalkStats
    ) -> None:
        """One name of a slot directory (see ``walk_subdir``); adds live slots to ``present``."""
        if name.endswith(TMP_SUFFIX):
            self._recover_leftover(sub_fd, name, stats)
            return
        n = parse_slot(sub, name)
        if n is None:
            return
        try:
            st = os.stat(name, dir_fd=sub_fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            return
        stats.slots += 1
        present.add(n)
        if st.st_nlink <= 1:
            if self.release(n, None):
                stats.reclaimed += 1
                present.discard(n)
        elif self._is_double(n, st.st_ino):
            # Another slot names this inode too (a releaser put back a slot its writer had
            # meanwhile replaced): one is enough, and with no block name left both would keep
            # the inode alive forever (its link count never drops to 1).
            if self.release(n, st.st_ino):
                stats.doubles += 1
                present.discard(n)
        elif n >= self.capacity:
            self._hints.note_taken(n, st.st_ino, seq)
            if self._move_down(sub_fd, name, n, st, stats):
                present.discard(n)
        else:
            self._hints.note_taken(n, st.st_ino, seq)

    def _is_double(self, n: int, ino: int) -> bool:
        other = self.slot_of(ino)
        if other is None or other == n:
            return False
        try:
            return self.holds(other, ino)
        except OSError:
            return False

    def _move_down(
        self, sub_fd: int, name: str, n: int, st: os.stat_result, stats: SlotWalkStats
    ) -> bool:
        """Slot ``n`` is beyond this instance's capacity (``max_bytes`` was lowered, or another
        instance has a larger one): re-link its file to a free slot of ours, or drop it."""
        if self.try_claim(sub_fd, name, st.st_ino) is not None:
            stats.moved += 1
        elif self._drop_block(sub_fd, name, st):
            stats.dropped += 1
        else:
            return False
        return self.release(n, st.st_ino)

    def _recover_leftover(self, sub_fd: int, name: str, stats: SlotWalkStats) -> None:
        """A grab name left by a releaser that died (or a stale one of a live releaser)."""
        if not is_stale_tmp_file(sub_fd, name, self._stale_tmp_age_s):
            return
        # Its inode is garbage (unlinked), or still live (its block name exists): rehome it.
        self._settle_grab(sub_fd, name, None, None)
        stats.leftovers += 1


def _open_repairing(parent_fd: int, name: str, path: str, modes: FileModes) -> int:
    """Open (creating it if absent) directory ``name`` under ``parent_fd``; a non-directory in
    its place (a file, a symlink: not followed) is replaced, with a WARNING naming ``path``.

    Raises:
        OSError: naming ``path``, if it cannot be made a usable directory.
    """
    try:
        for _ in range(3):
            try:
                return open_dir(name, parent_fd, create=modes)
            except OSError as e:
                if e.errno not in _NOT_A_DIRECTORY:
                    raise
            try:
                st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                continue  # replaced by a directory meanwhile (another instance repaired it)
            logger.warning(
                "fs tier: %s is a %s, not a directory; replacing it with an empty directory",
                path,
                "symlink" if stat.S_ISLNK(st.st_mode) else "file",
            )
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=parent_fd)
        raise OSError(errno.ENOTDIR, "keeps being replaced by a non-directory")
    except OSError as e:
        raise OSError(
            e.errno, f"fs tier: slot directory {path} is not usable: {e.strerror or e}"
        ) from e


def _unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("fs tier: cannot remove slot name %s: %s", name, e)


def _fresh_stat(dir_fd: int, name: str) -> os.stat_result:
    """``stat`` of ``name`` with attributes revalidated: on NFS, ``open`` forces a fresh GETATTR
    (close-to-open consistency), so the link count is not a cached one."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # unreadable: best effort
    try:
        return os.fstat(fd)
    finally:
        os.close(fd)
