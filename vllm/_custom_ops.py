# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Batched KV-block copies between GPU KV caches and host memory: the Python face of ``csrc/``.

Two backends implement the same operation with the same semantics and the same argument checks:

* ``"cuda"``: the CUDA copy library built from ``csrc/`` (``vllm/_kv_offload_cuda*.so``), a plain C
  library loaded with ctypes and driven with raw addresses, stream handles and device ordinals. It
  needs no CUDA build of torch. Used when the library is built, its ABI matches and a GPU is
  usable.
* ``"torch"``: host copies (``memmove`` over addresses of torch CPU tensors, on a few threads), used
  when the KV cache itself lives in host memory, as on a CPU-only machine where the "GPU" KV cache
  is a CPU tensor.

``copy_backend()`` says which backend this process would pick (logged once, with the reason when
CUDA is unusable: library missing, no driver, a driver older than the library's CUDA runtime, no
GPU); callers whose memory is on the host use the torch backend whatever it says.

A job is a ``REGION_DTYPE`` array of ``CopyRegion``s sharing two arrays of block ids; the layout of
a region's sides is described in ``vllm.kv_copy.regions``. The implementation lives in the
``vllm.kv_copy`` package; this module re-exports what callers use.
"""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy.typing as npt

from vllm.kv_copy.checks import check_copy_blocks, check_prepared
from vllm.kv_copy.cuda_library import (
    ABI_VERSION,
    HOST_REGISTER_MAPPED,
    HOST_REGISTER_PORTABLE,
    KVO_ERR_CUDA,
    KVO_ERR_INVALID_ARGUMENT,
    KVO_OK,
    CopyMethod,
    CudaCopyLibrary,
    default_library_path,
)
from vllm.kv_copy.cuda_resources import CudaEvent, CudaStream
from vllm.kv_copy.errors import CopyArgumentError, CudaCopyError
from vllm.kv_copy.host_copy import (
    HOST_COPY_THREADS_ENV,
    expand_copies,
    host_copy,
    host_memmove,
    merge_regions,
)
from vllm.kv_copy.method_choice import (
    DEFAULT_DMA_MIN_CHUNK_BYTES,
    CopyMethodPolicy,
    mean_chunk_bytes,
)
from vllm.kv_copy.regions import (
    BLOCK_SIDE_DTYPE,
    REGION_DTYPE,
    BlockSide,
    CopyRegion,
    IdArray,
    RegionArray,
    as_ids,
    as_regions,
    check_pair_counts,
    make_regions,
)
from vllm.logger import init_logger

__all__ = [
    # operations and backend queries
    "copy_blocks",
    "copy_backend",
    "cuda_library",
    "cuda_devices",
    "CudaDevices",
    "check_copy_blocks",
    "expand_copies",
    "host_copy",
    "host_memmove",
    "mean_chunk_bytes",
    "merge_regions",
    # job description
    "BlockSide",
    "CopyRegion",
    "make_regions",
    "BLOCK_SIDE_DTYPE",
    "REGION_DTYPE",
    "RegionArray",
    "IdArray",
    # CUDA library
    "CopyMethod",
    "CopyMethodPolicy",
    "DEFAULT_DMA_MIN_CHUNK_BYTES",
    "CudaCopyLibrary",
    "CudaStream",
    "CudaEvent",
    "default_library_path",
    "ABI_VERSION",
    "KVO_OK",
    "KVO_ERR_INVALID_ARGUMENT",
    "KVO_ERR_CUDA",
    "HOST_REGISTER_PORTABLE",
    "HOST_REGISTER_MAPPED",
    # errors and settings
    "CopyArgumentError",
    "CudaCopyError",
    "LIBRARY_ENV",
    "BACKEND_ENV",
    "HOST_COPY_THREADS_ENV",
]

logger = init_logger(__name__)

LIBRARY_ENV: Final = "VLLM_KV_OFFLOAD_CUDA_LIB"
"""Path of the CUDA copy library to load instead of the one in the ``vllm`` package."""

BACKEND_ENV: Final = "VLLM_KV_OFFLOAD_COPY_BACKEND"
"""``auto`` (default), ``torch`` (never use CUDA) or ``cuda`` (fail if CUDA is unusable)."""


@dataclass(frozen=True)
class CudaDevices:
    """What the CUDA copy library can use in this process (``cuda_devices``).

    Attributes:
        count: GPUs visible to the library; 0 when it is missing or CUDA is unusable.
        problem: why ``count`` is 0 (empty otherwise), e.g. a driver older than the library's
            CUDA runtime.
    """

    count: int
    problem: str


_lock = threading.Lock()
_library_loaded = False
_library: CudaCopyLibrary | None = None
_library_problem = "not loaded yet"
_devices: CudaDevices | None = None


def cuda_library() -> CudaCopyLibrary | None:
    """The loaded CUDA copy library, or None if it is not built or cannot be loaded.

    The path is ``$VLLM_KV_OFFLOAD_CUDA_LIB`` if set, else the library in the ``vllm`` package
    (``default_library_path``). Loaded once per process; a GPU is not needed (argument checks
    work without one).
    """
    global _library_loaded, _library, _library_problem
    with _lock:
        if not _library_loaded:
            _library_loaded = True
            env = os.environ.get(LIBRARY_ENV)
            path = Path(env) if env else default_library_path()
            if path is None:
                _library_problem = "the CUDA copy library is not built (no vllm/_kv_offload_cuda*)"
            else:
                try:
                    _library = CudaCopyLibrary(path)
                    _library_problem = ""
                except (OSError, RuntimeError, AttributeError) as e:
                    _library_problem = f"cannot load {path}: {e}"
        return _library


def cuda_devices() -> CudaDevices:
    """How many GPUs the CUDA copy library can use, and why none when it is 0. Never raises.

    Decided once per process (CUDA fixes the visible devices at initialisation).
    """
    global _devices
    lib = cuda_library()
    with _lock:
        if _devices is None:
            if lib is None:
                _devices = CudaDevices(0, _library_problem)
            else:
                try:
                    count = lib.device_count()
                    problem = "" if count else f"{lib.path} is loaded but CUDA reports no GPU"
                    _devices = CudaDevices(count, problem)
                except CudaCopyError as e:
                    _devices = CudaDevices(0, f"{lib.path} cannot use CUDA: {e}")
        return _devices


@functools.cache
def copy_backend() -> str:
    """Which backend this process uses for device memory: ``"cuda"`` or ``"torch"``.

    ``"cuda"`` when the library is loaded and sees a GPU, unless ``VLLM_KV_OFFLOAD_COPY_BACKEND``
    is ``torch``; otherwise ``"torch"``. Decided and logged once per process, with the reason
    (``copy_backend.cache_clear()`` makes the next call decide again, e.g. after the
    environment changed).

    Raises:
        ValueError: ``VLLM_KV_OFFLOAD_COPY_BACKEND`` has an unknown value.
        RuntimeError: ``VLLM_KV_OFFLOAD_COPY_BACKEND=cuda`` but CUDA is unusable (the message says
            why, e.g. a driver older than the library's CUDA runtime).
    """
    wanted = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if wanted not in ("auto", "torch", "cuda"):
        raise ValueError(f"{BACKEND_ENV}={wanted!r}: expected auto, torch or cuda")
    backend = "torch"
    if wanted == "torch":
        reason = f"{BACKEND_ENV}=torch"
    else:
        lib = cuda_library()
        devices = cuda_devices()
        if lib is not None and devices.count > 0:
            backend = "cuda"
            batch = "available" if lib.dma_batch_available() else "unavailable (loop fallback)"
            reason = f"{lib.path}, {devices.count} GPU(s), cuMemcpyBatchAsync {batch}"
        else:
            reason = devices.problem
        if wanted == "cuda" and backend != "cuda":
            raise RuntimeError(f"{BACKEND_ENV}=cuda but the CUDA backend is unusable: {reason}")
    logger.info("KV offload copy backend: %s (%s)", backend, reason)
    return backend


def copy_blocks(
    regions: RegionArray,
    src_ids: npt.ArrayLike,
    dst_ids: npt.ArrayLike,
    *,
    backend: str | None = None,
    device: int | None = None,
    method: CopyMethod = CopyMethod.DMA,
    stream: int = 0,
    max_ctas: int = 0,
) -> None:
    """Copy every pair of every region of one job (layouts: ``vllm.kv_copy.regions``).

    For each region ``r`` and pair ``p`` in ``[r.pair_begin, r.pair_begin + r.pair_count)``:
    ``r.bytes`` bytes move from ``r.src.address(src_ids[p])`` to ``r.dst.address(dst_ids[p])``.
    Copies of one call may run in any order and concurrently.

    Args:
        regions: ``REGION_DTYPE`` array (``make_regions``) of R regions.
        src_ids, dst_ids: 1-D integer arrays of P ids each.
        backend: ``"cuda"`` or ``"torch"``; default ``copy_backend()``. The torch backend needs
            every address to be valid host memory of this process.
        device: CUDA backend only, required: the ordinal of the device that ``stream`` belongs
            to and that runs the copies (made current on the calling thread).
        method: CUDA backend only: DMA (default), DMA_LOOP or KERNEL (``CopyMethod``).
        stream: CUDA backend only: the ``cudaStream_t`` handle to enqueue on (0: legacy default
            stream). The call is then asynchronous: the bytes have moved once work recorded on
            ``stream`` after it completes; until then the memory must stay valid and untouched.
            The torch backend returns after the last byte is copied.
        max_ctas: CUDA kernel path only: most thread blocks (0: library default, 16).

    Raises:
        CopyArgumentError: invalid arguments (the same checks on both backends); nothing moved.
        CudaCopyError: a CUDA call failed.
    """
    regions = as_regions(regions)
    src = as_ids(src_ids, "src_ids")
    dst = as_ids(dst_ids, "dst_ids")
    check_pair_counts(src, dst)
    chosen = backend or copy_backend()
    if chosen == "cuda":
        if device is None:
            raise CopyArgumentError("the CUDA backend needs device= (the stream's device)")
        lib = cuda_library()
        if lib is None:
            raise RuntimeError(f"the CUDA copy backend is unavailable: {_library_problem}")
        lib.copy_blocks(device, regions, src, dst, method, max_ctas, stream)
    elif chosen == "torch":
        check_prepared(regions, src, dst)
        host_copy(regions, src, dst)
    else:
        raise ValueError(f"backend={chosen!r}: expected 'cuda' or 'torch'")
