# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Which tier instances write into one run directory: one presence file each in ``writers/``.

An instance that is the only writer of its run directory has seen every block file in it: the
start-up scan indexed what was there, and since then only this instance wrote or removed files.
Its index then answers every lookup at once, "absent" included, and it needs no background
reconcile. With other writers it must ask the directory (a background probe) for keys its index
lacks, and reconcile. ``WriterRegistry`` tells the two apart:

* At start an instance creates ``writers/<host>.<pid>.<writer>`` (``O_EXCL``, the tier's file
  mode), before its first block file; at shutdown, after its last I/O, it removes it.
* ``count_others()`` lists the directory: every other name is a live writer unless it is known to
  be gone (``block_io.writer_gone``: a dead process on this host, or an unregistered instance of
  this process) or its file is older than ``stale_age_s`` (its owner refreshes the modification
  time every ``stale_age_s / 4``, so an older one was left by a crash on another host, or by a
  process whose id was reused). A gone writer's file is removed.

A writer that starts is seen by the others at their next listing (the reconcile thread lists the
directory every ``reconcile_interval_s``): until then they may answer "absent" for a block it
just wrote, which costs a recompute, never a wrong byte (every load is verified).

Thread-safety: the reconcile thread calls ``count_others``; ``leave`` and ``close`` run at
shutdown, ``close`` only once that thread stopped. Owns the descriptor of ``writers/``.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time

from vllm.logger import init_logger
from vllm.v1.kv_offload.tiering.fs.block_io import HOST_TAG, FileModes, open_dir, writer_gone

logger = init_logger(__name__)

WRITERS_DIR = "writers"
"""Name of the presence directory under the rank directory."""

_NAME_RE = re.compile(r"^(?P<host>[0-9a-f]{8})\.(?P<pid>[1-9][0-9]{0,9})\.(?P<writer>[0-9a-f]{8})$")
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class WriterRegistry:
    """This instance's presence file, and what the others' files say.

    Args:
        rank_fd: the rank directory (borrowed).
        writer: this instance's writer id.
        modes: of the directory and the file.
        stale_age_s: age after which a presence file counts as left behind (the tier's
            ``stale_tmp_age_s``).

    Raises:
        OSError: ``writers/`` or the presence file cannot be created.
    """

    def __init__(self, rank_fd: int, writer: str, modes: FileModes, stale_age_s: float) -> None:
        self._modes = modes
        self._stale_age_s = stale_age_s
        self._refresh_s = stale_age_s / 4
        self._name = f"{HOST_TAG}.{os.getpid()}.{writer}"
        self._refreshed = time.monotonic()
        self._dir_fd = open_dir(WRITERS_DIR, rank_fd, create=modes)
        try:
            self._create()
        except BaseException:
            os.close(self._dir_fd)
            raise

    def count_others(self) -> tuple[int, int]:
        """``(live, gone)``: writers of the run directory other than this instance that are
        registered, and those whose presence files this call found left behind and removed (one
        listing; a ``stat`` per other name). Refreshes this instance's file when due, and
        recreates it if someone removed it.

        Raises:
            OSError: ``writers/`` cannot be listed.
        """
        names = os.listdir(self._dir_fd)
        others = gone_count = 0
        mine = False
        now = time.time()
        for name in names:
            if name == self._name:
                mine = True
                continue
            match = _NAME_RE.match(name)
            if match is None:
                continue  # not a presence file
            try:
                st = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            gone = not stat.S_ISREG(st.st_mode) or writer_gone(
                match.group("host"), int(match.group("pid")), match.group("writer")
            )
            if gone or now - st.st_mtime > self._stale_age_s:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._dir_fd)
                    gone_count += 1
                continue
            others += 1
        if not mine:
            logger.warning(
                "fs tier: presence file writers/%s was removed; recreating it", self._name
            )
            with contextlib.suppress(FileExistsError):
                self._create()
        elif time.monotonic() - self._refreshed >= self._refresh_s:
            os.utime(self._name, dir_fd=self._dir_fd, follow_symlinks=False)
            self._refreshed = time.monotonic()
        return others, gone_count

    def leave(self) -> None:
        """Remove this instance's presence file (after its last I/O; idempotent)."""
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self._name, dir_fd=self._dir_fd)

    def close(self) -> None:
        """``leave()`` and close the directory (idempotent)."""
        self.leave()
        fd, self._dir_fd = self._dir_fd, -1
        if fd >= 0:
            os.close(fd)

    def _create(self) -> None:
        os.close(self._modes.create_file(self._name, _FILE_FLAGS, self._dir_fd))
        self._refreshed = time.monotonic()
