# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Core abstractions of the KV-cache offload subsystem.

This module defines the vocabulary shared by the scheduler side and the worker side:

* ``OffloadKey``: the identity of one offloaded block (block hash + KV-cache group).
* ``ReqContext`` / ``RequestOffloadingContext``: per-request state handed to managers.
* ``LoadStoreSpec`` and its subclasses: where a transfer reads or writes, per medium (the CPU
  tier's is in ``vllm.v1.kv_offload.mediums``).
* ``PrepareStoreOutput`` / ``OffloadingEvent``: results of manager calls.
* ``TierStats``: a secondary tier's occupancy and counters, for reports.
* ``OffloadingManager``: the scheduler-side ABC that decides what is offloaded and where.
* ``OffloadKeyStateError`` / ``check_offload_keys``: how managers refuse a call from a caller
  that misbehaves (a key in the wrong state, a value that is not a key).

Everything here is pure bookkeeping; no method in this module blocks or moves bytes.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any, NewType, NoReturn

import numpy as np
import numpy.typing as npt
from typing_extensions import override

if TYPE_CHECKING:
    from vllm.v1.kv_offload.metrics import MetricsRecorder

# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------

OffloadKey = NewType("OffloadKey", bytes)
"""Identity of one offloaded block: ``block_hash || group_idx.to_bytes(4, "big")``.

Raw bytes rather than a tuple: keys live in large dicts and sets, and bytes objects are not
tracked by the garbage collector.
"""

_GROUP_IDX_BYTES = 4
_GROUP_IDX_MAX = (1 << (8 * _GROUP_IDX_BYTES)) - 1


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Build the key of block ``block_hash`` in KV-cache group ``group_idx``.

    Args:
        block_hash: the chained prefix hash of the block (non-empty bytes).
        group_idx: the KV-cache group index, ``0 <= group_idx < 2**32``.

    Raises:
        ValueError: if ``block_hash`` is empty or ``group_idx`` does not fit in 4 unsigned bytes.
    """
    if not block_hash:
        raise ValueError("block_hash must be non-empty bytes")
    if not 0 <= group_idx <= _GROUP_IDX_MAX:
        raise ValueError(f"group_idx={group_idx} is outside [0, {_GROUP_IDX_MAX}]")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """Return the block-hash part of ``key``."""
    return key[:-_GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """Return the KV-cache group index encoded in the last 4 bytes of ``key``."""
    return int.from_bytes(key[-_GROUP_IDX_BYTES:], "big")


# ---------------------------------------------------------------------------------------------
# Request context and policy
# ---------------------------------------------------------------------------------------------


@dataclass(eq=False)
class ReqContext:
    """Per-request context passed to every manager call made on behalf of a request.

    The scheduler creates exactly one ``ReqContext`` per request and reuses that object for all of
    the request's calls. Managers may rely on that identity (equality is identity), e.g. to batch
    one request's promotions into a single job.

    Attributes:
        req_id: the engine's request id.
        kv_transfer_params: the request's ``kv_transfer_params``, if any, passed through untouched.
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None


class OffloadPolicy(enum.Enum):
    """Which of a request's blocks are offloaded."""

    BLOCK_LEVEL = "block_level"
    """Only blocks the request computed itself (blocks served from a prefix hit are skipped)."""

    REQUEST_LEVEL = "request_level"
    """Every block of the request, including prefix hits (tiers that need the full context)."""


@dataclass(frozen=True)
class RequestOffloadingContext:
    """A manager's answer to ``on_new_request``: how the request's blocks are offloaded."""

    policy: OffloadPolicy = OffloadPolicy.BLOCK_LEVEL


# ---------------------------------------------------------------------------------------------
# Caller errors
# ---------------------------------------------------------------------------------------------


def _describe_value(value: object) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(value).__name__} {text}"


def check_offload_keys(method: str, keys: Iterable[object], req_context: ReqContext) -> None:
    """Raise ``TypeError`` unless every element of ``keys`` is an ``OffloadKey`` (``bytes``).

    The slow path of a manager's public boundary: managers run a cheap C-level check on the hot
    path and call this to name the offending value.

    Args:
        method: the manager method that was called (named in the message).
        keys: what the caller passed as the method's keys.
        req_context: the request the call was made for (named in the message).

    Raises:
        TypeError: ``keys`` is a single ``bytes``/``str`` rather than a collection of keys, or
            one of its elements is not ``bytes``.
    """
    req_id = getattr(req_context, "req_id", req_context)
    if isinstance(keys, (bytes, bytearray, str)):
        raise TypeError(
            f"{method}: keys must be a collection of OffloadKeys (bytes), got a single "
            f"{_describe_value(keys)} (request {req_id!r})"
        )
    for key in keys:
        check_offload_key(method, key, req_context)


