# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""CUDA streams and events owned by Python objects, for callers without a CUDA build of torch.

Each object is bound to one device: every call on it passes that device to the library, so it
works from any thread (see "Devices" in ``csrc/kv_offload.h``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from typing_extensions import override

from vllm.kv_copy.cuda_library import CudaCopyLibrary


class _OwnedHandle(ABC):
    """A CUDA object of one device, owned by this object until ``close`` destroys it.

    Attributes:
        device: the device ordinal the object belongs to.
        handle: the object's handle as an int (0 once closed).
    """

    def __init__(self, lib: CudaCopyLibrary, device: int, handle: int) -> None:
        self._lib = lib
        self.device = device
        self.handle = handle

    @abstractmethod
    def _destroy(self, handle: int) -> None:
        """Destroy the library object ``handle`` (called once, by ``close``)."""

    def close(self) -> None:
        """Destroy the object (idempotent)."""
        if self.handle:
            handle, self.handle = self.handle, 0
            self._destroy(handle)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cuda:{self.device}, {self.handle:#x})"


class CudaStream(_OwnedHandle):
    """A non-blocking CUDA stream on ``device``, owned by this object (destroyed by ``close``;
    work still pending on it then completes).

    Attributes:
        device: the device ordinal the stream belongs to.
        handle: the ``cudaStream_t`` as an int (0 once closed).
    """

    def __init__(self, lib: CudaCopyLibrary, device: int, priority: int = 0) -> None:
        super().__init__(lib, device, lib.stream_create(device, priority))

    def wait_event(self, event: CudaEvent) -> None:
        """Make later work on this stream wait for ``event``'s last record."""
        self._lib.stream_wait_event(self.device, self.handle, event.handle)

    def synchronize(self) -> None:
        """Block until all work enqueued on the stream is complete."""
        self._lib.stream_synchronize(self.device, self.handle)

    @override
    def _destroy(self, handle: int) -> None:
        self._lib.stream_destroy(self.device, handle)


class CudaEvent(_OwnedHandle):
    """A CUDA event on ``device``, owned by this object (destroyed by ``close``).

    Attributes:
        device: the device ordinal the event belongs to.
        handle: the ``cudaEvent_t`` as an int (0 once closed).
    """

    def __init__(self, lib: CudaCopyLibrary, device: int, enable_timing: bool = True) -> None:
        super().__init__(lib, device, lib.event_create(device, enable_timing))

    def record(self, stream: int) -> None:
        """Record on the stream with handle ``stream`` of this event's device (0: legacy)."""
        self._lib.event_record(self.device, self.handle, stream)

    def query(self) -> bool:
        """True when the work of the last record is complete (raises if it failed)."""
        return self._lib.event_query(self.device, self.handle)

    def synchronize(self) -> None:
        """Block until the work of the last record is complete."""
        self._lib.event_synchronize(self.device, self.handle)

    def elapsed_ms(self, end: CudaEvent) -> float:
        """Milliseconds from this (completed) event to ``end``."""
        return self._lib.event_elapsed_ms(self.device, self.handle, end.handle)

    @override
    def _destroy(self, handle: int) -> None:
        self._lib.event_destroy(self.device, handle)
