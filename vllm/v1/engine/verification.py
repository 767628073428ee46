# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``KVOracle``: the engine's bit-exact check of KV blocks, recorded during a run and checked
after it.

While the engine serves, the oracle only *records* (a gather and a 128-bit hash per block, on the
engine thread, no comparison):

* the digest of every full block the model computed, the first time it computed it, keyed by
  ``(rank, group, block hash)`` (``BlockKey``; the block hash names the block's whole token
  prefix, so every engine and every run names a block alike);
* with ``VerifyMode.LOADED`` or ``ALL``: the digest of every block a connector load wrote into the
  GPU pool, taken when the load finished (before the request could use or overwrite it);
* with ``VerifyMode.ALL``: also the digest of every full block of every request when it finishes.

``check()`` (after the timed window: ``EngineCore.verify_kv``) compares every recorded digest with
a *reference* digest of the same block: one given by the caller (the digests a no-offload
baseline computed, possibly on other engine instances), else the digest this engine recorded when
it computed the block itself, else an independent recomputation of the block's prefix by the model
(``ModelRunner.reference_blocks``). The models are batch-invariant, so any correct computation of
a block is bit-identical to any other: one differing byte is a fault of the offload path, of a
tier or of the engine. With ``ALL`` the check also compares this engine's computed digests with the
caller's reference (a batch-invariance check across runs) and with each other (the same block
computed twice in one run).

Nothing is recomputed or compared on the engine's step path; a mismatching load is not repaired
(the engine serves what it loaded, as it would without the oracle): it is counted, and a run's
outputs show its effect.

Threading: owned by the engine (engine thread); ``check`` runs there between steps.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.model import block_digests
from vllm.v1.engine.model_runner import ModelRunner
from vllm.v1.request import Request

BlockKey = tuple[int, int, BlockHash]
"""``(worker rank, KV-cache group, hash of the GPU block)``: a block's identity in any engine."""


class VerifyMode(str, enum.Enum):
    """What the oracle checks (``EngineConfig.verify``, ``--verify``)."""

    NONE = "none"
    """Nothing is recorded or checked: a run that cannot say its KV was right."""
    LOADED = "loaded"
    """Every block a connector load wrote into the GPU pool."""
    ALL = "all"
    """Loaded blocks, every full block of every finishing request, and every computed block
    against the caller's reference."""


@dataclass
class VerificationResult:
    """What one ``check()`` found.

    Attributes:
        blocks_checked: recorded blocks compared with a reference (loaded and finished).
        loaded_checked: of them, blocks a load wrote.
        computed_checked: computed blocks compared with the caller's reference or with another
            computation of the same block in this run (``ALL`` only).
        mismatched: checks whose digests differed.
        recomputed: blocks whose reference came from recomputing their prefix.
        mismatched_keys: the keys of the mismatching blocks (first ``MAX_KEYS_KEPT``).
        seconds: wall time of the check.
    """

    blocks_checked: int = 0
    loaded_checked: int = 0
    computed_checked: int = 0
    mismatched: int = 0
    recomputed: int = 0
    mismatched_keys: list[BlockKey] = field(default_factory=list)
    seconds: float = 0.0


MAX_KEYS_KEPT = 100
"""Mismatching keys a ``VerificationResult`` lists (the count is complete)."""


@dataclass
class _Recorded:
    """Digests of one request's blocks taken at one moment (a finished load or a finish)."""

    loaded: bool
    # The request's token list (only ever appended to) and, per entry, (rank, group, logical
    # block index, block hash, digest).
    token_ids: list[int]
    entries: list[tuple[int, int, int, BlockHash, bytes]]


