# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What one tier instance believes about the capacity slots: which are taken, which inode holds
which slot (``slots``).

Hints only: the slot directory is the truth. A hint that is wrong costs a retry (a claim that
meets EEXIST, a release that finds another inode and leaves it alone), never the bound. Our own
claims and releases are recorded with a sequence number, so that a directory listing taken
before them cannot undo them.

Thread-safety: one lock, held only for dictionary and bytearray operations (no system call).
Memory: one byte per slot, plus two dictionary entries per slot whose inode is known.
"""

from __future__ import annotations

import random
import threading


class SlotHints:
    """Hints about ``capacity`` slots (and any slot number above, for their inodes).

    Args:
        capacity: slots this instance may claim.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._taken = bytearray(capacity)  # 1: believed taken
        self._ino_of: dict[int, int] = {}  # slot -> inode it holds (any slot number)
        self._slot_of: dict[int, int] = {}  # inode -> slot
        self._changed: dict[int, int] = {}  # slot -> sequence number of our last claim/release
        self._seq = 0
        # Instances start looking for free slots at different places: fewer collisions.
        self._cursor = random.randrange(capacity)

    def slot_of(self, ino: int) -> int | None:
        """The slot believed to hold inode ``ino``."""
        with self._lock:
            return self._slot_of.get(ino)

    def note_taken(self, n: int, ino: int | None, seq: int | None = None) -> None:
        """Slot ``n`` holds ``ino`` (None: unknown). ``seq``: what the caller saw predates
        ``seq`` (ignored if we changed the slot since); None: our own change, recorded."""
        with self._lock:
            if seq is not None and self._changed.get(n, -1) > seq:
                return  # we changed it after the caller looked: ours is newer
            if n < self.capacity:
                self._taken[n] = 1
            old = self._ino_of.pop(n, None)
            if old is not None and self._slot_of.get(old) == n:
                del self._slot_of[old]
            if ino is not None:
                self._ino_of[n] = ino
                self._slot_of[ino] = n
            if seq is None:
                self._seq += 1
                self._changed[n] = self._seq

    def note_free(self, n: int, seq: int | None = None) -> None:
        """Slot ``n`` is free; ``seq`` as for ``note_taken``."""
        with self._lock:
            if seq is not None and self._changed.get(n, -1) > seq:
                return
            if n < self.capacity:
                self._taken[n] = 0
            old = self._ino_of.pop(n, None)
            if old is not None and self._slot_of.get(old) == n:
                del self._slot_of[old]
            if seq is None:
                self._seq += 1
                self._changed[n] = self._seq

    def seq(self) -> int:
        """The number of our last recorded change (take before a listing)."""
        with self._lock:
            return self._seq

    def note_absent(self, slots: range, present: set[int], seq: int) -> None:
        """A listing taken after ``seq`` lacked the ``slots`` not in ``present``: free."""
        with self._lock:
            changed = self._changed
            for n in slots:
                if n in present or changed.get(n, -1) > seq:
                    continue
                self._taken[n] = 0
                old = self._ino_of.pop(n, None)
                if old is not None and self._slot_of.get(old) == n:
                    del self._slot_of[old]

    def pick(self, blind: bool) -> int | None:
        """A slot believed free (marked taken now, so that our other threads skip it); with
        ``blind``, any slot."""
        with self._lock:
            if blind:
                return random.randrange(self.capacity)
            taken = self._taken
            n = taken.find(0, self._cursor)
            if n < 0:
                n = taken.find(0, 0, self._cursor)
            if n < 0:
                return None
            taken[n] = 1
            self._cursor = (n + 1) % self.capacity
            return n
