# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The package refuses to share an environment with upstream vLLM (see ``vllm/__init__.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _import_vllm(*path: Path) -> subprocess.CompletedProcess[str]:
    """``import vllm`` in a fresh interpreter, with ``path`` ahead of this checkout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, [*path, ROOT])))
    return subprocess.run(
        [sys.executable, "-c", "import vllm"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def test_imports_without_upstream_vllm() -> None:
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("vllm")
    result = _import_vllm()
    assert result.returncode == 0, result.stderr


def test_upstream_vllm_in_the_environment_is_refused_with_the_fix(tmp_path: Path) -> None:
    # What pip leaves of an installed upstream vLLM: its distribution's metadata.
    dist_info = tmp_path / "vllm-0.11.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0\n")
    result = _import_vllm(tmp_path)
    assert result.returncode != 0
    assert "ImportError: upstream vLLM 0.11.0 is installed" in result.stderr
    assert "pip uninstall -y vllm vllm-kv-offload" in result.stderr
