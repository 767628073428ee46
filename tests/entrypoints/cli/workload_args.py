# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The tiny workload the CLI tests run (a few seconds on 2 CPU cores), and a child's environment.

Documents of 12-20 blocks and a 24-block GPU pool: a document asked for again after another one
was read is no longer on the GPU; the CPU tier (32 rows) holds about two documents, so it serves
some of those and the fs tier the others. Each test module picks the clients, sessions, pacing
and timeout it needs (``workload_args``).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
"""The checkout under test (put first on a child process's ``PYTHONPATH``)."""


def tiny_workload(*, turns: int = 2, documents: int = 4) -> list[str]:
    """The tiny workload's shape and the model stand-in's geometry, without clients or pacing."""
    return [
        "--workload",
        "documents",
        "--turns",
        str(turns),
        "--document-tokens",
        "256",
        "--num-documents",
        str(documents),
        "--turn-tokens",
        "16",
        "--output-tokens",
        "3",
        "--num-layers",
        "2",
        "--head-size",
        "16",
        "--gpu-blocks",
        "24",
        "--max-num-seqs",
        "3",
        "--max-num-batched-tokens",
        "128",
        "--cpu-bytes",
        "128KiB",
    ]


TINY_WORKLOAD = tiny_workload()


def workload_args(
    *,
    clients: int,
    sessions: int,
    think_time: float,
    timeout: float,
    turns: int = 2,
    documents: int = 4,
) -> list[str]:
    """``tiny_workload`` with its clients, sessions, think time and ``--timeout`` (seconds)."""
    return [
        *tiny_workload(turns=turns, documents=documents),
        "--num-clients",
        str(clients),
        "--num-sessions",
        str(sessions),
        "--think-time",
        str(think_time),
        "--timeout",
        str(timeout),
    ]


def command_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a child process running the command.

    This checkout comes first on ``PYTHONPATH``, the fs tier's default root is under
    ``tmp_path`` (``XDG_CACHE_HOME``), and ``extra`` is added.
    """
    env = dict(os.environ)
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env
