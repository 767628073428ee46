# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Build script: the Python package, plus the CUDA copy library from ``csrc/`` when possible.

The CUDA library is a plain C shared library (loaded with ctypes by ``vllm.kv_copy.cuda_library``,
behind ``vllm._custom_ops``), built with CMake and nvcc alone: it needs no CUDA build of torch.
Environment variables:

* ``VLLM_KV_OFFLOAD_CPU_ONLY=1``: never build it (the torch copy path is used at run time).
* ``VLLM_KV_OFFLOAD_REQUIRE_CUDA=1``: fail the install if it cannot be built (used by CI).
* ``VLLM_KV_OFFLOAD_CUDA_ARCHS``: CUDA architectures, CMake syntax (default ``80;90``).
* ``CUDACXX`` (an nvcc) / ``CUDA_HOME`` (a toolkit directory): the toolkit to build with. Its CUDA
  runtime is linked statically, so the driver must support that CUDA version (CUDA 13: R580 or
  newer); for an older driver, point these at an older toolkit (README.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _find_nvcc() -> str | None:
    candidates = [os.environ.get("CUDACXX")]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for cand in candidates:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


class CMakeExtension(Extension):
    """An extension whose shared library is produced by CMake from ``csrc/``."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures and builds ``CMakeLists.txt``, placing the library where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        require = _env_flag("VLLM_KV_OFFLOAD_REQUIRE_CUDA")
        try:
            self._build_cmake(ext)
        except (OSError, subprocess.CalledProcessError, RuntimeError) as exc:
            if require:
                raise
            print(
                f"WARNING: building the CUDA copy library failed ({exc}); "
                "continuing without it (the torch copy path will be used).",
                file=sys.stderr,
            )

    def _build_cmake(self, ext: Extension) -> None:
        nvcc = _find_nvcc()
        cmake = shutil.which("cmake")
        if nvcc is None or cmake is None:
            raise RuntimeError(f"need nvcc and cmake (nvcc={nvcc}, cmake={cmake})")
        out_path = Path(self.get_ext_fullpath(ext.name)).resolve()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        archs = os.environ.get("VLLM_KV_OFFLOAD_CUDA_ARCHS", "80;90")
        subprocess.check_call(
            [
                cmake,
                "-S",
                str(ROOT),
                "-B",
                str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release",
                f"-DCMAKE_CUDA_COMPILER={nvcc}",
                f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
                f"-DKVO_OUTPUT_DIR={out_path.parent}",
                f"-DKVO_OUTPUT_NAME={out_path.name}",
            ]
        )
        jobs = str(os.cpu_count() or 1)
        subprocess.check_call([cmake, "--build", str(build_dir), "--parallel", jobs])
        if not out_path.is_file():
            raise RuntimeError(f"CMake finished but {out_path} was not produced")


def _ext_modules() -> list[Extension]:
    if _env_flag("VLLM_KV_OFFLOAD_CPU_ONLY"):
        print("VLLM_KV_OFFLOAD_CPU_ONLY is set: skipping the CUDA copy library.", file=sys.stderr)
        return []
    if _find_nvcc() is None and not _env_flag("VLLM_KV_OFFLOAD_REQUIRE_CUDA"):
        print("No CUDA toolkit (nvcc) found: skipping the CUDA copy library.", file=sys.stderr)
        return []
    return [CMakeExtension("vllm._kv_offload_cuda")]


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": CMakeBuild})
