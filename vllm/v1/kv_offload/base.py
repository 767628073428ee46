"""Core abstractions of the KV-cache offload subsystem.

This module defines the vocabulary shared by the scheduler side and the worker side:

* ``OffloadKey``: the identity of one offloaded block (block hash + KV-cache group).
* ``ReqContext`` / ``RequestOffloadingContext``: per-request state handed to managers.
* ``LoadStoreSpec`` and its subclasses: where a transfer reads or writes, per medium (the CPU
  tier's is in ``vllm.v1.kv_offload.mediums``).
* ``PrepareStoreOutput`` / ``OffloadingEvent``: results of manager calls.
* ``TierStats``: a secondary tier's occupancy and counters, for reports.
* ``OffloadingManager``: the scheduler-side ABC that decides what is offloaded and where.

Everything here is pure bookkeeping; no method in this module blocks or moves bytes.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import numpy as np
import numpy.typing as npt
from typing_extensions import override

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

    @override
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

    @override
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
    """Keys stored in (``removed=False``) or removed from (``removed=True``) a medium."""

    keys: list[OffloadKey]
    medium: str
    removed: bool


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
    """

    tier_type: str
    num_blocks: int
    used_bytes: int
    block_bytes: int
    counters: Mapping[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Manager
# ---------------------------------------------------------------------------------------------


class OffloadingManager(ABC):
    """Tracks which blocks are offloaded and where; runs on the scheduler thread.

    No method may block: each call does bookkeeping proportional to the keys it is given. Data is
    moved elsewhere (worker-side handlers, tier I/O threads) and reported back through
    ``complete_load`` / ``complete_store``.

    Protection semantics: a block is *readable* once its store completed successfully. Between
    ``prepare_load`` and ``complete_load`` it is pinned and cannot be evicted. Between
    ``prepare_store`` and ``complete_store`` it is being written: not readable, not evictable.

    Lifecycle: the connector calls ``on_schedule_end()`` exactly once at the end of every scheduler
    step; ``take_events()`` may be called any number of times and only drains events.
    """

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """Report whether block ``key`` is offloaded and readable.

        Returns:
            True if stored and readable; False if absent; None if present but not readable yet
            (being written or promoted from a slower tier): ask again in a later step.
        """

    @abstractmethod
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` for reading and return where to read them from.

        Precondition: every key is readable (``lookup`` returned True). The keys stay pinned, and
        thus not evictable, until ``complete_load`` is called with them.
        """

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark ``keys`` as recently used. Default: no-op.

        Separate from ``prepare_load`` so that blocks served from the GPU prefix cache still count
        as used. The first key ends up the most recently used.
        """

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Unpin ``keys`` pinned by ``prepare_load``. Default: no-op."""

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
        """

    def complete_store(  # noqa: B027
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """Finish a store prepared by ``prepare_store``. Default: no-op.

        On success the written keys become readable. On failure the keys that were being written
        are dropped and their room freed. Keys that were already readable are never changed.
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
        """Drop every offloaded block and reset internal state. Default: no-op."""

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

    def shutdown(self) -> None:  # noqa: B027
        """Release every resource the manager holds. Default: no-op."""
