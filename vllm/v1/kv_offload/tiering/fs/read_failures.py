# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Bounded retries of block files that keep failing to read with a transient error.

A transient read error (EACCES, EIO, ELOOP, ...) fails the load but keeps the file: one passing
error must not become data loss. A file that fails every time, though, would be found by every
lookup and fail every load, forever. ``ReadFailures`` counts consecutive failed reads per file;
once a file reaches ``limit`` it is *given up*: the tier stops serving it (lookups miss) and the
next store of the block replaces it instead of skipping it as already present.

A count belongs to one file, identified by ``FileIdentity`` (device, inode and modification
time: filesystems reuse a freed inode number at once, the modification time of a new file tells
it apart): a successful read, or the file being replaced, removed or rewritten by anyone, clears
it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from vllm.v1.kv_offload.base import OffloadKey

FileId = tuple[int, int, int]
"""``(st_dev, st_ino, st_mtime_ns)`` of a file (see ``file_identity``)."""


def file_identity(st: os.stat_result) -> FileId:
    """The identity of the file ``st`` describes."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


_MAX_TRACKED = 1 << 16
"""At most this many failing files are remembered (the oldest are forgotten first): a storm of
failures cannot grow memory without bound."""


class ReadFailures:
    """Consecutive failed reads per block file; thread-safe, O(1) per call.

    Args:
        limit: failed reads after which a file is given up (>= 1).
    """

    def __init__(self, limit: int) -> None:
        assert limit >= 1, f"limit={limit}"
        self._limit = limit
        self._lock = threading.Lock()
        # key -> (file, consecutive failures), least recently failed first.
        self._failures: OrderedDict[OffloadKey, tuple[FileId | None, int]] = OrderedDict()

    @property
    def limit(self) -> int:
        """Failed reads after which a file is given up."""
        return self._limit

    def failed(self, key: OffloadKey, file_id: FileId | None) -> bool:
        """Count a failed read of ``key``'s file ``file_id`` (None: could not tell which).

        Returns:
            True if this failure gives the file up (exactly once per file).
        """
        with self._lock:
            old_id, count = self._failures.pop(key, (file_id, 0))
            if file_id is not None and old_id is not None and old_id != file_id:
                count = 0  # another file now: its own count starts
            count += 1
            self._failures[key] = (file_id if file_id is not None else old_id, count)
            while len(self._failures) > _MAX_TRACKED:
                self._failures.popitem(last=False)
            return count == self._limit

    def give_up(self, key: OffloadKey, file_id: FileId | None) -> bool:
        """Give ``key``'s file ``file_id`` up at once (it can never be served: e.g. it is not
        authenticated with the fleet's key).

        Returns:
            True if it was not given up already.
        """
        with self._lock:
            old = self._failures.pop(key, None)
            already = old is not None and old[1] >= self._limit and old[0] == file_id
            self._failures[key] = (file_id, self._limit)
            while len(self._failures) > _MAX_TRACKED:
                self._failures.popitem(last=False)
            return not already

    def given_up(self, key: OffloadKey, file_id: FileId | None = None) -> bool:
        """Whether ``key``'s file (``file_id`` when known) is given up.

        A ``file_id`` that differs from the failing file's clears the count: the file was
        replaced, so the new one gets its own tries. O(1), and without the lock for a key with
        no failure (every lookup asks).
        """
        if key not in self._failures:
            return False
        with self._lock:
            entry = self._failures.get(key)
            if entry is None:
                return False
            old_id, count = entry
            if file_id is not None and old_id is not None and old_id != file_id:
                del self._failures[key]
                return False
            return count >= self._limit

    def clear(self, key: OffloadKey) -> None:
        """``key``'s file was read, written, or is gone: forget its failures."""
        with self._lock:
            self._failures.pop(key, None)
