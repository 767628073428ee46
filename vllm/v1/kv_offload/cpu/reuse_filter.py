# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The reuse filter: store a block in the CPU tier only once its key was offered N times.

A one-off prompt's blocks are offered to ``prepare_store`` once and never looked up again; writing
them costs GPU -> CPU bandwidth (and, behind a tiering manager, secondary-tier writes) and evicts
blocks that may be used again. With the filter a block is stored from its ``store_threshold``-th
offer on: a prefix shared by several requests gets stored, a one-off prompt does not.

Semantics are upstream vLLM's (``kv_connector_extra_config`` keys ``store_threshold``, default 0,
and ``max_tracker_size``, default 64,000; the filter is on for ``store_threshold >= 2``):

* Offers are counted, not lookups (upstream PR #52227: a prefix lookup stops at the first miss,
  and blocks served from the GPU prefix cache are never looked up, so counting lookups left cold
  prefixes below the threshold). Each ``prepare_store`` call is one offer of each key it passes,
  stored or not; a call that finds no room (returns None, to be retried) has counted its offer
  all the same, as upstream's.
* The counts live in a tracker of at most ``max_tracker_size`` keys, least recently offered
  first out. The keys of the current offer that are already tracked are never dropped to make
  room for its new keys (upstream PR #54759: an offer larger than the tracker would otherwise
  drop its own counts and never reach the threshold); a new key finding no droppable entry is
  not tracked.

Where this differs from upstream (PR #41727's in-manager filter): the threshold applies only to
keys that are not stored yet. A key already stored stays protected from the call's eviction
(the ``prepare_store`` contract), and ``stores_skipped`` counts only stores that would otherwise
have happened (upstream also counts offers of already-stored keys below the threshold). A key
repeated within one call is one offer.

Why a hook in the manager rather than a decorating manager (upstream had both): a decorator adds
a call frame to every ``lookup``, ``touch`` and completion it forwards, on the scheduler's hot
path, while the filter only needs ``prepare_store``. The hook costs one attribute test per
``prepare_store`` when the filter is off and O(keys offered) dict operations when it is on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.config import DEFAULT_MAX_TRACKER_SIZE

__all__ = ["DEFAULT_MAX_TRACKER_SIZE", "StoreReuseFilter"]


class StoreReuseFilter:
    """Counts offers per key and admits a new key from its ``threshold``-th offer on.

    Attributes:
        threshold: offers a key needs before it is stored (``>= 2``).
        max_tracker_size: most keys whose counts are kept (``>= 1``).
        num_skipped: stores declined since construction or the last ``reset_stats``.
    """

    __slots__ = ("_counts", "max_tracker_size", "num_skipped", "threshold")

    def __init__(self, threshold: int, max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE) -> None:
        """Create an empty tracker.

        Raises:
            ValueError: ``threshold < 2`` (a threshold of 0 or 1 means no filter: do not create
                one) or ``max_tracker_size < 1``.
        """
        if threshold < 2:
            raise ValueError(f"store_threshold must be >= 2 for a reuse filter, got {threshold}")
        if max_tracker_size < 1:
            raise ValueError(f"max_tracker_size must be >= 1, got {max_tracker_size}")
        self.threshold = threshold
        self.max_tracker_size = max_tracker_size
        self.num_skipped = 0
        # key -> offers counted, least recently offered first.
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def __len__(self) -> int:
        """Number of tracked keys (at most ``max_tracker_size``)."""
        return len(self._counts)

    def count(self, key: OffloadKey) -> int:
        """Offers counted for ``key`` (0 if untracked)."""
        return self._counts.get(key, 0)

    def admit(self, offered: Iterable[OffloadKey], new_keys: list[OffloadKey]) -> list[OffloadKey]:
        """Count one offer of every key of ``offered``; return the keys of ``new_keys`` admitted.

        O(|offered| + |new_keys|).

        Args:
            offered: the distinct keys the ``prepare_store`` call was given.
            new_keys: those of them not stored yet, in order (a subset of ``offered``).

        Returns:
            The keys of ``new_keys`` offered at least ``threshold`` times, in order; the others
            are counted in ``num_skipped``.
        """
        counts = self._counts
        move_to_end = counts.move_to_end
        untracked: list[OffloadKey] = []
        num_protected = 0
        for key in offered:
            count = counts.get(key)
            if count is None:
                untracked.append(key)
            else:
                # Moved to the most recent end: the drops below take older entries first, and
                # these are protected from them.
                counts[key] = count + 1
                move_to_end(key)
                num_protected += 1
        if untracked:
            droppable = len(counts) - num_protected
            popitem = counts.popitem
            limit = self.max_tracker_size
            for key in untracked:
                if len(counts) >= limit:
                    if droppable == 0:
                        break  # every tracked key is this offer's: the rest go untracked
                    popitem(last=False)
                    droppable -= 1
                counts[key] = 1
        threshold = self.threshold
        get = counts.get
        admitted = [key for key in new_keys if get(key, 0) >= threshold]
        self.num_skipped += len(new_keys) - len(admitted)
        assert len(counts) <= self.max_tracker_size, (
            f"reuse tracker holds {len(counts)} keys, more than {self.max_tracker_size}"
        )
        return admitted

    def reset_stats(self) -> None:
        """Zero ``num_skipped`` (the counts are kept: they are history, not cache contents)."""
        self.num_skipped = 0
