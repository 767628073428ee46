# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV-cache groups as the scheduler-side connector sees them: full attention and sliding window.

A hybrid model (Gemma-3- or Llama-4-style) has full-attention groups and sliding-window (SWA)
groups of ``W`` tokens. Offloaded block ``i`` holds tokens ``[i * B, (i + 1) * B)`` of every group,
one key per group. What each group needs differs:

* **Lookups.** A hit of offloaded blocks ``[start, end)`` needs every full-attention key of them,
  but in an SWA group only the keys of the window before ``end``: blocks
  ``[end - window_blocks, end)`` with ``window_blocks = cdiv(W, B)`` (the last prompt token may be
  recomputed, reading ``W`` tokens back from the hit point). ``lookup_hit_end`` scans the
  full-attention groups as a prefix, then each SWA group from the end backwards for the last run
  of ``window_blocks`` hits (or a run reaching ``start``: the rest of that window is on the GPU
  already), sorted by window size descending, repeating until the hit end stops moving.
* **Loads.** Only the window's blocks of an SWA group are loaded (``load_start``); the engine
  frees the rest of the SWA group's blocks anyway.
* **Promotions.** A manager promotes a block found only in a slower tier when ``lookup`` asks
  for it, but the scans above ask for more keys than the hit loads (an SWA run broken before it
  reached ``window_blocks``, full-attention keys past an end an SWA group lowered).
  ``promoting_hit_end`` therefore scans with ``probe`` (no promotion) and looks up only the keys
  the hit loads.
* **Stores.** Every SWA block still on the GPU is stored: a hit ending at any of the next
  ``window_blocks`` block boundaries needs it, and hits happen at every boundary a later prompt
  shares. SWA blocks the engine already freed (``NULL_BLOCK_ID`` in the block table, mirrored by
  ``skip_freed_blocks``) cannot be stored; a later lookup then finds a shorter SWA run. See
  ``docs/architecture.md`` (hybrid models).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm.v1.kv_cache_interface import NULL_BLOCK_ID, num_skipped_blocks
from vllm.v1.kv_offload.base import OffloadKey

LookupFn = Callable[[OffloadKey], "bool | None"]
"""``manager.lookup`` bound to the request's context: True (readable), None (not yet), False."""
PrefixLookupFn = Callable[[Sequence[OffloadKey]], "list[bool | None]"]
"""``manager.lookup_prefix`` bound to the request's context: the answers up to the first False."""


