# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``setup.py``: when ``pip install`` builds the CUDA copy library, and when it skips it."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

from tests.subprocesses import run_python

REPO = Path(__file__).resolve().parents[1]
NVCC = "/usr/local/cuda/bin/nvcc"


def _setup_script() -> ModuleType:
    # Imported under another name than __main__: its setup() call does not run.
    spec = importlib.util.spec_from_file_location("kvo_setup_under_test", REPO / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_driver_skips_the_build_unless_cuda_is_required() -> None:
    skip = _setup_script().cuda_skip_reason
    assert skip({}, NVCC, driver=True) is None
    no_driver = skip({}, NVCC, driver=False)
    assert no_driver is not None
    assert no_driver.startswith("No NVIDIA driver (libcuda.so.1 cannot be loaded)")
    # CI compile-checks csrc/ on a machine without a GPU: required means built (or failed).
    assert skip({"VLLM_KV_OFFLOAD_REQUIRE_CUDA": "1"}, NVCC, driver=False) is None
    assert skip({"VLLM_KV_OFFLOAD_REQUIRE_CUDA": "1"}, None, driver=False) is None
    assert str(skip({}, None, driver=True)).startswith("No CUDA toolkit (nvcc) found")
    cpu_only = {"VLLM_KV_OFFLOAD_CPU_ONLY": "1", "VLLM_KV_OFFLOAD_REQUIRE_CUDA": "1"}
    assert skip(cpu_only, NVCC, driver=True) == "VLLM_KV_OFFLOAD_CPU_ONLY is set"


def test_the_install_on_this_machine_says_what_it_skips() -> None:
    # `setup.py --name` makes the same decision as an install (and prints its reason) but builds
    # nothing; what it says follows from this machine's driver (and toolkit).
    script = _setup_script()
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_KV_OFFLOAD_REQUIRE_CUDA", "VLLM_KV_OFFLOAD_CPU_ONLY")
    }
    proc = run_python("setup.py", "--name", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "vllm-kv-offload"
    if script.nvidia_driver_present():
        assert "No NVIDIA driver" not in proc.stderr
        return
    # Without a driver the build is skipped: for want of a toolkit, or (a toolkit but no
    # driver, as on CI's machine and on a CPU-only laptop with CUDA installed) for want of one.
    no_toolkit = "No CUDA toolkit (nvcc) found: skipping the CUDA copy library."
    no_driver = script.cuda_skip_reason(env, "nvcc", driver=False)
    assert no_toolkit in proc.stderr or f"{no_driver}: skipping the CUDA copy library." in (
        proc.stderr
    )
