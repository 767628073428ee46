# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Seeded, reproducible serving workloads for ``vllm-kv-offload run``.

A workload is a fixed list of *sessions* spread over concurrent *clients*. A session is a
sequence of requests (turns) that share a prefix:

* ``chat``: a multi-turn conversation; every turn's prompt is the whole history so far (earlier
  prompts and the model's answers) plus the user's new message, with think time between turns.
* ``system-prompt``: short conversations that all start with one of a few long system prompts.
* ``documents``: a long document queried several times; each query is the document plus a
  question (no history), and popular documents are queried by several sessions.
* ``mix``: the three kinds interleaved.

Everything here is a pure function of ``WorkloadConfig`` (numpy's PCG64 stream is stable across
platforms and versions), so the baseline run and the offloaded run of one invocation, and two
invocations with the same seed, replay the same token ids. Only the model's answers (appended to
chat histories) come from the engine, and the engine's model stand-in is deterministic too.
Arrival *times* are real time, so interleavings depend on the machine's speed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm.utils.field_checks import check_at_least

TokenIds = tuple[int, ...]


class WorkloadKind(str, enum.Enum):
    """The workload shapes ``--workload`` selects."""

    CHAT = "chat"
    SYSTEM_PROMPT = "system-prompt"
    DOCUMENTS = "documents"
    MIX = "mix"


class SessionKind(str, enum.Enum):
    """The shape of one session (a ``mix`` workload holds all three)."""

    CHAT = "chat"
    SYSTEM_PROMPT = "system-prompt"
    DOCUMENT = "document"


