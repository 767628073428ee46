# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What the fs tier's tests read of a ``FileSystemSecondaryTier`` beyond its public API, and the
capacity index's full invariant check.

Production code asks a tier only what ``get_stats`` answers (blocks, bytes, counters); a test
that proves "the accounting equals the directory", "the victim was the least recently used",
"what the start-up scan found" or "the slot protocol freed that name" must see the index, the
scan's report and the slots themselves. They are read here, in one place, and nowhere else in
the tests; each private name read says why no public way exists.
"""

from __future__ import annotations

import os
import threading

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.fs.capacity import CapacityIndex, IndexSnapshot
from vllm.v1.kv_offload.tiering.fs.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.fs.scan import ScanStats
from vllm.v1.kv_offload.tiering.fs.slots import CapacitySlots


def block_file(tier: FileSystemSecondaryTier, key: OffloadKey) -> str:
    """Absolute path of ``key``'s block file (whether or not it exists): the documented layout
    (docs/fs_tier.md) below the tier's ``rank_dir``."""
    return os.path.join(tier.rank_dir, FileMapper.block_path(key).rel)


def counters(tier: FileSystemSecondaryTier) -> dict[str, int]:
    """The tier's cumulative counters (``get_stats().counters``)."""
    return dict(tier.get_stats().counters)


def index_of(tier: FileSystemSecondaryTier) -> CapacityIndex:
    """The tier's capacity index."""
    # private: the index is the tier's own account of the directory; an operator sees its totals in
    # get_stats, never its entries.
    return tier._index


def usage(tier: FileSystemSecondaryTier) -> IndexSnapshot:
    """The index's counters, including writes and removals in progress and pins (``get_stats``
    gives only blocks and bytes)."""
    return index_of(tier).snapshot()


def _entries(index: CapacityIndex) -> dict[OffloadKey, int]:
    """The indexed keys and their files' sizes, least recently used first."""
    # private: the LRU order is internal to eviction and the sizes to the accounting (get_stats
    # gives their sum); no caller but a test has a use for them.
    return index._entries


def lru_keys(tier: FileSystemSecondaryTier | CapacityIndex) -> list[OffloadKey]:
    """The indexed keys, least recently used first (the order eviction takes them)."""
    return list(_entries(tier if isinstance(tier, CapacityIndex) else index_of(tier)))


def indexed_size(index: CapacityIndex, key: OffloadKey) -> int | None:
    """The size the index holds for ``key``'s file; None if not indexed."""
    return _entries(index).get(key)


def scan_stats(tier: FileSystemSecondaryTier, timeout: float = 10.0) -> ScanStats:
    """What the start-up scan found and did, once it ended (it logs the same at INFO)."""
    assert tier.wait_until_ready(timeout), "the start-up scan did not end"
    # private: the scan's report goes to the log; only tests assert its figures.
    stats = tier._reconciler.scan_stats
    assert stats is not None
    return stats


def slots_of(tier: FileSystemSecondaryTier) -> CapacitySlots | None:
    """The capacity slots bounding the tier's directory (None without ``max_bytes``, or where
    the filesystem has no hard links)."""
    # private: slots are the shared-root protocol's own; tests drive its races through them.
    return tier._slots


def check_index(tier: FileSystemSecondaryTier | CapacityIndex) -> None:
    """Assert the capacity index's accounting invariant (O(n)): ``used_bytes`` is the sum of
    the indexed files and of the writes in progress (their reservations, and the files they
    replace); no key is both indexed and being written or removed; pin counts are positive; the
    directory buckets hold exactly the indexed keys."""
    index = tier if isinstance(tier, CapacityIndex) else index_of(tier)
    # private: the index's books, whole (no public view lists them), read under its lock as
    # every method of the index does: the I/O threads may run.
    with index._lock:
        entries, writing = _entries(index), index._writing
        removing, pins, buckets = index._removing, index._pins, index._buckets
        expected = sum(entries.values()) + sum(w.size + (w.replaced or 0) for w in writing.values())
        used = index.used_bytes
        assert used == expected, f"used_bytes={used} but files sum to {expected}"
        for key in writing:
            assert key not in entries, f"key {key.hex()} both indexed and being written"
            assert key not in removing, f"key {key.hex()} both written and removed"
        for key in removing:
            assert key not in entries, f"key {key.hex()} both indexed and being removed"
        for key, count in pins.items():
            assert count > 0, f"key {key.hex()} has pin count {count}"
        bucket_of = index._bucket_of
        if bucket_of is not None:
            grouped = 0
            for outer, inners in buckets.items():
                assert inners, f"empty bucket {outer!r}"
                for inner, keys in inners.items():
                    assert keys, f"empty bucket {(outer, inner)!r}"
                    grouped += len(keys)
                    for key in keys:
                        assert key in entries
                        assert bucket_of(key) == (outer, inner)
            assert grouped == len(entries), f"{grouped} grouped keys"


def descriptors_of(path: str) -> list[int]:
    """This process's open descriptors of ``path`` (from ``/proc/self/fd``)."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == path:
                found.append(int(name))
        except OSError:
            continue  # closed meanwhile
    return found


def threads_named(name: str) -> list[threading.Thread]:
    """The live threads called ``name`` (the tier names its threads, docs/fs_tier.md)."""
    return [t for t in threading.enumerate() if t.name == name]
