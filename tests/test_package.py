# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The package refuses to share an environment with upstream vLLM (see ``vllm/__init__.py``)."""

from __future__ import annotations

from importlib import metadata
from typing import Any

import pytest

import vllm


def test_imports_without_upstream_vllm() -> None:
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("vllm")
    vllm._refuse_upstream_vllm()  # nothing to refuse here


def test_upstream_vllm_in_the_environment_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Upstream:
        version = "0.11.0"

    real = metadata.distribution

    def distribution(name: str) -> Any:
        return Upstream() if name == "vllm" else real(name)

    monkeypatch.setattr(metadata, "distribution", distribution)
    with pytest.raises(ImportError) as info:
        vllm._refuse_upstream_vllm()
    message = str(info.value)
    assert "upstream vLLM 0.11.0 is installed" in message
    assert "pip uninstall -y vllm vllm-kv-offload" in message
