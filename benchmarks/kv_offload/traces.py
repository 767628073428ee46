# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Seeded block-key traces for the hit-rate benchmark (``bench_hit_rate.py``).

A trace is the sequence of requests that reach the offloading tier, each with the keys it looks up
(its prompt's full blocks, in order) and the keys it then offers to ``prepare_store`` (the full
blocks of its prompt and of its output: chat histories continue from the answer). Keys are built as
the connector builds them: a chain of block hashes (``make_offload_key``), so two requests share a
key exactly when they share the whole token prefix up to that block.

Traces:

* ``cli-chat``, ``cli-system-prompt``, ``cli-documents``, ``cli-mix``: the workloads of the main
  job (``vllm-kv-offload run --workload ...``, ``vllm/entrypoints/cli/workloads.py``), replayed in
  a simulated arrival order: every client runs its sessions one after another, with the workload's
  think times and arrival gaps plus a service time per request, and the clients' requests are
  merged by send time. The model's answers are stand-in tokens (a function of the prompt), as the
  engine's model stand-in would produce.
* ``zipf``: requests for documents of Zipf-distributed popularity, each followed by a short unique
  question.
* ``scan``: the ``zipf`` trace polluted by one-off long scans (unique documents read once).
* ``multi-turn``: many interleaved conversations whose prompts grow turn by turn; conversations
  pause and come back after gaps of every length.

No GPU prefix cache is modelled: every request looks all of its blocks up in the tier.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm.v1.kv_offload.base import OffloadKey, make_offload_key

BLOCK_TOKENS = 16
"""Tokens per offloaded block (the CLI's default block size)."""


@dataclass(frozen=True)
class Request:
    """One request of a trace.

    Attributes:
        lookup: the keys of the prompt's full blocks, in order (what the prefix lookup scans).
        store: the keys offered to ``prepare_store``: ``lookup`` followed by the blocks that the
            output completes (a superset: ``store[: len(lookup)] == lookup``).
    """

    lookup: tuple[OffloadKey, ...]
    store: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class Trace:
    """A named sequence of requests."""

    name: str
    requests: tuple[Request, ...]

    @property
    def num_lookups(self) -> int:
        """Blocks looked up over the whole trace (the hit rate's denominator)."""
        return sum(len(r.lookup) for r in self.requests)

    @property
    def footprint(self) -> int:
        """Distinct keys the trace offers."""
        return len({key for r in self.requests for key in r.store})


def _key(*parts: int) -> OffloadKey:
    """A synthetic key, unique per ``parts`` (a stand-in for a chained block hash)."""
    return make_offload_key(struct.pack(f">{len(parts)}q", *parts), 0)


def _chain(tokens: Sequence[int]) -> list[OffloadKey]:
    """The keys of the full blocks of ``tokens``: each hashes its parent's key and its tokens."""
    keys: list[OffloadKey] = []
    parent = b""
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        block = np.asarray(tokens[start : start + BLOCK_TOKENS], dtype=np.int64).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


# ---------------------------------------------------------------------------------------------
# The main job's workloads
# ---------------------------------------------------------------------------------------------

SERVICE_S = 0.02
"""Simulated time a request takes from send to answer, plus ``SERVICE_S_PER_TOKEN`` per token."""
SERVICE_S_PER_TOKEN = 2e-5


def _stand_in_answer(prompt: Sequence[int], n: int, vocab_size: int) -> list[int]:
    digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return [int(t) for t in rng.integers(1, vocab_size, size=n)]


def cli_trace(kind: str, num_sessions: int, seed: int = 0) -> Trace:
    """The ``vllm-kv-offload run --workload kind`` workload as a trace.

    Args:
        kind: ``chat``, ``system-prompt``, ``documents`` or ``mix``.
        num_sessions: sessions in the workload (the CLI's default is 160).
        seed: the workload's seed.
    """
    from vllm.entrypoints.cli.workloads import WorkloadConfig, WorkloadKind, generate_workload

    config = WorkloadConfig(kind=WorkloadKind(kind), seed=seed, num_sessions=num_sessions)
    workload = generate_workload(config)
    timed: list[tuple[float, int, Request]] = []
    for client in range(config.num_clients):
        clock = 0.0
        for session in workload.sessions_of_client(client):
            history: list[int] = list(session.prefix)
            for t, turn in enumerate(session.turns):
                clock += turn.delay_s
                prompt = session.prompt(t, history)
                answer = _stand_in_answer(prompt, turn.max_tokens, config.vocab_size)
                lookup = _chain(prompt)
                store = _chain([*prompt, *answer])
                timed.append((clock, len(timed), Request(tuple(lookup), tuple(store))))
                clock += SERVICE_S + SERVICE_S_PER_TOKEN * (len(prompt) + len(answer))
                history = [*prompt, *answer]
    timed.sort(key=lambda item: (item[0], item[1]))
    return Trace(f"cli-{kind}", tuple(r for _, _, r in timed))