def key_sequence(
    method: str, keys: Iterable[object], req_context: ReqContext
) -> Sequence[OffloadKey]:
    """``keys`` as a list or tuple (an iterator is read once into a list), for a method that
    goes through its keys more than once; its elements are not checked here (a caller checks
    those it reaches, with ``check_offload_keys`` where one is not an ``OffloadKey``).

    Raises:
        TypeError: ``keys`` is a single ``bytes``/``str`` rather than a collection of keys.
    """
    if isinstance(keys, (bytes, bytearray, str)):
        check_offload_keys(method, keys, req_context)
    if type(keys) is not list and type(keys) is not tuple:
        keys = list(keys)
    return keys  # type: ignore[return-value]


def check_offload_key(method: str, key: object, req_context: ReqContext) -> None:
    """Raise ``TypeError`` unless ``key`` is an ``OffloadKey`` (``bytes``); see
    ``check_offload_keys``."""
    if not isinstance(key, bytes):
        req_id = getattr(req_context, "req_id", req_context)
        raise TypeError(
            f"{method}: keys must be OffloadKeys (bytes), got {_describe_value(key)} "
            f"(request {req_id!r})"
        )


# The ``OffloadingManager`` methods that read or change blocks: every manager's ``shutdown()``
# refuses them (``refuse_after_shutdown``), with the methods of its own that do.
BLOCK_METHODS = (
    "lookup",
    "lookup_prefix",
    "probe",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
)


def refuse_after_shutdown(manager: object, methods: Iterable[str]) -> None:
    """Make each of ``methods`` of ``manager`` raise ``RuntimeError`` from now on.

    A manager's ``shutdown()`` calls this once with the methods that read or change blocks, so
    that no method tests a shut-down flag on every call: the instance attributes set here
    shadow the class's methods. The error names the class and the method.
    """
    owner = type(manager).__name__
    for method in methods:

        def refuse(*args: object, _method: str = method, **kwargs: object) -> NoReturn:
            raise RuntimeError(f"{owner}.{_method}: the manager is shut down")

        setattr(manager, method, refuse)


def drain_events(events: list[OffloadingEvent] | None) -> Iterable[OffloadingEvent]:
    """What ``events`` holds, in order, leaving it empty: a ``take_events`` over a list of
    recorded events (``None``: events are not recorded, so there are none)."""
    if not events:
        return ()
    taken = events.copy()
    events.clear()
    return taken


class OffloadKeyStateError(ValueError):
    """A manager call named a key whose state does not allow that call (a caller bug).

    Raised at the manager's public boundary before anything changed: after it, every key's state,
    the pins, the capacity accounting, the statistics and the events are as before the call.

    Attributes:
        method: the manager method that refused the call (e.g. ``"complete_load"``).
        key: the first offending key.
        req_id: the request the call was made for.
        state: the key's state as the manager sees it (e.g. ``"not offloaded"``).
    """

    def __init__(self, method: str, key: OffloadKey, req_id: str, state: str, expected: str):
        self.method = method
        self.key = key
        self.req_id = req_id
        self.state = state
        super().__init__(
            f"{method}: key {key.hex()} of request {req_id!r} is {state}; expected {expected}"
        )


# ---------------------------------------------------------------------------------------------
# Transfer descriptors
# ---------------------------------------------------------------------------------------------

BlockIds = npt.NDArray[np.int64]


class LoadStoreSpec(ABC):
    """Opaque description of where a transfer reads from or writes to.

    A worker routes a transfer by the pair ``(src.medium(), dst.medium())``.
    """

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """Return the name of the medium this spec addresses (e.g. ``"GPU"``, ``"CPU"``)."""


_INT64_MAX = int(np.iinfo(np.int64).max)

_SHORT_LIST = 64
"""Up to this many ids, a list's minimum is cheaper in Python than a numpy reduction."""


