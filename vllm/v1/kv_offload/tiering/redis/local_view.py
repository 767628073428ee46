# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's local view: blocks this instance knows the server holds.

A lookup the server must answer costs a step (the batched ``EXISTS`` runs in the background and a
later step's lookup answers). Most of an instance's hits are blocks it stored itself or found
there recently; ``KnownBlocks`` remembers those, so that their lookups answer at once:

* a key enters when a store of it succeeded (written, or found present and skipped), when a load
  of it succeeded, when a probe found it, and (``key_feed``) when another instance announced it
  or a listing of the namespace found it;
* it leaves when a load found it gone or invalid, when a probe missed it, when a lookup is told
  it is a miss, when it is older than ``ttl_s`` (the server expired it), when a listing no
  longer found it, and, the oldest first, when more than ``capacity`` keys are known.

On its own the view only answers "present": a key it does not know goes to the server, so blocks
that other instances of a fleet stored are found as before. The tier's key feed (``key_feed``)
adds what every other writer of the namespace stores, and the namespace's keys as listed (at
start-up, then every ``key_feed.RELIST_S``); while it follows them and the view has dropped no
key for its capacity (``capacity_drops``), a key the view does not hold is absent and answers so
at once. A stale "present" (the server evicted the block under its ``maxmemory`` policy) costs a
failed load, recomputed, and the key leaves the view; never a wrong byte (every loaded value is
verified).

Threading: the I/O, lookup and feed threads add and drop keys under a lock; the scheduler thread
reads without one (one ``dict.get``, atomic under the GIL).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey

DEFAULT_CAPACITY = 65536
"""Keys remembered at most (about 13 MB): 128 GiB of 2 MiB blocks, 4 GiB of 64 KiB ones."""
TTL_MARGIN = 0.9
"""With ``ttl_s``, a key is trusted for this fraction of it (its store's clock is ours, the
server's expiry starts a little later)."""


class KnownBlocks:
    """Keys the server holds, as far as this instance knows (see the module docstring)."""

    def __init__(self, ttl_s: float | None, capacity: int = DEFAULT_CAPACITY) -> None:
        self._trust_s = None if ttl_s is None else ttl_s * TTL_MARGIN
        self._capacity = capacity
        self._lock = threading.Lock()
        # Key -> when it was last confirmed (time.monotonic); insertion order is age order.
        self._known: dict[OffloadKey, float] = {}
        self.capacity_drops = 0
        """Keys forgotten because more than ``capacity`` were known (only grows)."""

    @property
    def capacity(self) -> int:
        """Keys remembered at most."""
        return self._capacity

    def holds(self, key: OffloadKey) -> bool:
        """Whether ``key`` is known to be on the server (scheduler thread; no lock)."""
        seen = self._known.get(key)
        if seen is None:
            return False
        return self._trust_s is None or time.monotonic() - seen < self._trust_s

    def add(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` are on the server now (re-added keys become the youngest)."""
        now = time.monotonic()
        with self._lock:
            known = self._known
            for key in keys:
                known.pop(key, None)
                known[key] = now
            while len(known) > self._capacity:
                del known[next(iter(known))]
                self.capacity_drops += 1

    def drop(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` are not (or may not be) on the server."""
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    def drop_unconfirmed_since(self, since: float) -> int:
        """Forget every key last confirmed before ``since`` (a ``time.monotonic()`` reading):
        after a listing of the server's keys that began then, those are the keys it no longer
        holds. O(keys dropped). Returns their number."""
        dropped = 0
        with self._lock:
            known = self._known
            while known:
                key = next(iter(known))
                if known[key] >= since:
                    break  # age order: every later key was confirmed since
                del known[key]
                dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._known)
