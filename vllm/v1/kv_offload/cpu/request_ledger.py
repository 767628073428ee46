# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Per-request ownership of the CPU tier's pins and pending stores.

``CPUOffloadingManager`` keeps two ledgers, ``req_id -> list of key tuples``: one tuple per
outstanding ``prepare_load`` call (the request's pins) and one per pending store (the
``keys_to_store`` of its ``prepare_store`` calls). This module holds the ledgers' operations
that are not on the hot path's straight line: the exact-match removal every completion tries
first (``take_call``), and the slow paths that validate and apply a completion naming another
set of keys, describe a key's state for an error, and snapshot a request's ledger entries.

The manager owns the ledgers and the ``BlockStatus`` states; these functions only read the
policy (``get``) and change the ledger they are given, never a block's ``ref_cnt``.
"""

from __future__ import annotations

from collections.abc import Collection

from vllm.v1.kv_offload.base import (
    OffloadKey,
    OffloadKeyStateError,
    ReqContext,
    check_offload_keys,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

Ledger = dict[str, list[tuple[OffloadKey, ...]]]
"""``req_id -> the key tuples of its outstanding calls`` (no empty list, no empty tuple)."""


def take_call(ledger: Ledger, req_id: str, keys: tuple[OffloadKey, ...]) -> bool:
    """Remove ``keys`` from ``ledger[req_id]`` if one outstanding call had exactly them.

    The fast path of ``complete_load`` / ``complete_store``: the connector completes each job
    with exactly the keys it prepared. Returns whether such a call was found and removed.
    """
    calls = ledger.get(req_id)
    if calls is None:
        return False
    try:
        calls.remove(keys)
    except ValueError:
        return False
    if not calls:
        del ledger[req_id]
    return True


def load_pins(loads: Ledger, req_id: str) -> dict[OffloadKey, int]:
    """The pins request ``req_id`` holds: key -> number of outstanding ``prepare_load`` s."""
    pins: dict[OffloadKey, int] = {}
    for load in loads.get(req_id, ()):
        for key in load:
            pins[key] = pins.get(key, 0) + 1
    return pins


def pending_stores(stores: Ledger, req_id: str) -> list[OffloadKey]:
    """The keys request ``req_id`` prepared to store and has not completed, in order."""
    return [key for store in stores.get(req_id, ()) for key in store]


def describe(policy: CachePolicy, loads: Ledger, stores: Ledger, key: OffloadKey) -> str:
    """The state of ``key`` in words, naming the requests that hold it (for error messages)."""
    block = policy.get(key)
    if block is None:
        return "not offloaded"
    if block.ref_cnt < 0:
        writers = [
            req_id for req_id, calls in stores.items() if any(key in store for store in calls)
        ]
        return f"being written (its store is pending for request {writers[0]!r})"
    if block.ref_cnt == 0:
        return "ready and not pinned"
    holders = {}
    for req_id, calls in loads.items():
        count = sum(load.count(key) for load in calls)
        if count:
            holders[req_id] = count
    by = ", ".join(f"{req_id!r} x{count}" for req_id, count in holders.items())
    return f"ready and pinned {block.ref_cnt} time(s), by request(s) {by}"


def refuse_load(
    policy: CachePolicy,
    loads: Ledger,
    stores: Ledger,
    method: str,
    keys: Collection[OffloadKey],
    req_context: ReqContext,
) -> Exception:
    """The error for a ``prepare_load`` naming a key that is not readable (slow path).

    Raises the argument error itself if ``keys`` holds something that is not a key.
    """
    check_offload_keys(method, keys, req_context)
    get = policy.get
    for key in keys:
        block = get(key)
        if block is None or block.ref_cnt < 0:
            return OffloadKeyStateError(
                method,
                key,
                req_context.req_id,
                describe(policy, loads, stores, key),
                "a ready block (lookup() returned True)",
            )
    raise AssertionError(f"{method}: no unreadable key among {len(keys)} keys")


def release_partial_load(
    policy: CachePolicy,
    loads: Ledger,
    stores: Ledger,
    method: str,
    keys: tuple[OffloadKey, ...],
    req_context: ReqContext,
) -> None:
    """Release one pin per occurrence in ``keys`` from the request's outstanding loads.

    Validates first: raises ``OffloadKeyStateError`` (changing nothing) unless the request
    holds at least as many pins on each key as ``keys`` releases. Changes only ``loads``; the
    caller then decrements the blocks' ``ref_cnt``.
    """
    check_offload_keys(method, keys, req_context)
    req_id = req_context.req_id
    held = load_pins(loads, req_id)
    need: dict[OffloadKey, int] = {}
    for key in keys:
        need[key] = need.get(key, 0) + 1
        if need[key] > held.get(key, 0):
            state = describe(policy, loads, stores, key)
            held_here = held.get(key, 0)
            raise OffloadKeyStateError(
                method,
                key,
                req_id,
                f"{state}; this request holds {held_here} pin(s) on it and the call "
                f"releases {need[key]}",
                "a key this request pinned with prepare_load and has not released",
            )
    remaining: list[tuple[OffloadKey, ...]] = []
    for load in loads[req_id]:
        kept = []
        for key in load:
            if need.get(key):
                need[key] -= 1
            else:
                kept.append(key)
        if kept:
            remaining.append(tuple(kept))
    if remaining:
        loads[req_id] = remaining
    else:
        del loads[req_id]


def finish_partial_store(
    policy: CachePolicy,
    loads: Ledger,
    stores: Ledger,
    keys: tuple[OffloadKey, ...],
    req_context: ReqContext,
) -> tuple[OffloadKey, ...]:
    """Take the keys of ``keys`` pending for the request out of its pending stores; return them.

    Upstream's contract: ``complete_store`` changes only the keys whose store is pending, and
    ignores the others, absent ones and already stored ones alike (the call is idempotent for
    them). Validates first: raises ``OffloadKeyStateError`` (changing nothing) if a key is being
    written for *another* request's store, which completing would publish or free under that
    request's writer. Changes only ``stores``; the caller then publishes or drops the blocks.
    """
    check_offload_keys("complete_store", keys, req_context)
    req_id = req_context.req_id
    own = set(pending_stores(stores, req_id))
    done: list[OffloadKey] = []
    get = policy.get
    for key in dict.fromkeys(keys):
        if key in own:
            done.append(key)
            continue
        block = get(key)
        if block is not None and block.ref_cnt < 0:
            raise OffloadKeyStateError(
                "complete_store",
                key,
                req_id,
                describe(policy, loads, stores, key),
                "a key absent, already stored, or pending for this request's own store",
            )
    if not done:
        return ()
    taken = set(done)
    remaining = [
        kept
        for kept in (tuple(key for key in store if key not in taken) for store in stores[req_id])
        if kept
    ]
    if remaining:
        stores[req_id] = remaining
    else:
        del stores[req_id]
    return tuple(done)
