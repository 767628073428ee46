# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""ctypes binding of the CUDA copy library built from ``csrc/`` (C API: ``csrc/kv_offload.h``).

The library is a plain C shared library: every call takes raw addresses, stream and event handles
as integers, and the ordinal of the device it acts on (it never relies on the calling thread's
current device, see "Devices" in the header). Loading it needs no GPU or driver; argument checks
then work, and every call that needs CUDA raises ``CudaCopyError``.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import os
from pathlib import Path
from typing import Any, Final

import numpy as np

from vllm.kv_copy.errors import CopyArgumentError, CudaCopyError
from vllm.kv_copy.regions import REGION_DTYPE, IdArray, RegionArray, check_pair_counts

ABI_VERSION: Final = 3
"""The ``KVO_ABI_VERSION`` this module was written for; another version is refused."""

KVO_OK: Final = 0
KVO_ERR_INVALID_ARGUMENT: Final = 1
KVO_ERR_CUDA: Final = 2

HOST_REGISTER_PORTABLE: Final = 1
HOST_REGISTER_MAPPED: Final = 2

TEST_BATCH_RESULT_ENV: Final = "VLLM_KV_OFFLOAD_TEST_BATCH_RESULT"
"""Test hook read by the library: every ``cuMemcpyBatchAsync`` call "fails" with this CUresult."""


class CopyMethod(enum.Enum):
    """How the CUDA backend moves bytes (``KvoCopyMethod``); the torch backend ignores it."""

    DMA = 0
    """Copy engines: one ``cuMemcpyBatchAsync`` per job when the driver has it (and the stream is
    not the legacy default stream), else one ``cudaMemcpyAsync`` per (merged) copy. A batch call
    the driver refuses for reasons of the batch API is resubmitted as the loop (counted by
    ``CudaCopyLibrary.dma_batch_fallbacks``)."""

    DMA_LOOP = 1
    """Copy engines, always one ``cudaMemcpyAsync`` per (merged) copy."""

    KERNEL = 2
    """A copy kernel on a bounded number of thread blocks over device-mapped pinned host memory:
    for jobs of many small pages. Host memory must be registered with ``HOST_REGISTER_MAPPED``."""


def default_library_path(directory: Path | None = None) -> Path | None:
    """The built library in ``directory`` (default: the ``vllm`` package directory), if any.

    ``_kv_offload_cuda<this interpreter's extension suffix>`` first (what ``pip install`` builds),
    else any ``_kv_offload_cuda*.so``: the library has no Python ABI, so one built for another
    interpreter works as well.
    """
    here = directory or Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        cand = here / f"_kv_offload_cuda{suffix}"
        if cand.is_file():
            return cand
    return next(iter(sorted(here.glob("_kv_offload_cuda*.so"))), None)


_c_void_p = ctypes.c_void_p
_c_int = ctypes.c_int
_c_int64 = ctypes.c_int64
_c_uint64 = ctypes.c_uint64

SIGNATURES: Final[dict[str, tuple[Any, list[Any]]]] = {
    "kvo_abi_version": (_c_int, []),
    "kvo_copy_region_size": (_c_int, []),
    "kvo_last_error": (ctypes.c_char_p, []),
    "kvo_device_count": (_c_int, [ctypes.POINTER(_c_int)]),
    "kvo_dma_batch_available": (_c_int, [ctypes.POINTER(_c_int)]),
    "kvo_dma_batch_fallbacks": (_c_int, [ctypes.POINTER(_c_uint64), ctypes.c_char_p, _c_uint64]),
    "kvo_check_copy_blocks": (_c_int, [_c_void_p, _c_int64, _c_void_p, _c_void_p, _c_int64]),
    "kvo_copy_blocks": (
        _c_int,
        [_c_int, _c_void_p, _c_int64, _c_void_p, _c_void_p, _c_int64, _c_int, _c_int, _c_void_p],
    ),
    "kvo_stream_create": (_c_int, [_c_int, ctypes.POINTER(_c_void_p), _c_int]),
    "kvo_stream_destroy": (_c_int, [_c_int, _c_void_p]),
    "kvo_stream_synchronize": (_c_int, [_c_int, _c_void_p]),
    "kvo_stream_wait_event": (_c_int, [_c_int, _c_void_p, _c_void_p]),
    "kvo_event_create": (_c_int, [_c_int, ctypes.POINTER(_c_void_p), _c_int]),
    "kvo_event_destroy": (_c_int, [_c_int, _c_void_p]),
    "kvo_event_record": (_c_int, [_c_int, _c_void_p, _c_void_p]),
    "kvo_event_query": (_c_int, [_c_int, _c_void_p, ctypes.POINTER(_c_int)]),
    "kvo_event_synchronize": (_c_int, [_c_int, _c_void_p]),
    "kvo_event_elapsed_ms": (
        _c_int,
        [_c_int, _c_void_p, _c_void_p, ctypes.POINTER(ctypes.c_float)],
    ),
    "kvo_host_register": (
        _c_int,
        [_c_int, _c_void_p, _c_uint64, ctypes.c_uint, ctypes.POINTER(_c_int)],
    ),
    "kvo_host_unregister": (_c_int, [_c_int, _c_void_p]),
}
"""ctypes signatures of the entry points the offload path uses. The library's test-support entry
points (device memory, synchronous copies) are declared by ``tests/cuda_helpers.py``."""


