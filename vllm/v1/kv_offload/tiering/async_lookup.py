# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Answer a secondary tier's lookups in the step that asks when the tier can know, else from a
background thread, one batch per scheduler step.

A tier whose presence check is slow (a filesystem ``stat``, a remote ``EXISTS``) must not run it
on the scheduler thread. ``AsyncLookupManager`` is composed *inside* such a tier; the tier
delegates (``tier_plumbing.AsyncLookupTier`` does it):

* ``SecondaryTierManager.lookup``              -> ``AsyncLookupManager.lookup``
* ``SecondaryTierManager.on_schedule_end``     -> ``AsyncLookupManager.flush``
* ``SecondaryTierManager.on_request_finished`` -> ``AsyncLookupManager.cleanup(req_id)``
* ``SecondaryTierManager.shutdown``            -> ``AsyncLookupManager.shutdown``

A lookup first asks the hook ``answer_now``: a tier with a local view (the fs tier's index of
the files it wrote and found; a cache of keys a server confirmed) answers True or False there,
at once, whenever that view can decide. Only a key it cannot decide is *deferred*: the lookup
returns None ("ask again next step") and queues the key. At the end of the step ``flush()`` posts
every key queued during the step as ONE work item; the background thread resolves it (one
``batch_lookup`` call per request) while the model runs, and a later step's ``lookup`` returns
True or False. ``counters()`` counts the requests that asked and those a lookup deferred.

Threading: every dict and set below is owned by the scheduler thread, so ``lookup``/``flush``/
``cleanup`` take no lock. The two threads only exchange whole lists through a ``SimpleQueue``
(scheduler -> worker) and a ``deque`` (worker -> scheduler). A per-key generation number makes
results of probes that were superseded (the key was dropped and asked again, or its answer was
forced with ``mark_miss``/``mark_present``) recognisable, and such stale results are discarded.
"""

from __future__ import annotations

import collections
import enum
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

logger = init_logger(__name__)

# One queued probe: the key, the request that asked first, and the state's generation.
_BatchItem = tuple[OffloadKey, ReqContext, int]
# One answer from the worker thread: the key, the generation it was asked under, and presence.
_ResultItem = tuple[OffloadKey, int, bool]


class _Phase(enum.Enum):
    PENDING = enum.auto()
    """Queued in this step's batch; not posted to the worker yet."""
    IN_FLIGHT = enum.auto()
    """Posted to the worker; the answer has not been applied yet."""
    RESOLVED = enum.auto()
    """``result`` holds the answer."""


@dataclass(slots=True)
class _LookupState:
    generation: int
    phase: _Phase
    result: bool | None = None
    request_ids: set[str] = field(default_factory=set)