def _as_block_ids(values: Sequence[int] | npt.ArrayLike, what: str) -> BlockIds:
    # On the scheduler's hot path (two specs per request and step): plain attribute checks
    # instead of np.issubdtype, and no numpy reduction for the short lists managers pass.
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    if isinstance(values, list) and len(values) <= _SHORT_LIST:
        lowest = int(min(values))
    else:
        lowest = int(arr.min())
    if lowest < 0:
        raise ValueError(f"{what} must be non-negative, got {arr.tolist()}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) > _INT64_MAX:
        # np.asarray([2**63]) is uint64; the int64 conversion below would wrap it negative.
        raise ValueError(f"{what} must be below 2**63, got {arr.tolist()}")
    return np.ascontiguousarray(arr, dtype=np.int64)


class BlockIDsLoadStoreSpec(LoadStoreSpec, ABC):
    """A spec that addresses whole blocks of one medium by id.

    Attributes:
        block_ids: 1-D, C-contiguous ``int64`` array of non-negative block ids, in the order of the
            keys of the call that produced the spec. Owned by the spec; callers must not mutate it.
    """

    def __init__(self, block_ids: Sequence[int] | npt.ArrayLike) -> None:
        self.block_ids: BlockIds = _as_block_ids(block_ids, "block_ids")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.block_ids.tolist()})"


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU blocks of a transfer, possibly spanning several KV-cache groups.

    Attributes:
        block_ids: flat GPU block ids of every group, ordered by group: the first
            ``group_sizes[0]`` ids belong to group 0, the next ``group_sizes[1]`` to group 1, ...
        group_sizes: number of GPU blocks of each group; ``sum(group_sizes) == len(block_ids)``.
        block_indices: for each group, the logical index (within the request) of the group's first
            GPU block. When an offloaded block spans ``k > 1`` GPU blocks, the worker skips the
            first ``block_indices[g] % k`` GPU-sized sub-blocks of the group's first offloaded
            block (an unaligned start). ``len(block_indices) == len(group_sizes)``.
    """

    def __init__(
        self,
        block_ids: Sequence[int] | npt.ArrayLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
    ) -> None:
        super().__init__(block_ids)
        self.group_sizes: tuple[int, ...] = tuple(int(s) for s in group_sizes)
        self.block_indices: tuple[int, ...] = tuple(int(i) for i in block_indices)
        if len(self.group_sizes) != len(self.block_indices):
            raise ValueError(
                f"group_sizes {self.group_sizes} and block_indices {self.block_indices} "
                "must have one entry per KV-cache group"
            )
        if any(s < 0 for s in self.group_sizes):
            raise ValueError(f"group_sizes must be non-negative, got {self.group_sizes}")
        if any(i < 0 for i in self.block_indices):
            raise ValueError(f"block_indices must be non-negative, got {self.block_indices}")
        if sum(self.group_sizes) != len(self.block_ids):
            raise ValueError(
                f"sum(group_sizes)={sum(self.group_sizes)} != len(block_ids)={len(self.block_ids)}"
            )

    @staticmethod
    @override
    def medium() -> str:
        return "GPU"

    def __repr__(self) -> str:
        return (
            f"GPULoadStoreSpec(block_ids={self.block_ids.tolist()}, "
            f"group_sizes={list(self.group_sizes)}, block_indices={list(self.block_indices)})"
        )


# ---------------------------------------------------------------------------------------------
# Manager results
# ---------------------------------------------------------------------------------------------


@dataclass
class PrepareStoreOutput:
    """Result of ``OffloadingManager.prepare_store``.

    Attributes:
        keys_to_store: the keys that must actually be written (those not already stored).
        store_spec: where to write them, parallel to ``keys_to_store``.
        evicted_keys: keys evicted to make room; they are no longer readable.
    """

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey] = field(default_factory=list)


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys stored in (``removed=False``) or removed from (``removed=True``) a medium.

    ``locality`` (vLLM's values) says who can read a ``STORAGE`` medium's copies: ``"LOCAL"``
    (this instance only, e.g. the fs tier's directory) or ``"REMOTE"`` (every instance sharing
    the store, e.g. the redis tier); None when the medium does not say (the CPU tier).
    """

    keys: list[OffloadKey]
    medium: str
    removed: bool
    locality: str | None = None


@dataclass(frozen=True)
class TierStats:
    """A point-in-time report of one secondary tier, for reports and monitoring.

    Attributes:
        tier_type: the type name the tier was registered under (e.g. ``"fs"``).
        num_blocks: blocks the tier holds now.
        used_bytes: bytes those blocks occupy on the tier's medium.
        block_bytes: bytes one block occupies on the medium (e.g. a block file: header and one
            primary row); 0 if blocks have no fixed size there.
        counters: the tier's cumulative counters by name (tier-defined, e.g. ``"blocks_written"``);
            a copy, owned by the caller.
        capacity_bytes: the most bytes the tier may use, or None when it is unbounded (or does
            not say).
    """

    tier_type: str
    num_blocks: int
    used_bytes: int
    block_bytes: int
    counters: Mapping[str, int] = field(default_factory=dict)
    capacity_bytes: int | None = None