def _ptr(arr: np.ndarray) -> int | None:
    return int(arr.ctypes.data) if arr.size else None


class CudaCopyLibrary:
    """ctypes binding of the CUDA copy library; every method raises on a non-OK status.

    ``raw`` is the ``ctypes.CDLL`` with argument types set (the status codes themselves; the
    methods below turn them into exceptions). Loading needs no GPU or driver: argument checks
    work anywhere.

    Every method that uses CUDA takes ``device``, the ordinal of the device it acts on; the
    library makes it current on the calling thread first (and leaves it current). Streams and
    events passed in must belong to that device.

    Raises (constructor):
        OSError: the file cannot be loaded.
        AttributeError: an entry point is missing (a library of another version).
        RuntimeError: the ABI version or the region layout differs from this module's.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        self.raw = ctypes.CDLL(self.path)
        version = int(self.raw.kvo_abi_version())
        if version != ABI_VERSION:
            raise RuntimeError(
                f"{self.path} has ABI version {version}, this module needs {ABI_VERSION}: "
                "rebuild it (pip install -e . or cmake, see README.md)"
            )
        for name, (restype, argtypes) in SIGNATURES.items():
            fn = getattr(self.raw, name)
            fn.restype = restype
            fn.argtypes = argtypes
        region_size = int(self.raw.kvo_copy_region_size())
        if region_size != REGION_DTYPE.itemsize:
            raise RuntimeError(
                f"{self.path}: sizeof(KvoCopyRegion)={region_size} but REGION_DTYPE has "
                f"{REGION_DTYPE.itemsize} bytes"
            )

    def last_error(self) -> str:
        """The library's message for the last failed call on this thread."""
        msg = self.raw.kvo_last_error()
        return msg.decode(errors="replace") if msg else ""

    def check(self, status: int, what: str) -> None:
        """Raise the error matching ``status`` (from a call named ``what``), if not OK."""
        if status == KVO_OK:
            return
        msg = f"{what}: {self.last_error()}"
        if status == KVO_ERR_INVALID_ARGUMENT:
            raise CopyArgumentError(msg)
        raise CudaCopyError(msg)

    # -- devices ---------------------------------------------------------------------------------

    def device_count(self) -> int:
        """GPUs the CUDA runtime sees (0 when the driver works but reports none).

        Raises:
            CudaCopyError: CUDA is unusable, e.g. no driver or a driver older than the CUDA
                runtime the library was built with; the message names the CUDA error and both
                CUDA versions.
        """
        n = _c_int(0)
        self.check(self.raw.kvo_device_count(ctypes.byref(n)), "kvo_device_count")
        return n.value

    def dma_batch_available(self) -> bool:
        """Whether the driver provides ``cuMemcpyBatchAsync`` (one call per DMA job)."""
        a = _c_int(0)
        self.check(self.raw.kvo_dma_batch_available(ctypes.byref(a)), "kvo_dma_batch_available")
        return bool(a.value)

    def dma_batch_fallbacks(self) -> tuple[int, str]:
        """``(DMA jobs whose batch call was refused and ran as a loop, the first refusal's text)``.

        Counted since the library was loaded, over every caller in the process.
        """
        count = _c_uint64(0)
        reason = ctypes.create_string_buffer(512)
        self.check(
            self.raw.kvo_dma_batch_fallbacks(ctypes.byref(count), reason, len(reason)),
            "kvo_dma_batch_fallbacks",
        )
        return int(count.value), reason.value.decode(errors="replace")

    # -- copies ----------------------------------------------------------------------------------

    def check_copy_blocks(self, regions: RegionArray, src_ids: IdArray, dst_ids: IdArray) -> None:
        """``kvo_check_copy_blocks`` on prepared arrays (see ``checks.check_copy_blocks``)."""
        check_pair_counts(src_ids, dst_ids)
        self.check(
            self.raw.kvo_check_copy_blocks(
                _ptr(regions), len(regions), _ptr(src_ids), _ptr(dst_ids), len(src_ids)
            ),
            "kvo_check_copy_blocks",
        )

    def copy_blocks(
        self,
        device: int,
        regions: RegionArray,
        src_ids: IdArray,
        dst_ids: IdArray,
        method: CopyMethod,
        max_ctas: int,
        stream: int,
    ) -> None:
        """Enqueue one job on ``stream`` of ``device`` (``kvo_copy_blocks``; prepared arrays).

        See ``vllm._custom_ops.copy_blocks`` for the semantics: asynchronous, the memory must
        stay valid and untouched until work recorded on ``stream`` after this call completes.
        """
        check_pair_counts(src_ids, dst_ids)
        self.check(
            self.raw.kvo_copy_blocks(
                device,
                _ptr(regions),
                len(regions),
                _ptr(src_ids),
                _ptr(dst_ids),
                len(src_ids),
                method.value,
                max_ctas,
                stream or None,
            ),
            "kvo_copy_blocks",
        )

    # -- streams and events (see cuda_resources for owning wrappers) ------------------------------

    def stream_create(self, device: int, priority: int = 0) -> int:
        h = _c_void_p()
        self.check(
            self.raw.kvo_stream_create(device, ctypes.byref(h), priority), "kvo_stream_create"
        )
        return int(h.value or 0)

    def stream_destroy(self, device: int, stream: int) -> None:
        self.check(self.raw.kvo_stream_destroy(device, stream or None), "kvo_stream_destroy")

    def stream_synchronize(self, device: int, stream: int) -> None:
        self.check(
            self.raw.kvo_stream_synchronize(device, stream or None), "kvo_stream_synchronize"
        )

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        self.check(
            self.raw.kvo_stream_wait_event(device, stream or None, event or None),
            "kvo_stream_wait_event",
        )

    def event_create(self, device: int, enable_timing: bool = True) -> int:
        h = _c_void_p()
        self.check(
            self.raw.kvo_event_create(device, ctypes.byref(h), int(enable_timing)),
            "kvo_event_create",
        )
        return int(h.value or 0)

    def event_destroy(self, device: int, event: int) -> None:
        self.check(self.raw.kvo_event_destroy(device, event or None), "kvo_event_destroy")

    def event_record(self, device: int, event: int, stream: int) -> None:
        self.check(
            self.raw.kvo_event_record(device, event or None, stream or None), "kvo_event_record"
        )

    def event_query(self, device: int, event: int) -> bool:
        done = _c_int(0)
        self.check(
            self.raw.kvo_event_query(device, event or None, ctypes.byref(done)), "kvo_event_query"
        )
        return bool(done.value)

    def event_synchronize(self, device: int, event: int) -> None:
        self.check(self.raw.kvo_event_synchronize(device, event or None), "kvo_event_synchronize")

    def event_elapsed_ms(self, device: int, start: int, end: int) -> float:
        ms = ctypes.c_float(0.0)
        self.check(
            self.raw.kvo_event_elapsed_ms(device, start or None, end or None, ctypes.byref(ms)),
            "kvo_event_elapsed_ms",
        )
        return float(ms.value)

    # -- host memory -----------------------------------------------------------------------------

    def host_register(self, device: int, ptr: int, nbytes: int, flags: int) -> bool:
        """Pin ``[ptr, ptr + nbytes)``; False if it was already registered (not ours to undo)."""
        already = _c_int(0)
        self.check(
            self.raw.kvo_host_register(device, ptr or None, nbytes, flags, ctypes.byref(already)),
            "kvo_host_register",
        )
        return not already.value

    def host_unregister(self, device: int, ptr: int) -> None:
        """Unpin a range this library pinned (``host_register`` returned True for it)."""
        self.check(self.raw.kvo_host_unregister(device, ptr or None), "kvo_host_unregister")

    def __repr__(self) -> str:
        return f"CudaCopyLibrary({self.path!r})"
