# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``RequestOffloadState``: what the scheduler-side connector tracks for one request.

Besides the request's progress (what was offered to ``prepare_store``, what its lookups found
being promoted, its jobs in flight), the state maps the request's offloaded blocks to their keys
and GPU blocks (what a step may store, and the GPU blocks of what the manager accepted), and
turns its finished load job into a ``LoadResult`` (the engine's view of it, defined with the
connector interface in ``kv_connector.v1.base``).

Block geometry: an *offloaded block* holds ``B = offloaded_block_size`` tokens, i.e.
``factor[g] = B // gpu_block_size[g]`` GPU blocks of KV-cache group ``g``. The key of offloaded
block ``i`` in group ``g`` is ``make_offload_key(block_hashes[(i + 1) * B // h - 1], g)``, where
``h`` is the request's hash block size: the hash of the last hashed block it covers, which covers
the whole token prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import LoadResult, PromotedBlock
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import JobId
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.groups import (
    GroupLayout,
    LookupFn,
    PrefixLookupFn,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.transfer_jobs import (
    GPUBlockRef,
    TransferJobStatus,
)
from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.request import Request


@dataclass(eq=False)
class RequestOffloadState:
    """What the connector tracks for one request, from first sight until it is dropped.

    A request's state is dropped once the request finished and none of its jobs is in flight.

    Attributes:
        req: the engine's request (read-only here).
        layout: the run's KV-cache groups and block sizes (shared by every request).
        hashes_per_block: hashed blocks of ``req.block_hashes`` per offloaded block.
        req_context: the one ``ReqContext`` used for all of the request's manager calls.
        offloading_context: the manager's policy for the request.
        offload_keys: per group, the keys of the request's full offloaded blocks (extended
            lazily as the request's block hashes grow, by ``extend_offload_keys``).
        block_ids: per group, the GPU block ids the request holds, in logical order.
        next_stored_block_idx: offloaded blocks below this index were already offered to
            ``prepare_store`` (or were loaded, under BLOCK_LEVEL).
        num_locally_computed_tokens: tokens served by the GPU prefix cache at the latest
            (re)start of the request.
        expect_fresh_alloc: set by a lookup; the next ``update_state_after_alloc`` is a (re)start
            whose block list replaces the previous one.
        promoted_keys: keys whose lookup said "not readable yet" while no store job of this
            connector was writing them: they were being promoted from a secondary tier, with
            the tier's type name when the manager told it (``promotion_source``); see
            ``lookup_fn`` for the notes without a tier.
        transfer_jobs: ids of the request's jobs in flight.
        finished: ``request_finished`` was called.
        guard_decided: the tiers whose part of the hit the load guard already let the request
            load since its lookups began to wait (a deferred lookup is repeated every step; the
            decision is made once).
        lookup_deferred: a lookup of this request answered "ask again next step" at least once
            because a tier could not answer yet (counted once per request:
            ``deferred_lookup_requests``).
        transfer_waited: a lookup answered so at least once because the blocks were being
            moved (counted once per request: ``transfer_wait_requests``).
        waiting_on_lookup: the last lookup pass met a key no tier could answer for yet (set by
            ``lookup_fn``'s lookups, read when the pass is deferred).
    """

    req: Request
    layout: GroupLayout
    hashes_per_block: int
    req_context: ReqContext
    offloading_context: RequestOffloadingContext
    offload_keys: list[list[OffloadKey]] = field(init=False)
    block_ids: list[list[int]] = field(init=False)
    next_stored_block_idx: int = 0
    num_locally_computed_tokens: int = 0
    expect_fresh_alloc: bool = False
    promoted_keys: dict[OffloadKey, str | None] = field(default_factory=dict)
    transfer_jobs: set[JobId] = field(default_factory=set)
    finished: bool = False
    guard_decided: set[str] = field(default_factory=set)
    lookup_deferred: bool = False
    transfer_waited: bool = False
    waiting_on_lookup: bool = False

    def __post_init__(self) -> None:
        num_groups = len(self.layout.gpu_block_sizes)
        self.offload_keys = [[] for _ in range(num_groups)]
        self.block_ids = [[] for _ in range(num_groups)]

    def extend_offload_keys(self) -> int:
        """Extend the keys to every full offloaded block; return their count."""
        hashes = self.req.block_hashes
        step = self.hashes_per_block
        num_blocks = len(hashes) // step
        keys0 = self.offload_keys[0]
        if len(keys0) < num_blocks:
            new_hashes = [hashes[(i + 1) * step - 1] for i in range(len(keys0), num_blocks)]
            for g, keys in enumerate(self.offload_keys):
                keys.extend(make_offload_key(h, g) for h in new_hashes)
        return num_blocks

    def offloadable_end(self, num_computed: int, num_scheduled: int, prompt_only: bool) -> int:
        """The end (exclusive, in offloaded blocks) of the blocks that may be stored once a step
        computing ``num_scheduled`` tokens after ``num_computed`` ends: full blocks with keys, of
        the prompt only if ``prompt_only``. Extends the keys as the block hashes grew."""
        req = self.req
        num_offloadable = min(num_computed + num_scheduled, req.num_tokens)
        if prompt_only:
            num_offloadable = min(num_offloadable, req.num_prompt_tokens)
        block_size = self.layout.offloaded_block_size
        return min(num_offloadable // block_size, self.extend_offload_keys())

    def num_tokens_in_blocks(self) -> int:
        """Tokens the request's recorded GPU blocks hold, in the group that holds fewest."""
        return min(
            len(ids) * size
            for ids, size in zip(self.block_ids, self.layout.gpu_block_sizes, strict=True)
        )

    def store_gpu_indices(
        self, keys_to_store: Sequence[OffloadKey], start: int, end: int
    ) -> list[list[int]]:
        """Per group, the indices (into ``block_ids``) of ``keys_to_store``, which
        ``prepare_store`` picked among the keys of offloaded blocks ``[start, end)`` and returned
        in group order."""
        # Position of each offered key: (group, offloaded block index).
        position = {
            key: (g, i)
            for g, group_keys in enumerate(self.offload_keys)
            for i, key in enumerate(group_keys[start:end], start)
        }
        layout = self.layout
        gpu_indices: list[list[int]] = [[] for _ in layout.gpu_block_sizes]
        last_group = 0
        for key in keys_to_store:
            g, i = position[key]
            assert g >= last_group, (
                f"request {self.req.request_id}: prepare_store returned keys out of group order "
                f"(key {key.hex()} of group {g} after group {last_group})"
            )
            last_group = g
            factor = layout.offloaded_block_size // layout.gpu_block_sizes[g]
            gpu_indices[g].extend(range(i * factor, (i + 1) * factor))
        return gpu_indices

    def gpu_spec(
        self, blocks_per_group: Sequence[Sequence[int]]
    ) -> tuple[GPULoadStoreSpec, list[GPUBlockRef]]:
        """GPU spec for logical GPU block indices ``blocks_per_group[g]`` of each group.

        Within a group the indices must be increasing; ``block_indices[g]`` is the first one.

        Returns:
            The spec, and the ``(group, GPU block id)`` of each of its blocks.
        """
        flat: list[int] = []
        refs: list[GPUBlockRef] = []
        sizes: list[int] = []
        firsts: list[int] = []
        for g, indices in enumerate(blocks_per_group):
            table = self.block_ids[g]
            assert not indices or indices[-1] < len(table), (
                f"request {self.req.request_id}: group {g} block index {indices[-1]} beyond its "
                f"{len(table)} GPU blocks"
            )
            ids = [table[i] for i in indices]
            flat.extend(ids)
            refs.extend((g, b) for b in ids)
            sizes.append(len(ids))
            firsts.append(indices[0] if indices else 0)
        return GPULoadStoreSpec(flat, sizes, firsts), refs

    def note_promoted(self, key: OffloadKey, tier: str | None) -> None:
        """Remember that ``key`` is being promoted for this request (from ``tier`` if known).

        A lookup may answer "not readable yet" before the tier's probe came back (no tier
        known yet) and again once the promotion started: a known tier is never forgotten.
        """
        if tier is not None or key not in self.promoted_keys:
            self.promoted_keys[key] = tier

    def probe_fn(self, manager: OffloadingManager) -> LookupFn:
        """``manager.probe`` for this request (``groups.promoting_hit_end``).

        A probe starts no promotion, so a None notes nothing (the lookup that follows for a
        key the hit loads does); a True or False drops a note without a tier, as ``lookup_fn``.
        """
        ctx = self.req_context
        probe = manager.probe
        promoted = self.promoted_keys

        def probe_key(key: OffloadKey) -> bool | None:
            result = probe(key, ctx)
            if result is not None and promoted and key in promoted and promoted[key] is None:
                del promoted[key]
            return result

        return probe_key

    def lookup_fn(
        self, manager: OffloadingManager, is_being_stored: Callable[[OffloadKey], bool]
    ) -> LookupFn:
        """``manager.lookup`` for this request, noting the keys found being promoted, and whether
        a key's answer is still due from a tier (``waiting_on_lookup``, reset here for the pass).

        A key whose lookup answers "not readable yet" while no store job writes it
        (``is_being_stored``) is noted with ``manager.promotion_source``. A note without a tier
        is only a candidate: a tier's answer may still be on its way (the redis tier answers a
        lookup it cannot decide a step later), and the block may then arrive some other way
        (another request's store from the GPU). When a later lookup finds such a key readable
        or absent and no tier was named meanwhile, the note is dropped: its tokens count as the
        CPU tier's, never as an unnamed tier's.
        """
        lookup = manager.lookup
        ctx = self.req_context
        note = self._answer_noter(manager, is_being_stored)

        def lookup_key(key: OffloadKey) -> bool | None:
            result = lookup(key, ctx)
            note(key, result)
            return result

        return lookup_key

    def lookup_prefix_fn(
        self, manager: OffloadingManager, is_being_stored: Callable[[OffloadKey], bool]
    ) -> PrefixLookupFn:
        """``manager.lookup_prefix`` for this request, noting its answers as ``lookup_fn``
        notes each (and resetting ``waiting_on_lookup`` for the pass, as it does)."""
        lookup_prefix = manager.lookup_prefix
        ctx = self.req_context
        promoted = self.promoted_keys
        note = self._answer_noter(manager, is_being_stored)

        def lookup_keys(keys: Sequence[OffloadKey]) -> list[bool | None]:
            results = lookup_prefix(keys, ctx)
            # Readable keys note nothing unless a promotion of them was noted before.
            if promoted or None in results:
                for key, result in zip(keys, results, strict=False):
                    note(key, result)
            return results

        return lookup_keys

    def _answer_noter(
        self, manager: OffloadingManager, is_being_stored: Callable[[OffloadKey], bool]
    ) -> Callable[[OffloadKey, bool | None], None]:
        """What ``lookup_fn`` and ``lookup_prefix_fn`` do with each key's answer (see
        ``lookup_fn``); starts the pass (``waiting_on_lookup`` reset)."""
        promotion_source = manager.promotion_source
        promoted = self.promoted_keys
        note_promoted = self.note_promoted

        self.waiting_on_lookup = False

        def note(key: OffloadKey, result: bool | None) -> None:
            if result is None and not is_being_stored(key):
                tier = promotion_source(key)
                note_promoted(key, tier)
                if tier is None:  # no promotion (yet): a tier's answer is on its way
                    self.waiting_on_lookup = True
            elif result is not None and promoted and key in promoted and promoted[key] is None:
                del promoted[key]

        return note

    def finish_load(
        self,
        job: TransferJobStatus,
        stored_keys: set[OffloadKey] | None = None,
        group_block_bytes: Sequence[int] = (),
    ) -> LoadResult:
        """The outcome of the request's load ``job``, every worker having reported it.

        Forgets ``promoted_keys``: they concern this load only (a request loads at most once
        per (re)start).

        Args:
            job: the finished load job.
            stored_keys: the keys this connector stored so far, when it tracks them.
            group_block_bytes: per group, the bytes a load of one key moves
                (``OffloadingSpec.group_block_bytes``); empty: ``promoted_bytes`` is not counted.
        """
        block_size = self.layout.offloaded_block_size
        start_tok, end_tok = job.token_range
        first = start_tok // block_size
        # Every group's keys of a block, not job.keys: an SWA group loads only its window.
        num_blocks = -(-end_tok // block_size) - first
        promoted = self.promoted_keys
        promoted_tokens = 0
        blocks: list[PromotedBlock] = []
        for i in range(first, first + num_blocks):
            # The first group whose key of block i was promoted (an SWA group may not be).
            key = next((keys[i] for keys in self.offload_keys if keys[i] in promoted), None)
            if key is None:
                continue
            lo, hi = max(i * block_size, start_tok), min((i + 1) * block_size, end_tok)
            promoted_tokens += hi - lo
            stored_here = None if stored_keys is None else key in stored_keys
            blocks.append(PromotedBlock(lo, hi, promoted[key], key, stored_here))
        promoted_bytes: dict[str | None, int] = {}
        if promoted and group_block_bytes and job.success:
            for key in job.keys:
                if key in promoted:
                    tier = promoted[key]
                    n = group_block_bytes[get_offload_group_idx(key)]
                    promoted_bytes[tier] = promoted_bytes.get(tier, 0) + n
        promoted.clear()
        return LoadResult(
            job.req_id,
            num_blocks,
            end_tok - start_tok,
            promoted_tokens,
            job.success,
            tuple(blocks),
            promoted_bytes,
        )