class AsyncLookupManager(ABC):
    """Resolves key-presence probes on a daemon thread, batched per scheduler step.

    Subclasses implement ``batch_lookup`` and may override the hooks ``answer_now`` (answer
    from a local view, on the scheduler thread) and ``step_lookup`` (answer a whole step in one
    round trip). Every other method must be called from the scheduler thread (the thread that
    owns the tier); none of them blocks except ``shutdown`` and ``wait_idle``.

    A key's state lives while at least one request refers to it, or while a probe for it is in
    flight (a request that finishes does not cancel a probe that others may share). Once no
    request refers to a resolved key, its state is dropped and the next lookup probes again.

    The worker thread starts in ``__init__`` but calls ``batch_lookup`` only for batches posted
    by ``flush()``, so a subclass may set the attributes ``batch_lookup`` uses before or after
    calling ``super().__init__()``.

    Attributes:
        name: used in the worker thread's name, ``vllm_offloading_lookup_{name}``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        # Scheduler-thread state (no lock: only the scheduler thread touches it).
        self._lookup_state: dict[OffloadKey, _LookupState] = {}
        self._req_keys: dict[str, set[OffloadKey]] = {}
        self._lookup_batch: list[_BatchItem] = []
        self._next_generation = 0
        self._num_posted = 0
        self._closed = False
        # Requests that asked, and those a lookup deferred, until cleanup (for the counters).
        self._asked: set[str] = set()
        self._deferred: set[str] = set()
        self._num_requests = 0
        self._num_deferred_requests = 0
        self._num_deferred_keys = 0
        # Cross-thread channels: whole lists change hands, never shared mutable state.
        self._lookup_queue: queue.SimpleQueue[list[_BatchItem] | None] = queue.SimpleQueue()
        self._pending_results: collections.deque[list[_ResultItem]] = collections.deque()
        # Only for wait_idle(): the worker counts processed batches under this condition.
        self._idle_cond = threading.Condition()
        self._num_processed = 0
        self._thread = threading.Thread(
            target=self._worker_loop, name=f"vllm_offloading_lookup_{name}", daemon=True
        )
        self._thread.start()

    @abstractmethod
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        """Report, for each of ``keys``, whether the tier holds it.

        Runs on the background thread, synchronously; it may block on I/O. It must not touch the
        primary tier or any scheduler-thread state. An exception (or a result of the wrong
        length) is logged and every key of the call counts as a miss.

        Args:
            keys: distinct keys first asked for by ``req_context`` during one step.
            req_context: the request that asked first.

        Returns:
            One bool per key, in the order of ``keys``.
        """

    def answer_now(self, key: OffloadKey) -> bool | None:
        """Hook: answer a lookup of ``key`` from the tier's local view, or None to probe it.

        Called on the scheduler thread by every ``lookup``, before anything is queued; it must
        not block (no system call, no network). Return True or False when the view can decide
        (the answer is the lookup's, at once: a stale True costs a failed load, a stale False a
        recompute, so only what the view knows is fit to answer); None sends the key to the
        background probe. Default: None, every key is probed.
        """
        return None

    # -----------------------------------------------------------------------------------------
    # Scheduler thread
    # -----------------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Return the presence of ``key``: ``answer_now``'s if it decides, else the probed one,
        None until the probe has been answered.

        The first undecided lookup of a key (or the first after its state was dropped) queues a
        probe for this step's batch and returns None. O(1) plus the results that arrived since
        the last call.
        """
        req_id = req_context.req_id
        if req_id not in self._asked:
            self._asked.add(req_id)
            self._num_requests += 1
        known = self.answer_now(key)
        if known is not None:
            return known
        self._drain_results()
        state = self._lookup_state.get(key)
        if state is None:
            state = _LookupState(generation=self._new_generation(), phase=_Phase.PENDING)
            self._lookup_state[key] = state
            self._lookup_batch.append((key, req_context, state.generation))
            self._num_deferred_keys += 1
        state.request_ids.add(req_id)
        req_keys = self._req_keys.get(req_id)
        if req_keys is None:
            req_keys = self._req_keys[req_id] = set()
        req_keys.add(key)
        if state.result is None and req_id not in self._deferred:
            self._deferred.add(req_id)
            self._num_deferred_requests += 1
        return state.result

    def counters(self) -> dict[str, int]:
        """Cumulative lookup counts, for the tier's ``get_stats().counters``:
        ``lookup_requests`` (requests that looked up at least one key), ``lookup_deferred_requests``
        (those that got None at least once: they waited a step or more for this tier) and
        ``lookup_deferred_keys`` (keys sent to the background probe). A request cleaned up and
        seen again counts again."""
        return {
            "lookup_requests": self._num_requests,
            "lookup_deferred_requests": self._num_deferred_requests,
            "lookup_deferred_keys": self._num_deferred_keys,
        }

    def flush(self) -> None:
        """Post every probe queued during this step to the worker as one batch.

        Call once per step from the tier's ``on_schedule_end()``. Probes whose state was dropped
        or superseded since they were queued are skipped.
        """
        self._drain_results()
        if not self._lookup_batch or self._closed:
            return
        batch, self._lookup_batch = self._lookup_batch, []
        posted: list[_BatchItem] = []
        for item in batch:
            key, _, generation = item
            state = self._lookup_state.get(key)
            if state is None or state.generation != generation or state.phase is not _Phase.PENDING:
                continue
            state.phase = _Phase.IN_FLIGHT
            posted.append(item)
        if posted:
            self._num_posted += 1
            self._lookup_queue.put(posted)

    def cleanup(self, req_id: str) -> None:
        """Forget request ``req_id``: drop its interest in every key it looked up.

        A key nobody refers to any more is dropped, unless its probe is in flight (the answer is
        then kept for whoever asks next, or dropped on arrival if nobody did). O(keys of the
        request).
        """
        self._asked.discard(req_id)
        self._deferred.discard(req_id)
        keys = self._req_keys.pop(req_id, None)
        if not keys:
            return
        for key in keys:
            state = self._lookup_state.get(key)
            if state is None:
                continue
            state.request_ids.discard(req_id)
            if not state.request_ids and state.phase is not _Phase.IN_FLIGHT:
                del self._lookup_state[key]

    def mark_miss(self, keys: Iterable[OffloadKey]) -> None:
        """Force the answer False for those of ``keys`` that have a state.

        For instance after a failed promotion, so that requests stop asking for a block the tier
        could not deliver. An in-flight probe of such a key is superseded (its answer discarded).
        """
        self._force(keys, False)

    def mark_present(self, keys: Iterable[OffloadKey]) -> None:
        """Force the answer True for those of ``keys`` that have a state (e.g. after a store)."""
        self._force(keys, True)

    def shutdown(self, timeout: float | None = 10.0) -> bool:
        """Stop the worker thread after it has processed the batches already posted.

        Idempotent. Waits at most ``timeout`` seconds (None: forever) for the thread; a thread
        still stuck in ``batch_lookup`` after that is left behind (it is a daemon) and a warning
        is logged. The caller must then keep alive whatever ``batch_lookup`` uses (e.g. open
        directory descriptors, which a later ``open`` could reuse for another file).

        Returns:
            True if the worker thread has stopped, False if it is still running.
        """
        if not self._closed:
            self._closed = True
            self._lookup_batch.clear()
            self._lookup_queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "async lookup thread %s did not stop within %s s", self._thread.name, timeout
            )
            return False
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the worker has processed every batch posted so far (the tier's
        ``wait_lookups_idle``).

        Results are applied by the next ``lookup``/``flush`` on the scheduler thread.

        Returns:
            True if the worker became idle, False if ``timeout`` expired first.
        """
        target = self._num_posted
        with self._idle_cond:
            return self._idle_cond.wait_for(lambda: self._num_processed >= target, timeout)

    @property
    def num_tracked_keys(self) -> int:
        """Keys that currently have a state (queued, in flight or resolved)."""
        return len(self._lookup_state)

    @property
    def num_tracked_requests(self) -> int:
        """Requests that looked up at least one key and were not cleaned up yet."""
        return len(self._req_keys)

    def _new_generation(self) -> int:
        self._next_generation += 1
        return self._next_generation

    def _force(self, keys: Iterable[OffloadKey], found: bool) -> None:
        for key in keys:
            state = self._lookup_state.get(key)
            if state is None:
                continue
            if not state.request_ids:
                # An orphaned in-flight probe: nobody wants the answer.
                del self._lookup_state[key]
                continue
            state.generation = self._new_generation()
            state.phase = _Phase.RESOLVED
            state.result = found

    def _drain_results(self) -> None:
        pending = self._pending_results
        while pending:
            for key, generation, found in pending.popleft():
                state = self._lookup_state.get(key)
                if state is None or state.generation != generation:
                    continue  # stale: the state was dropped, recreated or forced meanwhile
                assert state.phase is _Phase.IN_FLIGHT, (
                    f"async lookup {self.name}: key {key!r} got a second answer "
                    f"(phase {state.phase.name})"
                )
                if not state.request_ids:
                    del self._lookup_state[key]
                    continue
                state.phase = _Phase.RESOLVED
                state.result = found

    # -----------------------------------------------------------------------------------------
    # Worker thread
    # -----------------------------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while True:
            batch = self._lookup_queue.get()
            if batch is None:
                return
            results: list[_ResultItem] = []
            by_request: dict[str, tuple[ReqContext, list[OffloadKey], list[int]]] = {}
            for key, req_context, generation in batch:
                group = by_request.get(req_context.req_id)
                if group is None:
                    group = by_request[req_context.req_id] = (req_context, [], [])
                group[1].append(key)
                group[2].append(generation)
            groups = [(keys, req_context) for req_context, keys, _ in by_request.values()]
            answers = self._safe_step_lookup(groups)
            for (_, keys, generations), found in zip(by_request.values(), answers, strict=True):
                results.extend(zip(keys, generations, found, strict=True))
            # Publish the results before counting the batch, so wait_idle() implies visibility.
            self._pending_results.append(results)
            with self._idle_cond:
                self._num_processed += 1
                self._idle_cond.notify_all()

    def step_lookup(
        self, groups: list[tuple[list[OffloadKey], ReqContext]]
    ) -> list[list[bool]] | None:
        """Resolve a whole step's batch at once, or return None to resolve it per request.

        Runs on the background thread. A tier that can answer every key of the step in one round
        trip (e.g. one pipelined request to a server) overrides this; the default returns None,
        and ``batch_lookup`` is then called once per request. An exception, or an answer of the
        wrong shape, is logged and makes every key of the step a miss.

        Args:
            groups: ``(keys, req_context)`` per request, as ``batch_lookup`` would get them.

        Returns:
            One list of bools per group, parallel to its keys; or None.
        """
        return None

    def _safe_step_lookup(
        self, groups: list[tuple[list[OffloadKey], ReqContext]]
    ) -> list[list[bool]]:
        try:
            answers = self.step_lookup(groups)
        except Exception:
            logger.exception(
                "async lookup %s: step_lookup of %d request(s) failed; treating them as misses",
                self.name,
                len(groups),
            )
            answers = [[False] * len(keys) for keys, _ in groups]
        if answers is None:
            return [self._safe_batch_lookup(keys, ctx) for keys, ctx in groups]
        if len(answers) != len(groups) or any(
            len(found) != len(keys) for found, (keys, _) in zip(answers, groups, strict=True)
        ):
            logger.error(
                "async lookup %s: step_lookup answered %d group(s) of the wrong shape for %d "
                "request(s); treating them as misses",
                self.name,
                len(answers),
                len(groups),
            )
            return [[False] * len(keys) for keys, _ in groups]
        return [[bool(f) for f in found] for found in answers]

    def _safe_batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> list[bool]:
        try:
            found = [bool(f) for f in self.batch_lookup(keys, req_context)]
        except Exception:
            logger.exception(
                "async lookup %s: batch_lookup of %d key(s) for request %s failed; "
                "treating them as misses",
                self.name,
                len(keys),
                req_context.req_id,
            )
            return [False] * len(keys)
        if len(found) != len(keys):
            logger.error(
                "async lookup %s: batch_lookup returned %d result(s) for %d key(s) "
                "(request %s); treating them as misses",
                self.name,
                len(found),
                len(keys),
                req_context.req_id,
            )
            return [False] * len(keys)
        return found
