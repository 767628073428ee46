# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A child Python process for the tests that need a fresh interpreter (``-O``, ``-X importtime``,
the command line as a user starts it, an environment of its own)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: Path | str = REPO,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run this interpreter with ``args`` in ``cwd`` (the repository by default), its output
    captured as text; a non-zero exit is returned, not raised."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