# ---------------------------------------------------------------------------------------------
# Manager
# ---------------------------------------------------------------------------------------------


class OffloadingManager(ABC):
    """Tracks which blocks are offloaded and where; runs on the scheduler thread.

    No method waits for I/O, with one exception: each call does bookkeeping proportional to the
    keys it is given, and data is moved elsewhere (worker-side handlers, tier I/O threads) and
    reported back through ``complete_load`` / ``complete_store``. The exception is
    ``reset_cache``: a manager with jobs of its own in flight (the tiering manager's secondary
    tiers) waits there until they finished (``SecondaryTierManager.drain_jobs``), since the rows
    they copy are about to be reused, as upstream vLLM's tiering manager does. The engine calls
    it only between serving phases (sleep, weight update).

    Protection semantics: a block is *readable* once its store completed successfully. Between
    ``prepare_load`` and ``complete_load`` it is pinned and cannot be evicted. Between
    ``prepare_store`` and ``complete_store`` it is being written: not readable, not evictable.

    Lifecycle: the connector calls ``on_schedule_end()`` exactly once at the end of every scheduler
    step; ``take_events()`` may be called any number of times and only drains events.

    Callers that misbehave: the keys, pins and stores named by a call are checked at the call,
    before anything changes. A value that is not an ``OffloadKey`` raises ``TypeError``; a key
    whose state does not allow the call (loading a block that is not readable, completing a load
    this request did not prepare, completing a store another request is writing)
    raises ``OffloadKeyStateError`` (a ``ValueError``) naming the method, the key and the request;
    a call after ``shutdown()`` raises ``RuntimeError``. In each case no state changed. Managers
    that keep no per-key state (the base defaults) accept anything.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Report whether block ``key`` is offloaded and readable.

        Returns:
            True if stored and readable; False if absent; None if present but not readable yet
            (being written or promoted from a slower tier): ask again in a later step.

        Raises:
            TypeError: ``key`` is not an ``OffloadKey``.
            RuntimeError: the manager is shut down.
        """

    def lookup_prefix(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> list[bool | None]:
        """``lookup`` of ``keys`` in order, up to the first that answers False (not in upstream
        vLLM): the scan of a request's prefix in one call.

        Returns:
            One answer per key looked up, in order: True or None for each, except that the last
            is False when the scan stopped there (the keys after it are not answered).

        Raises:
            TypeError: a key the scan reaches is not an ``OffloadKey`` (nothing changed; keys
                after the first False may go unchecked, as a ``lookup`` per key never sees
                them).
            RuntimeError: the manager is shut down.

        A manager may answer faster than one ``lookup`` per key. What may differ from that loop
        is which blocks its promotions evict to make room, never one this call answers readable:
        one by one, a promotion could evict a later key of the same scan before its turn (which
        then misses in this tier) or an earlier hit (which the caller would then find missing).
        Keys after the first False may still have been asked of slower tiers (their statistics
        count them).

        Default: ``lookup`` of each key until one answers False.
        """
        keys = key_sequence("lookup_prefix", keys, req_context)
        if not all(map(isinstance, keys, repeat(bytes))):
            check_offload_keys("lookup_prefix", keys, req_context)
        results: list[bool | None] = []
        for key in keys:
            result = self.lookup(key, req_context)
            results.append(result)
            if result is False:
                break
        return results

    def probe(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """``lookup``'s answer for ``key``, without starting a promotion (not in upstream vLLM).

        A manager with slower tiers promotes a block found only in one of them when ``lookup``
        asks for it. A connector that loads only part of what it looks up (a sliding-window
        group needs only the window before the hit's end) probes first, then calls ``lookup``
        for the keys it will load, so that only those are promoted. A ``lookup`` of a key this
        step probed answers as if the probe had not happened (counted once, same tier).

        Returns:
            True if readable now; None if not readable yet, including a block a slower tier
            holds (``lookup`` would promote it); False if absent.

        Raises:
            TypeError: ``key`` is not an ``OffloadKey``.
            RuntimeError: the manager is shut down.

        Default: ``lookup(key, req_context)`` (a manager without slower tiers starts nothing).
        """
        return self.lookup(key, req_context)

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` for reading and return where to read them from.

        Precondition: every key is readable (``lookup`` returned True). The keys stay pinned, and
        thus not evictable, until ``complete_load`` is called with them *for the same request*:
        pins are held per request, and a key listed twice is pinned twice.

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: a key is not readable (absent or being written); nothing is
                pinned then.
            RuntimeError: the manager is shut down.
        """

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark ``keys`` as recently used. Default: no-op.

        Separate from ``prepare_load`` so that blocks served from the GPU prefix cache still count
        as used. The first key ends up the most recently used.
        """

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Unpin ``keys`` pinned by ``prepare_load`` for this request. Default: no-op.

        Each occurrence of a key releases one pin the request holds on it; a request can never
        release another request's pins, so a block stays pinned while any ``prepare_load`` of it
        is outstanding.

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: the request holds fewer pins on a key than the call releases
                (a duplicate, stray or foreign completion); nothing is released then.
            RuntimeError: the manager is shut down.
        """

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Allocate room for the keys of ``keys`` that are not stored yet.

        Every key passed in is protected from the eviction this call may perform. New keys are
        marked as being written (not readable, not evictable) until ``complete_store``.

        Returns:
            The keys to write and where to write them; an output with no keys when every key is
            already stored; None only when enough capacity cannot be freed (nothing changed then,
            try again later).

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            RuntimeError: the manager is shut down.
        """

    def complete_store(  # noqa: B027
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Finish a store prepared by ``prepare_store``. Default: no-op.

        Only keys whose store this request prepared and has not completed change (a key listed
        twice counts once): on success they become readable; on failure they are dropped and
        their room freed. Keys already stored and absent keys are ignored, whatever
        ``success`` is (upstream vLLM's contract: completing all the keys passed to
        ``prepare_store``, already stored ones included, is fine).

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: a key is being written for another request's store; then no
                key of the call changes.
            RuntimeError: the manager is shut down.
        """

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Called when the scheduler first sees a request; returns its offload policy."""

    def on_request_finished(self, req_context: ReqContext) -> None:  # noqa: B027
        """Called once no more ``prepare_*``/``touch`` calls will be made for the request.

        ``complete_load``/``complete_store`` calls for it may still follow. Default: no-op.
        """

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Yield the events collected since the last call.

        Only drains events: it processes no job, flushes nothing and changes no step state, so it
        may be called any number of times, at any point of a step or while the engine is idle.
        Default: yields nothing.
        """
        return ()

    def on_schedule_end(self) -> None:  # noqa: B027
        """Called once at the end of each scheduler step.

        Managers may override it to flush work deferred during the step (e.g. batched promotions)
        and to reset per-step state. The connector's ``build_connector_meta()`` is its only caller.
        Default: no-op.
        """

    def has_pending_work(self) -> bool:
        """Whether transfers are still in flight, so the engine must keep stepping.

        While this returns True the engine keeps calling ``on_schedule_end()`` even with no
        request scheduled. Default: False.
        """
        return False

    def reset_cache(self) -> None:  # noqa: B027
        """Drop every offloaded block and reset internal state. Default: no-op.

        The one call that may wait: for the manager's own jobs in flight (see the class
        docstring). The caller guarantees that no ``complete_*`` call for a job prepared before
        the reset follows.
        """

    def promotion_source(self, key: OffloadKey) -> str | None:
        """The type name of the tier ``key`` is being promoted from, while it is.

        Asked by the connector when ``lookup`` answered None for a key it is not storing, so
        that served tokens can be attributed to the tier they came from. Default: None (the
        manager has no secondary tiers, or does not tell).
        """
        return None

    def get_stats(self) -> Mapping[str, int | float] | None:
        """Return a snapshot of the manager's counters, or None if it keeps none. Default: None.

        Counters are cumulative since construction (or the last ``reset_cache``); calling this has
        no side effect.
        """
        return None

    def report_metrics(self, recorder: MetricsRecorder) -> None:  # noqa: B027
        """Report metrics beyond ``get_stats()`` (per tier, per job) to ``recorder``, once per
        step; see ``vllm.v1.kv_offload.metrics``. Must be cheap. Default: nothing."""

    def shutdown(self) -> None:  # noqa: B027
        """Release every resource the manager holds; idempotent. Default: no-op.

        Afterwards every call that reads or changes blocks raises ``RuntimeError``.
        """