@dataclass(frozen=True)
class WorkloadConfig:
    """Size and shape of a workload; every count is validated in ``__post_init__``.

    Attributes:
        kind: which workload to build.
        seed: seed of every random choice (token ids, lengths, think times, arrivals).
        num_clients: concurrent clients; session ``i`` belongs to client ``i % num_clients`` and a
            client runs its sessions one after another.
        num_sessions: sessions in the whole workload.
        turns_per_session: requests per session (chat turns, document queries).
        turn_tokens: mean length of a user message or question (uniform in [0.5x, 1.5x]).
        output_tokens: tokens generated per request (``max_tokens``).
        system_prompt_tokens: length of each shared system prompt.
        num_system_prompts: distinct system prompts (popularity is skewed: the first is the most
            used).
        document_tokens: mean length of a document (uniform in [0.75x, 1.25x]).
        num_documents: distinct documents (skewed popularity, as for system prompts).
        think_time_s: mean think time between two turns of a session (exponential).
        arrival_interval_s: mean gap between the starts of a client's sessions (exponential).
        vocab_size: token ids are drawn from ``[1, vocab_size)``.
    """

    kind: WorkloadKind = WorkloadKind.MIX
    seed: int = 0
    num_clients: int = 12
    num_sessions: int = 160
    turns_per_session: int = 4
    turn_tokens: int = 48
    output_tokens: int = 8
    system_prompt_tokens: int = 384
    num_system_prompts: int = 3
    document_tokens: int = 1024
    num_documents: int = 16
    think_time_s: float = 0.05
    arrival_interval_s: float = 0.05
    vocab_size: int = 32000

    def __post_init__(self) -> None:
        if not isinstance(self.kind, WorkloadKind):
            raise ValueError(f"kind must be a WorkloadKind, got {self.kind!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        check_at_least(
            self,
            (
                "num_clients",
                "num_sessions",
                "turns_per_session",
                "turn_tokens",
                "output_tokens",
                "system_prompt_tokens",
                "num_system_prompts",
                "document_tokens",
                "num_documents",
            ),
        )
        for name in ("think_time_s", "arrival_interval_s"):
            value = getattr(self, name)
            if not (value >= 0 and np.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        check_at_least(self, ("vocab_size",), 2)


@dataclass(frozen=True)
class Turn:
    """One request of a session.

    Attributes:
        new_tokens: the user's message (chat) or question (document) appended to the prompt.
        max_tokens: tokens to generate.
        delay_s: time the client waits before sending this turn (think time; for a session's
            first turn, the arrival gap before the session starts).
    """

    new_tokens: TokenIds
    max_tokens: int
    delay_s: float


@dataclass(frozen=True)
class Session:
    """A sequence of requests that share a prefix.

    Attributes:
        session_id: unique within the workload; request ids are ``f"{session_id}-t{turn}"``.
        kind: the session's shape.
        client: index of the client that runs it.
        prefix: tokens every prompt of the session starts with (a system prompt or a document;
            empty for a plain chat).
        turns: the requests, in order.
        keeps_history: True if each prompt extends the previous prompt and its answer (chat);
            False if each prompt is ``prefix + turn.new_tokens`` (document queries).
    """

    session_id: str
    kind: SessionKind
    client: int
    prefix: TokenIds
    turns: tuple[Turn, ...]
    keeps_history: bool

    def request_id(self, turn_idx: int) -> str:
        """The request id of turn ``turn_idx``."""
        return f"{self.session_id}-t{turn_idx}"

    def prompt(self, turn_idx: int, history: Sequence[int]) -> list[int]:
        """The prompt of turn ``turn_idx``.

        Args:
            turn_idx: index into ``turns``.
            history: for a session that keeps history, the previous turn's prompt followed by its
                output tokens (``prefix`` for the first turn); ignored otherwise.
        """
        new = self.turns[turn_idx].new_tokens
        if self.keeps_history:
            return [*history, *new]
        return [*self.prefix, *new]


@dataclass(frozen=True)
class Workload:
    """A generated workload: sessions grouped by client, in each client's order."""

    config: WorkloadConfig
    sessions: tuple[Session, ...]

    @property
    def num_requests(self) -> int:
        """Requests in the whole workload."""
        return sum(len(s.turns) for s in self.sessions)

    def sessions_of_client(self, client: int) -> list[Session]:
        """The sessions client ``client`` runs, in order."""
        return [s for s in self.sessions if s.client == client]

    @property
    def num_clients(self) -> int:
        """Clients that run at least one session."""
        return len({s.client for s in self.sessions})


WORKLOAD_DEFAULTS: dict[WorkloadKind, dict[str, int]] = {
    WorkloadKind.CHAT: {"num_clients": 32},
    WorkloadKind.SYSTEM_PROMPT: {"num_clients": 32, "num_system_prompts": 12},
}
"""Defaults of ``WorkloadConfig`` fields that differ by workload kind (the command applies them
unless the user sets the field).

Each workload's defaults make its working set larger than the command's default GPU pool (256
blocks), so that offloading is exercised: 12 chats of at most 20 blocks fit in the pool and would
never need a block back from the CPU tier, 32 do not; 3 system prompts of 24 blocks stay hot in
the pool, 12 (with skewed popularity) do not. ``mix`` and ``documents`` need no change: documents
of 48 to 80 blocks, 16 of them, overflow the pool already.
"""


def max_request_tokens(config: WorkloadConfig) -> int:
    """An upper bound of the tokens (prompt and output) of any request of the workload.

    The engine must be able to hold one such request in its GPU pool.
    """
    turn = math.ceil(config.turn_tokens * 1.5)
    per_turn = turn + config.output_tokens
    bounds: list[int] = []
    kinds = set(_session_kinds(config))
    if SessionKind.CHAT in kinds:
        bounds.append(config.turns_per_session * per_turn)
    if SessionKind.SYSTEM_PROMPT in kinds:
        bounds.append(config.system_prompt_tokens + config.turns_per_session * per_turn)
    if SessionKind.DOCUMENT in kinds:
        bounds.append(math.ceil(config.document_tokens * 1.25) + per_turn)
    return max(bounds)


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> TokenIds:
    return tuple(int(t) for t in rng.integers(1, vocab_size, size=n))


def _jitter(rng: np.random.Generator, mean: int, spread: float) -> int:
    return max(1, round(mean * rng.uniform(1.0 - spread, 1.0 + spread)))


def _skewed_choice(rng: np.random.Generator, n: int) -> int:
    # Zipf-like popularity (weight 1/(i+1)): a few prompts or documents are hot, the rest warm.
    weights = 1.0 / np.arange(1, n + 1)
    return int(rng.choice(n, p=weights / weights.sum()))


_MIX_ORDER = (SessionKind.CHAT, SessionKind.DOCUMENT, SessionKind.SYSTEM_PROMPT)


def _session_kinds(config: WorkloadConfig) -> list[SessionKind]:
    if config.kind is WorkloadKind.MIX:
        return [_MIX_ORDER[i % len(_MIX_ORDER)] for i in range(config.num_sessions)]
    single = {
        WorkloadKind.CHAT: SessionKind.CHAT,
        WorkloadKind.SYSTEM_PROMPT: SessionKind.SYSTEM_PROMPT,
        WorkloadKind.DOCUMENTS: SessionKind.DOCUMENT,
    }[config.kind]
    return [single] * config.num_sessions


def generate_workload(config: WorkloadConfig) -> Workload:
    """Build the workload ``config`` describes; a pure function of ``config``."""
    rng = np.random.Generator(np.random.PCG64(config.seed))
    # Shared material first, so that its token ids do not depend on the session mix.
    system_prompts = [
        _tokens(rng, config.system_prompt_tokens, config.vocab_size)
        for _ in range(config.num_system_prompts)
    ]
    documents = [
        _tokens(rng, _jitter(rng, config.document_tokens, 0.25), config.vocab_size)
        for _ in range(config.num_documents)
    ]
    sessions: list[Session] = []
    for idx, kind in enumerate(_session_kinds(config)):
        if kind is SessionKind.CHAT:
            prefix: TokenIds = ()
        elif kind is SessionKind.SYSTEM_PROMPT:
            prefix = system_prompts[_skewed_choice(rng, config.num_system_prompts)]
        else:
            prefix = documents[_skewed_choice(rng, config.num_documents)]
        # System-prompt conversations are short (1..turns), the others use every turn.
        num_turns = (
            int(rng.integers(1, config.turns_per_session + 1))
            if kind is SessionKind.SYSTEM_PROMPT
            else config.turns_per_session
        )
        turns = []
        for t in range(num_turns):
            mean_gap = config.arrival_interval_s if t == 0 else config.think_time_s
            turns.append(
                Turn(
                    new_tokens=_tokens(
                        rng, _jitter(rng, config.turn_tokens, 0.5), config.vocab_size
                    ),
                    max_tokens=config.output_tokens,
                    delay_s=float(rng.exponential(mean_gap)) if mean_gap > 0 else 0.0,
                )
            )
        sessions.append(
            Session(
                session_id=f"s{idx:04d}-{kind.value}",
                kind=kind,
                client=idx % config.num_clients,
                prefix=prefix,
                turns=tuple(turns),
                keeps_history=kind is not SessionKind.DOCUMENT,
            )
        )
    return Workload(config=config, sessions=tuple(sessions))