class GroupLayout:
    """The attention type and window of each KV-cache group, in offloaded blocks.

    Args:
        gpu_block_sizes: tokens per GPU block, per group.
        offloaded_block_size: tokens per offloaded block (``B``).
        sliding_windows: per group, the window in tokens or None (full attention); empty: every
            group has full attention.
    """

    def __init__(
        self,
        gpu_block_sizes: Sequence[int],
        offloaded_block_size: int,
        sliding_windows: Sequence[int | None] = (),
    ) -> None:
        self.gpu_block_sizes = tuple(gpu_block_sizes)
        self.offloaded_block_size = offloaded_block_size
        windows = tuple(sliding_windows) or (None,) * len(self.gpu_block_sizes)
        if len(windows) != len(self.gpu_block_sizes):
            raise ValueError(f"{len(windows)} sliding windows for {len(gpu_block_sizes)} groups")
        self.sliding_windows: tuple[int | None, ...] = windows
        self.window_blocks: tuple[int | None, ...] = tuple(
            None if w is None else -(-w // offloaded_block_size) for w in windows
        )
        self.full_groups = tuple(g for g, w in enumerate(windows) if w is None)
        # Widest window first, as upstream: it is the most likely to lower the hit end.
        self.swa_groups = tuple(
            sorted(
                (g for g, w in enumerate(windows) if w is not None),
                key=lambda g: -(windows[g] or 0),
            )
        )

    @property
    def has_sliding_window(self) -> bool:
        """Whether some group has sliding-window attention."""
        return bool(self.swa_groups)

    def load_start(self, group: int, start: int, end: int) -> int:
        """First offloaded block of ``group`` that a hit of blocks ``[start, end)`` loads."""
        window = self.window_blocks[group]
        return start if window is None else max(start, end - window)

    def touch_start(self, group: int, num_blocks: int) -> int:
        """First of a request's ``num_blocks`` keys of ``group`` worth keeping warm: all of them
        for full attention, the window before the end for SWA."""
        return self.load_start(group, 0, num_blocks)

    def load_keys(
        self, offload_keys: Sequence[Sequence[OffloadKey]], start: int, end: int
    ) -> list[OffloadKey]:
        """Keys a hit of offloaded blocks ``[start, end)`` loads, group-major (SWA: window)."""
        return [
            key
            for g, keys in enumerate(offload_keys)
            for key in keys[self.load_start(g, start, end) : end]
        ]

    def load_gpu_indices(self, num_local_tokens: int, end_tokens: int) -> list[list[int]]:
        """Per group, the logical GPU block indices a load of tokens ``[num_local_tokens,
        end_tokens)`` writes (an SWA group: only the window before ``end_tokens``)."""
        b = self.offloaded_block_size
        start, end = num_local_tokens // b, end_tokens // b
        return [
            list(
                range(
                    max(num_local_tokens, self.load_start(g, start, end) * b) // bs,
                    end_tokens // bs,
                )
            )
            for g, bs in enumerate(self.gpu_block_sizes)
        ]

    def store_keys(
        self,
        offload_keys: Sequence[Sequence[OffloadKey]],
        block_ids: list[list[int]],
        start: int,
        end: int,
    ) -> list[OffloadKey]:
        """Keys of offloaded blocks ``[start, end)`` to offer to ``prepare_store``, group-major:
        SWA blocks the engine freed already are left out (nothing to read)."""
        if not self.swa_groups:
            return [key for keys in offload_keys for key in keys[start:end]]
        return [
            keys[i]
            for g, keys in enumerate(offload_keys)
            for i in range(start, end)
            if self.is_on_gpu(block_ids, g, i)
        ]

    def skip_freed_blocks(self, block_ids: list[list[int]], num_computed_tokens: int) -> None:
        """Null the SWA block ids the engine freed once ``num_computed_tokens`` were computed.

        The engine frees them when it allocates a request's blocks for a step (the scheduler
        output lists new blocks only), by the rule of ``vllm.v1.kv_cache_interface``; this
        applies the same rule to the connector's copy of the block table.
        """
        for g in self.swa_groups:
            table = block_ids[g]
            end = min(
                num_skipped_blocks(
                    num_computed_tokens, self.sliding_windows[g], self.gpu_block_sizes[g]
                ),
                len(table),
            )
            for j in range(end - 1, -1, -1):  # nulls form a prefix: stop at the first one
                if table[j] == NULL_BLOCK_ID:
                    break
                table[j] = NULL_BLOCK_ID

    def is_on_gpu(self, block_ids: list[list[int]], group: int, index: int) -> bool:
        """Whether every GPU block of offloaded block ``index`` of ``group`` is still allocated."""
        factor = self.offloaded_block_size // self.gpu_block_sizes[group]
        table = block_ids[group]
        # Freed SWA blocks form a prefix of the table: checking the first sub-block suffices.
        return index * factor < len(table) and table[index * factor] != NULL_BLOCK_ID


def one_by_one(lookup: LookupFn) -> PrefixLookupFn:
    """A prefix lookup made of ``lookup`` calls, key by key until the first False (what
    ``OffloadingManager.lookup_prefix`` does by default)."""

    def lookup_keys(keys: Sequence[OffloadKey]) -> list[bool | None]:
        results: list[bool | None] = []
        for key in keys:
            result = lookup(key)
            results.append(result)
            if result is False:
                break
        return results

    return lookup_keys


def prefix_scan(
    lookup_prefix: PrefixLookupFn, keys: Sequence[OffloadKey]
) -> tuple[int, int | None]:
    """Look ``keys`` up in order until the first miss (one ``lookup_prefix`` call).

    Returns:
        ``(n, first_deferred)``: ``n`` keys before the first miss answered True or None, and the
        index of the first None among them (None if none). The manager's scan goes on past a
        None, so that it starts promotions and probes for every key that could hit.
    """
    results = lookup_prefix(keys)
    n = len(results) - 1 if results and results[-1] is False else len(results)
    first_deferred = results.index(None) if None in results else None
    return n, first_deferred


def window_scan(
    lookup: LookupFn, keys: Sequence[OffloadKey], start: int, end: int, window: int
) -> tuple[int, bool]:
    """The hit end of an SWA group: the end of the last run of ``window`` hits in
    ``keys[start:end]``, or of a run reaching ``start`` (the window's rest is on the GPU).

    Scans from ``end`` backwards. A None counts as a hit for the run but defers the request if it
    lies in the run that is returned.

    Returns:
        ``(hit_end, deferred)``; ``hit_end == start`` means no hit.
    """
    run_end = end
    deferred = False
    for i in range(end - 1, start - 1, -1):
        result = lookup(keys[i])
        if result is False:
            run_end, deferred = i, False
            continue
        if result is None:
            deferred = True
        if run_end - i == window:
            return run_end, deferred
    return run_end, deferred and run_end > start


def lookup_hit_end(
    layout: GroupLayout,
    lookup: LookupFn,
    lookup_prefix: PrefixLookupFn,
    keys: Sequence[Sequence[OffloadKey]],
    start: int,
    end: int,
) -> tuple[int, bool]:
    """The longest hit ``[start, hit_end)`` every group can serve (see the module docstring).

    Args:
        layout: the groups.
        lookup: the manager's lookup for this request (the SWA groups' backward scans).
        lookup_prefix: the manager's prefix lookup for this request (the full groups' scans).
        keys: per group, the request's keys.
        start: first offloaded block not on the GPU.
        end: the most blocks a hit may reach.

    Returns:
        ``(hit_end, deferred)``: deferred when a key the hit needs is not readable yet.
    """
    first_deferred: list[int] = []
    for g in layout.full_groups:
        n, deferred_at = prefix_scan(lookup_prefix, keys[g][start:end])
        if deferred_at is not None:
            first_deferred.append(start + deferred_at)
        end = start + n
    swa_deferred: dict[int, bool] = {}
    previous = -1
    while layout.swa_groups and end > start and end != previous:
        previous = end  # each SWA group may lower the end: repeat until it is stable
        for g in layout.swa_groups:
            window = layout.window_blocks[g]
            assert window is not None
            end, swa_deferred[g] = window_scan(lookup, keys[g], start, end, window)
    deferred = any(i < end for i in first_deferred) or (end > start and any(swa_deferred.values()))
    return end, deferred


def promoting_hit_end(
    layout: GroupLayout,
    probe: LookupFn,
    lookup: LookupFn,
    keys: Sequence[Sequence[OffloadKey]],
    start: int,
    end: int,
) -> tuple[int, bool]:
    """``lookup_hit_end``, promoting only the keys the hit loads.

    The hit is found with ``probe`` (``OffloadingManager.probe``: a key only a slower tier
    holds answers None and is not promoted); then ``lookup`` is called for the keys of
    ``GroupLayout.load_keys`` that the probe answered None, which promotes those. A lookup that
    answers False (no room in the faster tier) makes that key a miss, and the hit is found
    again with it; the keys looked up before it stay promoted (rare: the faster tier is full of
    pinned blocks). Each key is probed and looked up at most once per call.

    Returns:
        ``(hit_end, deferred)`` as ``lookup_hit_end``.
    """
    answers: dict[OffloadKey, bool | None] = {}

    def probe_once(key: OffloadKey) -> bool | None:
        if key in answers:
            return answers[key]
        result = answers[key] = probe(key)
        return result

    looked_up: set[OffloadKey] = set()
    while True:
        hit_end, deferred = lookup_hit_end(
            layout, probe_once, one_by_one(probe_once), keys, start, end
        )
        refused = False
        for key in layout.load_keys(keys, start, hit_end):
            if answers.get(key) is None and key not in looked_up:
                looked_up.add(key)
                result = answers[key] = lookup(key)
                if result is False:
                    # The hit ends earlier now: promote nothing more before finding it again.
                    refused = True
                    break
        if not refused:
            return hit_end, deferred
