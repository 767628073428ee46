# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``RequestLedger``: which request holds each pin and each pending store of the CPU tier."""

from __future__ import annotations

from collections.abc import Collection

from vllm.v1.kv_offload.base import (
    OffloadKey,
    OffloadKeyStateError,
    ReqContext,
    check_offload_keys,
)
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy

Calls = dict[str, list[tuple[OffloadKey, ...]]]
"""``req_id -> the key tuples of its outstanding calls`` (no empty list, no empty tuple)."""


class RequestLedger:
    """The pins and pending stores of the CPU tier, by the request that made them.

    Every pin (an outstanding ``prepare_load``) and every pending store (the ``keys_to_store``
    of a ``prepare_store`` not completed yet) belongs to the request that made it: ``loads``
    and ``stores`` map a request id to one key tuple per outstanding call. A block's
    ``ref_cnt`` is the number of times its key occurs in all loads, and a block is being
    written exactly when its key is in one request's stores. So a request can release only
    pins it holds and complete only stores it prepared.

    A completion naming exactly one call's keys (what the connector sends) is found and removed
    in O(keys) (``take_load`` / ``take_store``); any other completion takes the slow path
    (``release_partial_load`` / ``finish_partial_store``, O(the request's outstanding keys)),
    which validates before it changes anything and names the key's holders in its error.

    Ownership and threading: owned by one ``CPUOffloadingManager`` and used on its thread. The
    ledger changes only itself; it reads the manager's policy (``get``) for error messages and
    to tell a key being written from one absent or ready, and never changes a block's
    ``ref_cnt``, which the manager does after the ledger accepted a call.
    """

    __slots__ = ("_policy", "loads", "stores")

    def __init__(self, policy: CachePolicy) -> None:
        self._policy = policy
        self.loads: Calls = {}
        """``req_id -> the key tuples of its outstanding prepare_load calls`` (its pins)."""
        self.stores: Calls = {}
        """``req_id -> the keys_to_store tuples of its pending stores``."""

    # -- recording and the exact-match completions (the hot path) -------------------------------

    def add_load(self, req_id: str, keys: tuple[OffloadKey, ...]) -> None:
        """Record a ``prepare_load`` of ``keys`` (non-empty) by request ``req_id``."""
        _add_call(self.loads, req_id, keys)

    def add_store(self, req_id: str, keys: tuple[OffloadKey, ...]) -> None:
        """Record a pending store of ``keys`` (non-empty, new) by request ``req_id``."""
        _add_call(self.stores, req_id, keys)

    def take_load(self, req_id: str, keys: tuple[OffloadKey, ...]) -> bool:
        """Remove the request's outstanding load of exactly ``keys``; whether there was one."""
        return _take_call(self.loads, req_id, keys)

    def take_store(self, req_id: str, keys: tuple[OffloadKey, ...]) -> bool:
        """Remove the request's pending store of exactly ``keys``; whether there was one."""
        return _take_call(self.stores, req_id, keys)

    def has_pending_stores(self, req_id: str) -> bool:
        """Whether request ``req_id`` has a store it has not completed (O(1))."""
        return req_id in self.stores

    def clear(self) -> None:
        """Forget every pin and pending store (``reset_cache``)."""
        self.loads.clear()
        self.stores.clear()

    # -- the slow paths: partial completions and refusals ---------------------------------------

    def release_partial_load(
        self, method: str, keys: tuple[OffloadKey, ...], req_context: ReqContext
    ) -> None:
        """Release one of the request's pins per occurrence of a key in ``keys``.

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: the request holds fewer pins on a key than ``keys`` releases;
                nothing changed.
        """
        check_offload_keys(method, keys, req_context)
        req_id = req_context.req_id
        held = self._pins(req_id)
        need: dict[OffloadKey, int] = {}
        for key in keys:
            need[key] = need.get(key, 0) + 1
            if need[key] > held.get(key, 0):
                raise OffloadKeyStateError(
                    method,
                    key,
                    req_id,
                    f"{self.describe(key)}; this request holds {held.get(key, 0)} pin(s) on it "
                    f"and the call releases {need[key]}",
                    "a key this request pinned with prepare_load and has not released",
                )
        remaining: list[tuple[OffloadKey, ...]] = []
        for load in self.loads[req_id]:
            kept = []
            for key in load:
                if need.get(key):
                    need[key] -= 1
                else:
                    kept.append(key)
            if kept:
                remaining.append(tuple(kept))
        if remaining:
            self.loads[req_id] = remaining
        else:
            del self.loads[req_id]

    def finish_partial_store(
        self, keys: tuple[OffloadKey, ...], req_context: ReqContext
    ) -> tuple[OffloadKey, ...]:
        """Take the request's pending stores among ``keys`` out of the ledger; return them.

        Upstream's contract: ``complete_store`` changes only the keys whose store is pending
        and ignores the others, absent and already stored ones alike. Each key is returned
        once, in the order given.

        Raises:
            TypeError: an element of ``keys`` is not an ``OffloadKey``.
            OffloadKeyStateError: a key is being written for *another* request's store
                (completing it would publish or free a row that request's worker still
                writes); nothing changed.
        """
        check_offload_keys("complete_store", keys, req_context)
        req_id = req_context.req_id
        own = {key for store in self.stores.get(req_id, ()) for key in store}
        done: list[OffloadKey] = []
        get = self._policy.get
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
                    self.describe(key),
                    "a key absent, already stored, or pending for this request's own store",
                )
        if not done:
            return ()
        taken = set(done)
        remaining = [
            kept
            for kept in (tuple(k for k in store if k not in taken) for store in self.stores[req_id])
            if kept
        ]
        if remaining:
            self.stores[req_id] = remaining
        else:
            del self.stores[req_id]
        return tuple(done)

    def refusal_of_load(
        self, method: str, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> Exception:
        """The error for a ``prepare_load`` naming a key that is not readable.

        Raises the ``TypeError`` itself if ``keys`` holds something that is not a key.
        """
        check_offload_keys(method, keys, req_context)
        get = self._policy.get
        for key in keys:
            block = get(key)
            if block is None or block.ref_cnt < 0:
                return OffloadKeyStateError(
                    method,
                    key,
                    req_context.req_id,
                    self.describe(key),
                    "a ready block (lookup() returned True)",
                )
        raise AssertionError(f"{method}: no unreadable key among {len(keys)} keys")

    def describe(self, key: OffloadKey) -> str:
        """The state of ``key`` in words, naming the requests that hold it (error messages)."""
        block = self._policy.get(key)
        if block is None:
            return "not offloaded"
        if block.ref_cnt < 0:
            writers = [
                req_id
                for req_id, calls in self.stores.items()
                if any(key in store for store in calls)
            ]
            return f"being written (its store is pending for request {writers[0]!r})"
        if block.ref_cnt == 0:
            return "ready and not pinned"
        holders = {}
        for req_id, calls in self.loads.items():
            count = sum(load.count(key) for load in calls)
            if count:
                holders[req_id] = count
        by = ", ".join(f"{req_id!r} x{count}" for req_id, count in holders.items())
        return f"ready and pinned {block.ref_cnt} time(s), by request(s) {by}"

    def _pins(self, req_id: str) -> dict[OffloadKey, int]:
        pins: dict[OffloadKey, int] = {}
        for load in self.loads.get(req_id, ()):
            for key in load:
                pins[key] = pins.get(key, 0) + 1
        return pins


def _take_call(calls_by_req: Calls, req_id: str, keys: tuple[OffloadKey, ...]) -> bool:
    """Remove ``keys`` from ``calls_by_req[req_id]`` if one outstanding call had exactly them."""
    calls = calls_by_req.get(req_id)
    if calls is None:
        return False
    try:
        calls.remove(keys)
    except ValueError:
        return False
    if not calls:
        del calls_by_req[req_id]
    return True


def _add_call(calls_by_req: Calls, req_id: str, keys: tuple[OffloadKey, ...]) -> None:
    """Append ``keys`` to ``calls_by_req[req_id]`` (creating the request's list)."""
    calls = calls_by_req.get(req_id)
    if calls is None:
        calls_by_req[req_id] = [keys]
    else:
        calls.append(keys)
