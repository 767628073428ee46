# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The key orders of ``ARCCachePolicy``: FIFOs with lazy deletion, and eviction's walk of T1.

``ARCCachePolicy`` (``arc.py``) keeps T1's evictable blocks, B1 and B2 as ``LazyFIFO`` s of keys
(oldest first; leaving the list only marks an entry stale) and walks T1's with a ``T1Walk`` when
it picks eviction victims. Both only hold keys and counts: the policy owns every block and ghost
entry (its ``_entries``), and these classes change it only where ``LazyFIFO.trim`` is handed it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterator

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus


class LazyFIFO:
    """An order of keys, oldest first, with lazy deletion: T1's evictable blocks, B1, B2.

    ``keys`` holds one entry per time a key joined the list. Leaving the list (from anywhere)
    only marks the key's entry stale: ``stale`` counts each key's stale entries, and since a key
    rejoins only after it left, its stale entries all precede its live one. ``live`` is the
    number of live entries.
    """

    __slots__ = ("keys", "live", "num_stale", "stale")

    def __init__(self) -> None:
        self.keys: deque[OffloadKey] = deque()
        self.stale: dict[OffloadKey, int] = {}
        self.num_stale = 0
        self.live = 0

    def append(self, key: OffloadKey) -> None:
        self.keys.append(key)
        self.live += 1

    def leave(self, key: OffloadKey) -> None:
        """``key``'s live entry goes stale."""
        stale = self.stale
        stale[key] = stale.get(key, 0) + 1
        self.num_stale += 1
        self.live -= 1

    def trim(self, excess: int, entries: dict[OffloadKey, BlockStatus | int], marker: int) -> None:
        """Forget the ``excess`` oldest live ghosts (dropping their ``entries``).

        ``marker`` is the list's ghost value (``_B1`` or ``_B2``); a ghost may also hold twice
        that value (seen).
        """
        assert 0 <= excess <= self.live, f"trim {excess} of {self.live} ghosts"
        self.live -= excess
        keys = self.keys
        stale = self.stale
        while excess:
            key = keys.popleft()
            if stale:
                num_stale = stale.get(key)
                if num_stale is not None:
                    if num_stale == 1:
                        del stale[key]
                    else:
                        stale[key] = num_stale - 1
                    self.num_stale -= 1
                    continue
            ghost = entries.pop(key)
            assert ghost == marker or ghost == 2 * marker, (
                f"ghost FIFO: key {key.hex()} maps to {ghost!r}"
            )
            excess -= 1

    def maybe_compact(self, slack: int) -> None:
        """Rebuild the FIFO once its stale entries exceed its live ones by ``slack``."""
        if self.num_stale <= self.live + slack:
            return
        # In place, not a new deque: a container built at start-up stays the one an
        # application's gc.freeze() took out of the collector's sight.
        live = self.live_keys()
        self.keys.clear()
        self.keys.extend(live)
        self.stale.clear()
        self.num_stale = 0

    def live_keys(self) -> list[OffloadKey]:
        """The live entries' keys, oldest first (O(len))."""
        pending = dict(self.stale)
        live: list[OffloadKey] = []
        for key in self.keys:
            num_stale = pending.get(key)
            if num_stale:
                pending[key] = num_stale - 1
            else:
                live.append(key)
        assert len(live) == self.live, f"ghost FIFO holds {len(live)} live keys, not {self.live}"
        return live

    def clear(self) -> None:
        self.keys.clear()
        self.stale.clear()
        self.num_stale = 0
        self.live = 0


class T1Walk:
    """One ``evict`` call's walk of T1's evictable FIFO, oldest first, read-only.

    Skips stale entries (counting them in ``stale_seen``: a key's stale entries precede its live
    one) and protected keys (kept, in order, in ``kept``); ``walked`` counts every entry taken
    from the iterator, so the commit pops exactly the walked prefix.
    """

    __slots__ = ("exhausted", "it", "kept", "protected", "stale", "stale_seen", "walked")

    def __init__(
        self,
        it: Iterator[OffloadKey],
        stale: dict[OffloadKey, int],
        protected: Collection[OffloadKey],
    ) -> None:
        self.it = it
        self.stale = stale
        self.protected = protected
        self.stale_seen: dict[OffloadKey, int] = {}
        self.kept: list[OffloadKey] = []
        self.walked = 0
        self.exhausted = False

    def take(self, out: list[OffloadKey], want: int) -> None:
        """Append up to ``want`` (``>= 1``) unprotected live keys to ``out``, in FIFO order;
        fewer only if the FIFO runs out (then ``exhausted``)."""
        stale = self.stale
        stale_seen = self.stale_seen
        protected = self.protected
        kept = self.kept
        walked = 0
        taken = 0
        for key in self.it:
            walked += 1
            if stale:
                num_stale = stale.get(key)
                if num_stale is not None:
                    seen = stale_seen.get(key, 0)
                    if seen < num_stale:  # a stale entry precedes the live one
                        stale_seen[key] = seen + 1
                        continue
            if key in protected:
                kept.append(key)
                continue
            out.append(key)
            taken += 1
            if taken == want:
                break
        else:
            self.exhausted = True
        self.walked += walked