# ---------------------------------------------------------------------------------------------
# Synthetic traces
# ---------------------------------------------------------------------------------------------

_DOC, _QUESTION, _SCAN, _CONV = 1, 2, 3, 4


def _zipf_ranks(rng: np.random.Generator, n: int, size: int, alpha: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1) ** alpha
    return rng.choice(n, size=size, p=weights / weights.sum())


def zipf_trace(
    num_requests: int = 20_000,
    num_docs: int = 2_000,
    alpha: float = 1.0,
    seed: int = 0,
    scan_every: int = 0,
    scan_blocks: int = 0,
    name: str = "zipf",
) -> Trace:
    """Documents of Zipf(``alpha``) popularity, 4..64 blocks each, plus a unique 1..4-block
    question per request; with ``scan_every > 0``, one request in ``scan_every`` on average is a
    one-off scan of ``scan_blocks`` unique blocks instead."""
    rng = np.random.default_rng(seed)
    doc_blocks = rng.integers(4, 65, size=num_docs)
    ranks = _zipf_ranks(rng, num_docs, num_requests, alpha)
    requests: list[Request] = []
    for i, doc in enumerate(ranks):
        if scan_every and rng.random() < 1.0 / scan_every:
            keys = tuple(_key(_SCAN, i, b) for b in range(scan_blocks))
            requests.append(Request(keys, keys))
            continue
        prefix = [_key(_DOC, int(doc), b) for b in range(int(doc_blocks[doc]))]
        question = [_key(_QUESTION, i, b) for b in range(int(rng.integers(1, 5)))]
        keys = tuple(prefix + question)
        requests.append(Request(keys, keys))
    return Trace(name, tuple(requests))


def scan_trace(num_requests: int = 20_000, seed: int = 1) -> Trace:
    """``zipf`` polluted by scans: one request in 20 reads 256 blocks never read again."""
    return zipf_trace(num_requests, seed=seed, scan_every=20, scan_blocks=256, name="scan")


def multi_turn_trace(num_requests: int = 20_000, active: int = 64, seed: int = 2) -> Trace:
    """Interleaved conversations: each request continues one of ``active`` open conversations
    (chosen uniformly), whose history grows by 2..8 blocks per turn (its answer included); a
    conversation ends after 2..16 turns and a new one (or, one time in four, an old one coming
    back) takes its place."""
    rng = np.random.default_rng(seed)
    lengths: dict[int, int] = {}
    turns_left: dict[int, int] = {}
    open_convs: list[int] = []
    next_conv = 0
    finished: list[int] = []

    def open_one() -> None:
        nonlocal next_conv
        if finished and rng.random() < 0.25:
            conv = finished.pop(int(rng.integers(len(finished))))
        else:
            conv = next_conv
            next_conv += 1
            lengths[conv] = int(rng.integers(2, 9))
        turns_left[conv] = int(rng.integers(2, 17))
        open_convs.append(conv)

    for _ in range(active):
        open_one()
    requests: list[Request] = []
    for _ in range(num_requests):
        slot = int(rng.integers(len(open_convs)))
        conv = open_convs[slot]
        prompt = lengths[conv]
        grown = prompt + int(rng.integers(2, 9))
        lookup = tuple(_key(_CONV, conv, b) for b in range(prompt))
        store = lookup + tuple(_key(_CONV, conv, b) for b in range(prompt, grown))
        requests.append(Request(lookup, store))
        lengths[conv] = grown
        turns_left[conv] -= 1
        if turns_left[conv] == 0:
            open_convs.pop(slot)
            finished.append(conv)
            open_one()
    return Trace("multi-turn", tuple(requests))
