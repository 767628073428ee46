# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Build script: the Python package, plus the CUDA copy library from ``csrc/`` when possible.

The CUDA library is a plain C shared library (loaded with ctypes by ``vllm.kv_copy.cuda_library``,
behind ``vllm._custom_ops``), built with CMake and nvcc alone: it needs no CUDA build of torch.
Environment variables:

* ``VLLM_KV_OFFLOAD_CPU_ONLY=1``: never build it (the torch copy path is used at run time).
* ``VLLM_KV_OFFLOAD_REQUIRE_CUDA=1``: fail the install if it cannot be built, and build it even
  where no NVIDIA driver is present (used by CI, which compile-checks ``csrc/``).
* ``VLLM_KV_OFFLOAD_CUDA_ARCHS``: CUDA architectures, CMake syntax (default ``80;90``).
* ``CUDACXX`` (an nvcc) / ``CUDA_HOME`` (a toolkit directory): the toolkit to build with. Its CUDA
  runtime is linked statically, so the driver must support that CUDA version (CUDA 13: R580 or
  newer); for an older driver, point these at an older toolkit (README.md).

Without an NVIDIA driver (``libcuda.so.1`` cannot be loaded: a CPU-only machine that happens to
have a toolkit) the library is not built: it could not run there, and building it takes minutes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


DRIVER_LIBRARY = "libcuda.so.1"
"""The NVIDIA driver's CUDA library: present wherever a CUDA library can run."""


def _env_flag(name: str, env: Mapping[str, str] = os.environ) -> bool:
    return env.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def nvidia_driver_present() -> bool:
    """Whether the NVIDIA driver's CUDA library can be loaded (an NVIDIA driver is installed)."""
    try:
        ctypes.CDLL(DRIVER_LIBRARY)
    except OSError:
        return False
    return True


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
    """Configures and builds ``CMakeLists.txt``, placing the library where setuptools expects it;
    builds the plain C extensions as setuptools does."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            try:
                super().build_extension(ext)
            except Exception as exc:  # a missing compiler or header: the Python path serves
                print(
                    f"WARNING: building {ext.name} failed ({exc}); continuing without it (the "
                    "fs tier makes its system calls from Python).",
                    file=sys.stderr,
                )
            return
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


def cuda_skip_reason(env: Mapping[str, str], nvcc: str | None, driver: bool) -> str | None:
    """Why the CUDA copy library is not built, or None to build it.

    Args:
        env: the environment (the ``VLLM_KV_OFFLOAD_*`` variables).
        nvcc: the toolkit's nvcc, if one was found.
        driver: whether an NVIDIA driver is present (``nvidia_driver_present``).
    """
    if _env_flag("VLLM_KV_OFFLOAD_CPU_ONLY", env):
        return "VLLM_KV_OFFLOAD_CPU_ONLY is set"
    if _env_flag("VLLM_KV_OFFLOAD_REQUIRE_CUDA", env):
        return None  # build, and fail the install if that fails
    if nvcc is None:
        return "No CUDA toolkit (nvcc) found"
    if not driver:
        return (
            f"No NVIDIA driver ({DRIVER_LIBRARY} cannot be loaded), so the library could not run "
            "here; VLLM_KV_OFFLOAD_REQUIRE_CUDA=1 builds it anyway"
        )
    return None


FS_IO_EXTENSION = Extension(
    "vllm._kv_offload_fs_io", sources=["csrc/fs_io.c"], extra_compile_args=["-O2"]
)
"""The fs tier's batched system calls (Linux): a C extension the system's C compiler builds in
about a second; without it the fs tier makes the same calls from Python."""


def _ext_modules() -> list[Extension]:
    modules = [FS_IO_EXTENSION] if sys.platform.startswith("linux") else []
    reason = cuda_skip_reason(os.environ, _find_nvcc(), nvidia_driver_present())
    if reason is not None:
        print(f"{reason}: skipping the CUDA copy library.", file=sys.stderr)
        return modules
    return [*modules, CMakeExtension("vllm._kv_offload_cuda")]


# setuptools runs this file as __main__ (also through pip's build backend); tests import it.
if __name__ == "__main__":
    setup(ext_modules=_ext_modules(), cmdclass={"build_ext": CMakeBuild})
