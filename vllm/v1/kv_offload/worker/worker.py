# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Transfer jobs on the worker side: handlers that move bytes, and the worker that routes to them.

A *job* moves the blocks named by a source spec to the blocks named by a destination spec, e.g.
GPU blocks to CPU rows (a store) or back (a load). The connector's worker submits jobs with
``OffloadingWorker.transfer_async`` and polls ``get_finished`` once per engine step; each job is
reported there exactly once, as a ``TransferResult``, whether it succeeded, failed while running,
or could not be submitted at all.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import LoadStoreSpec

logger = init_logger(__name__)

TransferType = tuple[str, str]
"""``(source medium, destination medium)``, e.g. ``("GPU", "CPU")`` for a store."""


class TransferSpec(NamedTuple):
    """What a job moves: from the blocks of ``src`` to the blocks of ``dst``.

    A plain ``(src, dst)`` tuple is accepted wherever a ``TransferSpec`` is.
    """

    src: LoadStoreSpec
    dst: LoadStoreSpec


@dataclass(frozen=True)
class TransferResult:
    """Outcome of one job, reported once by ``get_finished``.

    Attributes:
        job_id: the id the job was submitted with.
        success: whether every byte of the job was written to its destination. On failure the
            destination blocks hold unspecified bytes and must not be read.
        transfer_size: bytes moved (None if unknown or the job failed).
        transfer_time: seconds the transfer took once started (None if unknown or failed).
        transfer_type: ``(source medium, destination medium)`` (None if the job never reached a
            handler, e.g. no handler serves its media).
    """

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None
    transfer_type: TransferType | None = None


class OffloadingHandler(ABC):
    """Moves bytes for jobs of one ``(source medium, destination medium)`` pair.

    Ownership: a handler owns the resources of the jobs it accepted (streams, events, staging
    memory) until it reports them. The caller guarantees that the blocks of an accepted job are
    neither freed nor reused until the job is reported.

    Contract (relied on by ``OffloadingWorker`` to report every job exactly once):

    * ``transfer_async`` either accepts the job (returns True; the job is later reported exactly
      once by ``get_finished``) or does not (returns False or raises; the handler then keeps no
      trace of the job and never reports it).
    * ``get_finished`` reports only accepted jobs, each once.
    """

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start job ``job_id`` without waiting for its bytes to move.

        Args:
            job_id: id of the job, unique among the jobs in flight.
            spec: ``(src, dst)`` specs of the job.

        Returns:
            True if the job was accepted, False if it was not (nothing was started).
        """

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Return the results of accepted jobs that completed since the last call; never blocks."""

    @abstractmethod
    def wait(self, job_ids: Collection[int]) -> None:
        """Block until every accepted, still unreported job of ``job_ids`` has completed.

        Ids this handler does not hold (unknown or already reported) are ignored. The jobs are
        still reported, once, by a later ``get_finished``.
        """

    def shutdown(self) -> None:  # noqa: B027
        """Wait for in-flight jobs and release every resource. Default: no-op.

        Jobs not reported yet are dropped: no ``get_finished`` follows a shutdown.
        """


