# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Fleet secrets written to key files, for the tiers' keyed-integrity tests (fs, redis and the
block format)."""

from __future__ import annotations

from pathlib import Path

SECRET = b"fleet secret \x00\x01\x02 binary bytes"


def key_file(
    tmp_path: Path, secret: bytes = SECRET, name: str = "fleet.key", mode: int = 0o600
) -> str:
    """Write ``secret`` to ``tmp_path / name`` with permissions ``mode``; return its path."""
    path = tmp_path / name
    path.write_bytes(secret)
    path.chmod(mode)
    return str(path)
