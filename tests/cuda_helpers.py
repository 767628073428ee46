# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Test support for the CUDA copy library without a CUDA build of torch: device memory and
synchronous copies through the library's test-support entry points (``csrc/kv_offload.h``, "Test
support"), which the offload path does not use and ``vllm.kv_copy.cuda_library`` does not bind.

Also imported by ``benchmarks/kv_offload/bench_copy.py`` (run with the repository root on
``PYTHONPATH``).
"""

from __future__ import annotations

import ctypes
from typing import Any, Final

import numpy as np
import numpy.typing as npt
from typing_extensions import Self, override

from vllm import _custom_ops as ops
from vllm.kv_copy.cuda_library import CudaCopyLibrary

_c_int = ctypes.c_int
_c_uint64 = ctypes.c_uint64

TEST_SIGNATURES: Final[dict[str, tuple[Any, list[Any]]]] = {
    "kvo_device_malloc": (_c_int, [_c_int, _c_uint64, ctypes.POINTER(_c_uint64)]),
    "kvo_device_free": (_c_int, [_c_int, _c_uint64]),
    "kvo_memcpy_sync": (_c_int, [_c_int, _c_uint64, _c_uint64, _c_uint64]),
    "kvo_memset_sync": (_c_int, [_c_int, _c_uint64, _c_int, _c_uint64]),
}


def declare_test_entry_points(lib: CudaCopyLibrary) -> None:
    """Set the ctypes signatures of the test-support entry points on ``lib.raw`` (idempotent)."""
    for name, (restype, argtypes) in TEST_SIGNATURES.items():
        fn = getattr(lib.raw, name)
        fn.restype = restype
        fn.argtypes = argtypes


def memcpy_sync(lib: CudaCopyLibrary, device: int, dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from ``src`` to ``dst`` (any memory), returning once they are copied."""
    declare_test_entry_points(lib)
    lib.check(lib.raw.kvo_memcpy_sync(device, dst, src, nbytes), "kvo_memcpy_sync")


def memset_sync(lib: CudaCopyLibrary, device: int, ptr: int, value: int, nbytes: int) -> None:
    """Set ``nbytes`` of device memory at ``ptr`` to ``value``, returning once done."""
    declare_test_entry_points(lib)
    lib.check(lib.raw.kvo_memset_sync(device, ptr, value, nbytes), "kvo_memset_sync")


class DeviceBuffer:
    """``nbytes`` of memory on ``device`` (``cudaMalloc``), freed by ``close``.

    Attributes:
        device: the device ordinal.
        ptr: device address of the first byte.
        nbytes: size in bytes.
    """

    def __init__(self, lib: CudaCopyLibrary, nbytes: int, device: int = 0) -> None:
        declare_test_entry_points(lib)
        self._lib = lib
        self.device = device
        self.nbytes = nbytes
        out = _c_uint64(0)
        lib.check(lib.raw.kvo_device_malloc(device, nbytes, ctypes.byref(out)), "kvo_device_malloc")
        self.ptr = int(out.value)

    def copy_from_host(self, src: npt.NDArray[Any], offset: int = 0) -> None:
        """Synchronously copy the bytes of host array ``src`` to ``ptr + offset``."""
        data = np.ascontiguousarray(src)
        if offset < 0 or offset + data.nbytes > self.nbytes:
            raise ValueError(f"{data.nbytes} bytes at offset {offset} overrun {self!r}")
        if data.nbytes:
            memcpy_sync(
                self._lib, self.device, self.ptr + offset, int(data.ctypes.data), data.nbytes
            )

    def copy_to_host(self, dst: npt.NDArray[Any], offset: int = 0) -> None:
        """Synchronously copy ``dst.nbytes`` bytes at ``ptr + offset`` into contiguous ``dst``."""
        if not dst.flags.c_contiguous:
            raise ValueError("dst must be C-contiguous")
        if offset < 0 or offset + dst.nbytes > self.nbytes:
            raise ValueError(f"{dst.nbytes} bytes at offset {offset} overrun {self!r}")
        if dst.nbytes:
            memcpy_sync(self._lib, self.device, int(dst.ctypes.data), self.ptr + offset, dst.nbytes)

    def close(self) -> None:
        """Free the memory (idempotent)."""
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self._lib.check(self._lib.raw.kvo_device_free(self.device, ptr), "kvo_device_free")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @override
    def __repr__(self) -> str:
        return f"DeviceBuffer(cuda:{self.device}, ptr={self.ptr:#x}, nbytes={self.nbytes})"


def torch_cuda_problem() -> str:
    """Why tests over torch CUDA tensors cannot run here, or "" when they can (torch sees a GPU
    and the CUDA copy library can use one)."""
    import torch

    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    devices = ops.cuda_devices()
    if devices.count == 0:
        return f"the CUDA copy library cannot use a GPU: {devices.problem}"
    return ""