class OffloadingWorker:
    """Routes each job to the handler registered for its ``(src.medium(), dst.medium())``.

    Every submitted job is reported exactly once by ``get_finished``: the handler's result, or a
    failed result when no handler serves the media, the handler refused the job or raised while
    accepting it. Not thread-safe: one caller thread (the connector's worker side).
    """

    def __init__(self) -> None:
        self._handlers: dict[TransferType, OffloadingHandler] = {}
        # Jobs accepted by a handler and not reported yet, with the handler that holds each.
        self._in_flight: dict[int, OffloadingHandler] = {}
        # Jobs that never reached a handler, reported by the next get_finished.
        self._failed: list[TransferResult] = []
        self._failed_ids: set[int] = set()

    def register_handler(
        self,
        src_cls: type[LoadStoreSpec],
        dst_cls: type[LoadStoreSpec],
        handler: OffloadingHandler,
    ) -> None:
        """Serve jobs from ``src_cls.medium()`` to ``dst_cls.medium()`` with ``handler``.

        Raises:
            ValueError: a handler is already registered for that pair of media.
        """
        key = (src_cls.medium(), dst_cls.medium())
        if key in self._handlers:
            raise ValueError(f"a handler is already registered for transfers {key[0]} -> {key[1]}")
        self._handlers[key] = handler

    @property
    def handlers(self) -> dict[TransferType, OffloadingHandler]:
        """The registered handlers by ``(source medium, destination medium)`` (a copy)."""
        return dict(self._handlers)

    def transfer_async(self, job_id: int, spec: TransferSpec | tuple[LoadStoreSpec, ...]) -> bool:
        """Submit job ``job_id``; it is reported exactly once by a later ``get_finished``.

        Returns:
            True if a handler accepted the job. False if not; a failed ``TransferResult`` for it is
            then already queued for the next ``get_finished`` (callers must not report it again).

        Raises:
            ValueError: ``job_id`` is still in flight (ids must be unique among unreported jobs),
                or ``spec`` is not a ``(src, dst)`` pair; nothing was submitted or queued.
        """
        if job_id in self._in_flight or job_id in self._failed_ids:
            raise ValueError(f"job {job_id} is already in flight")
        if len(spec) != 2:
            raise ValueError(f"job {job_id}: spec must be a (src, dst) pair, got {spec!r}")
        src, dst = spec
        key = (src.medium(), dst.medium())
        handler = self._handlers.get(key)
        if handler is None:
            logger.error("job %d: no handler for transfers %s -> %s", job_id, key[0], key[1])
            self._fail(job_id, None)
            return False
        try:
            accepted = handler.transfer_async(job_id, TransferSpec(src, dst))
        except (ValueError, TypeError) as e:
            # An invalid job (bad ids, counts or specs): nothing was started.
            logger.error("job %d (%s -> %s) rejected: %s", job_id, key[0], key[1], e)
            self._fail(job_id, key)
            return False
        except Exception:
            logger.exception("job %d (%s -> %s): submission failed", job_id, key[0], key[1])
            self._fail(job_id, key)
            return False
        if not accepted:
            logger.warning("job %d (%s -> %s): the handler refused it", job_id, key[0], key[1])
            self._fail(job_id, key)
            return False
        self._in_flight[job_id] = handler
        return True

    def _fail(self, job_id: int, transfer_type: TransferType | None) -> None:
        self._failed.append(TransferResult(job_id, success=False, transfer_type=transfer_type))
        self._failed_ids.add(job_id)

    def get_finished(self) -> list[TransferResult]:
        """Results of jobs finished since the last call (failed submissions first); never blocks."""
        results, self._failed = self._failed, []
        self._failed_ids.clear()
        for handler in self._handlers.values():
            for result in handler.get_finished():
                owner = self._in_flight.pop(result.job_id, None)
                assert owner is handler, (
                    f"job {result.job_id} was reported by {handler!r}, which does not hold it "
                    f"(held by {owner!r})"
                )
                results.append(result)
        return results

    def wait(self, job_ids: Collection[int]) -> None:
        """Block until the listed in-flight jobs completed (others are ignored).

        The jobs are still reported, once, by a later ``get_finished``.
        """
        by_handler: dict[int, tuple[OffloadingHandler, set[int]]] = {}
        for job_id in job_ids:
            handler = self._in_flight.get(job_id)
            if handler is not None:
                by_handler.setdefault(id(handler), (handler, set()))[1].add(job_id)
        for handler, ids in by_handler.values():
            handler.wait(ids)

    def shutdown(self) -> None:
        """Shut every handler down (unreported jobs are dropped) and release them.

        The handlers are dropped too, so the buffers they view (e.g. a shared host region) can be
        released by their owner right after this returns.
        """
        handlers = {id(h): h for h in self._handlers.values()}
        self._handlers.clear()
        for handler in handlers.values():
            handler.shutdown()
        self._in_flight.clear()
        self._failed.clear()
        self._failed_ids.clear()

    def __repr__(self) -> str:
        pairs = ", ".join(f"{s}->{d}" for s, d in self._handlers)
        return f"OffloadingWorker([{pairs}], in_flight={len(self._in_flight)})"
