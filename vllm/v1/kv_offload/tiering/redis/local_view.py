# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's local view: blocks this instance knows the server holds.

A lookup the server must answer costs a step (the batched ``EXISTS`` runs in the background and a
later step's lookup answers). Most of an instance's hits are blocks it stored itself or found
there recently; ``KnownBlocks`` remembers those, so that their lookups answer at once:

* a key enters when a store of it succeeded (written, or found present and skipped), when a load
  of it succeeded, or when a probe found it;
* it leaves when a load found it gone or invalid, when a probe missed it, when a lookup is told
  it is a miss, when it is older than ``ttl_s`` (the server expired it), and, the oldest first,
  when more than ``capacity`` keys are known.

The view only ever answers "present": a key it does not know goes to the server, so blocks that
other instances of a fleet stored are found as before. A stale "present" (the server evicted the
block under its ``maxmemory`` policy) costs a failed load, recomputed, and the key leaves the
view; never a wrong byte (every loaded value is verified).

Threading: the I/O and lookup threads add and drop keys under a lock; the scheduler thread reads
without one (one ``dict.get``, atomic under the GIL).
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

    def drop(self, keys: Iterable[OffloadKey]) -> None:
        """``keys`` are not (or may not be) on the server."""
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    def __len__(self) -> int:
        return len(self._known)
