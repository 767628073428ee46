# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the seeded workloads in vllm/entrypoints/cli/workloads.py."""

from __future__ import annotations

import dataclasses

import pytest

from vllm.entrypoints.cli.workloads import (
    SessionKind,
    WorkloadConfig,
    WorkloadKind,
    generate_workload,
)


def test_same_seed_same_workload_other_seed_other_tokens() -> None:
    cfg = WorkloadConfig(num_sessions=9, seed=3)
    assert generate_workload(cfg) == generate_workload(cfg)
    other = generate_workload(dataclasses.replace(cfg, seed=4))
    assert (
        other.sessions[0].turns[0].new_tokens
        != generate_workload(cfg).sessions[0].turns[0].new_tokens
    )


def test_mix_holds_every_session_kind_and_clients_share_sessions() -> None:
    cfg = WorkloadConfig(kind=WorkloadKind.MIX, num_sessions=12, num_clients=4)
    wl = generate_workload(cfg)
    assert {s.kind for s in wl.sessions} == set(SessionKind)
    assert wl.num_clients == 4
    assert sorted(s.session_id for c in range(4) for s in wl.sessions_of_client(c)) == sorted(
        s.session_id for s in wl.sessions
    )
    assert wl.num_requests == sum(len(s.turns) for s in wl.sessions)
    assert len({s.session_id for s in wl.sessions}) == len(wl.sessions)


@pytest.mark.parametrize(
    ("kind", "session_kind"),
    [
        (WorkloadKind.CHAT, SessionKind.CHAT),
        (WorkloadKind.SYSTEM_PROMPT, SessionKind.SYSTEM_PROMPT),
        (WorkloadKind.DOCUMENTS, SessionKind.DOCUMENT),
    ],
)
def test_single_kind_workloads(kind: WorkloadKind, session_kind: SessionKind) -> None:
    wl = generate_workload(WorkloadConfig(kind=kind, num_sessions=10, turns_per_session=3))
    assert all(s.kind is session_kind for s in wl.sessions)
    for s in wl.sessions:
        assert 1 <= len(s.turns) <= 3
        assert all(t.max_tokens == wl.config.output_tokens for t in s.turns)
        assert all(t.delay_s >= 0 for t in s.turns)
        assert all(0 < tok < wl.config.vocab_size for t in s.turns for tok in t.new_tokens)


def test_shared_prefixes_are_reused_across_sessions() -> None:
    wl = generate_workload(
        WorkloadConfig(kind=WorkloadKind.DOCUMENTS, num_sessions=20, num_documents=3)
    )
    prefixes = [s.prefix for s in wl.sessions]
    assert len(set(prefixes)) <= 3
    # Skewed popularity: some document is queried by several sessions.
    assert max(prefixes.count(p) for p in set(prefixes)) >= 3
    sp = generate_workload(
        WorkloadConfig(kind=WorkloadKind.SYSTEM_PROMPT, num_sessions=20, num_system_prompts=2)
    )
    assert all(len(s.prefix) == sp.config.system_prompt_tokens for s in sp.sessions)
    assert len({s.prefix for s in sp.sessions}) <= 2


def test_prompts_extend_history_for_chats_and_not_for_documents() -> None:
    wl = generate_workload(WorkloadConfig(kind=WorkloadKind.MIX, num_sessions=3))
    chat = next(s for s in wl.sessions if s.kind is SessionKind.CHAT)
    doc = next(s for s in wl.sessions if s.kind is SessionKind.DOCUMENT)
    first = chat.prompt(0, list(chat.prefix))
    assert first == list(chat.turns[0].new_tokens)
    history = [*first, 7, 8]
    assert chat.prompt(1, history) == [*history, *chat.turns[1].new_tokens]
    assert doc.prompt(1, [1, 2, 3]) == [*doc.prefix, *doc.turns[1].new_tokens]
    assert chat.request_id(2) == f"{chat.session_id}-t2"


@pytest.mark.parametrize(
    "bad",
    [
        {"num_clients": 0},
        {"num_sessions": 0},
        {"seed": -1},
        {"think_time_s": -0.1},
        {"think_time_s": float("inf")},
        {"vocab_size": 1},
    ],
)
def test_invalid_configs_are_rejected(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        WorkloadConfig(**bad)  # type: ignore[arg-type]