class KVOracle:
    """Records block digests during a run and checks them afterwards (module docstring).

    Args:
        mode: what is recorded and checked (not ``NONE``: then the engine builds no oracle).
        runners: the model runner of every rank, by rank.
        block_sizes: tokens per GPU block, per group.
        hash_block_size: tokens per hashed block of ``Request.block_hashes``.
    """

    def __init__(
        self,
        mode: VerifyMode,
        runners: Sequence[ModelRunner],
        block_sizes: Sequence[int],
        hash_block_size: int,
    ) -> None:
        assert mode is not VerifyMode.NONE, "VerifyMode.NONE records nothing: build no oracle"
        self.mode = mode
        self.runners = list(runners)
        self.block_sizes = tuple(block_sizes)
        self._per_hash = [bs // hash_block_size for bs in self.block_sizes]
        self.computed: dict[BlockKey, bytes] = {}
        # Computed blocks whose hash is not known yet (async scheduling computes a token before
        # the scheduler knows its value): (request, rank, group, index, digest).
        self._pending: list[tuple[Request, int, int, int, bytes]] = []
        # Keys added to ``computed`` since the last check, and those computed again with other
        # bytes (ALL checks both).
        self._new_computed: list[BlockKey] = []
        self._recomputed_differently: list[BlockKey] = []
        self._recorded: list[_Recorded] = []

    # -----------------------------------------------------------------------------------------
    # Recording (engine step path)
    # -----------------------------------------------------------------------------------------

    def _hash(self, request: Request, group: int, index: int) -> BlockHash | None:
        i = (index + 1) * self._per_hash[group] - 1
        return request.block_hashes[i] if i < len(request.block_hashes) else None

    def record_step(
        self,
        so: SchedulerOutput,
        block_ids: Mapping[str, Sequence[Sequence[int]]],
        requests: Mapping[str, Request],
    ) -> None:
        """Record the blocks the step just computed to their end.

        Args:
            so: the step, as executed by every rank.
            block_ids: each scheduled request's block table per group (still allocated).
            requests: the scheduled requests by id.
        """
        before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        todo: list[list[tuple[Request, int, int]]] = [[] for _ in self.block_sizes]
        for req_id, n in so.num_scheduled_tokens.items():
            start = before[req_id]
            for g, bs in enumerate(self.block_sizes):
                for j in range(start // bs, (start + n) // bs):
                    todo[g].append((requests[req_id], j, block_ids[req_id][g][j]))
        for g, items in enumerate(todo):
            if not items:
                continue
            for rank, runner in enumerate(self.runners):
                digests = runner.block_digests(g, [b for _, _, b in items])
                for (request, j, _), digest in zip(items, digests, strict=True):
                    self._pending.append((request, rank, g, j, digest))
        # Resolve what can be: the hash of a block is known once its last token is.
        if len(self._pending) > 4096:
            self._resolve_pending()

    def _resolve_pending(self) -> None:
        unresolved = []
        for request, rank, g, j, digest in self._pending:
            block_hash = self._hash(request, g, j)
            if block_hash is None:
                if not request.is_finished:
                    unresolved.append((request, rank, g, j, digest))
                continue  # finished without that token ever becoming known: nothing to check
            key = (rank, g, block_hash)
            known = self.computed.setdefault(key, digest)
            if known is digest:
                self._new_computed.append(key)
            elif known != digest:
                self._recomputed_differently.append(key)
        self._pending = unresolved

    def record_blocks(
        self, request: Request, pairs: Mapping[int, Sequence[tuple[int, int]]], loaded: bool
    ) -> None:
        """Record the digests of a request's blocks as they are now.

        Args:
            request: the request holding them.
            pairs: ``(logical index, GPU block id)`` per group (full blocks of known tokens).
            loaded: True for blocks a connector load just wrote; False for a finishing
                request's blocks (``ALL``).
        """
        entries: list[tuple[int, int, int, BlockHash, bytes]] = []
        for g, group_pairs in pairs.items():
            known = [(i, b, h) for i, b in group_pairs if (h := self._hash(request, g, i))]
            if not known:
                continue
            for rank, runner in enumerate(self.runners):
                digests = runner.block_digests(g, [b for _, b, _ in known])
                for (i, _, h), digest in zip(known, digests, strict=True):
                    entries.append((rank, g, i, h, digest))
        if entries:
            self._recorded.append(_Recorded(loaded, request.all_token_ids, entries))

    # -----------------------------------------------------------------------------------------
    # Checking (after the timed window)
    # -----------------------------------------------------------------------------------------

    def computed_digests(self) -> dict[BlockKey, bytes]:
        """Digests of every block this engine computed so far (the first time it did), for
        another engine's ``check(reference=...)``."""
        self._resolve_pending()
        return dict(self.computed)

    def check(self, reference: Mapping[BlockKey, bytes] | None = None) -> VerificationResult:
        """Compare everything recorded since the last check with its reference.

        Args:
            reference: digests computed elsewhere (e.g. a baseline run's ``computed_digests``);
                they take precedence over this engine's own.
        """
        t0 = time.perf_counter()
        result = VerificationResult()
        self._resolve_pending()
        reference = reference or {}

        def mismatch(key: BlockKey) -> None:
            result.mismatched += 1
            if len(result.mismatched_keys) < MAX_KEYS_KEPT:
                result.mismatched_keys.append(key)

        recomputed: dict[BlockKey, bytes] = {}
        # Longest prefixes first: one recomputation then serves every shorter one.
        for rec in sorted(self._recorded, key=lambda r: -max(e[2] for e in r.entries)):
            missing: dict[int, dict[int, list[tuple[int, BlockHash]]]] = {}
            for rank, g, i, h, _ in rec.entries:
                key = (rank, g, h)
                if key not in reference and key not in self.computed and key not in recomputed:
                    missing.setdefault(rank, {}).setdefault(g, []).append((i, h))
            for rank, blocks in missing.items():
                ref_blocks = self.runners[rank].reference_blocks(
                    rec.token_ids, {g: [i for i, _ in items] for g, items in blocks.items()}
                )
                for g, items in blocks.items():
                    digests = block_digests(ref_blocks[g])
                    for (_, h), digest in zip(items, digests, strict=True):
                        recomputed[(rank, g, h)] = digest
                    result.recomputed += len(items)
            # A block is checked once, on every rank; it differs if it differs on any.
            blocks_ok: dict[tuple[int, int], BlockKey | None] = {}
            for rank, g, i, h, digest in rec.entries:
                key = (rank, g, h)
                expected = reference.get(key) or self.computed.get(key) or recomputed[key]
                if blocks_ok.setdefault((g, i), None) is None and digest != expected:
                    blocks_ok[(g, i)] = key
            for bad in blocks_ok.values():
                result.blocks_checked += 1
                result.loaded_checked += rec.loaded
                if bad is not None:
                    mismatch(bad)
        self._recorded = []
        new_computed, self._new_computed = self._new_computed, []
        differently, self._recomputed_differently = self._recomputed_differently, []
        if self.mode is VerifyMode.ALL:
            # Per block (group, hash), over every rank, as above.
            computed_ok: dict[tuple[int, BlockHash], BlockKey | None] = {}
            for key in differently:
                computed_ok[key[1:]] = key
            for key in new_computed:
                theirs = reference.get(key)
                if theirs is None or computed_ok.setdefault(key[1:], None) is not None:
                    continue
                if self.computed[key] != theirs:
                    computed_ok[key[1:]] = key
            for bad in computed_ok.values():
                result.computed_checked += 1
                if bad is not None:
                    mismatch(bad)
        result.seconds = time.perf_counter() - t0
        return result
