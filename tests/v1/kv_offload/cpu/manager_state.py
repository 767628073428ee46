# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What tests read of a ``CPUOffloadingManager``'s inner state, and its full invariant check.

Production code has no use for these (the manager's public API answers what the engine and
operators ask: ``lookup``, ``get_stats``, ``num_free_blocks``, ``has_pending_stores``), but a
test that proves "a refused call changed nothing" or "every pin belongs to its request" must see
the pins, the pending stores, the free list and the pending events themselves. So they are read
here, in one place, and nowhere else in the tests.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingEvent, OffloadKey
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.request_ledger import RequestLedger


def _ledger(manager: CPUOffloadingManager) -> RequestLedger:
    # private: the ledger is the manager's own: no public way to list another request's pins exists,
    # on purpose (a caller may only release what it holds).
    return manager._ledger


def load_pins(manager: CPUOffloadingManager, req_id: str) -> dict[OffloadKey, int]:
    """The pins request ``req_id`` holds: key -> number of outstanding ``prepare_load`` s."""
    pins: dict[OffloadKey, int] = {}
    for load in _ledger(manager).loads.get(req_id, ()):
        for key in load:
            pins[key] = pins.get(key, 0) + 1
    return pins


def pending_stores(manager: CPUOffloadingManager, req_id: str) -> list[OffloadKey]:
    """The keys request ``req_id`` prepared to store and has not completed, in order."""
    return [key for store in _ledger(manager).stores.get(req_id, ()) for key in store]


def owners(manager: CPUOffloadingManager) -> set[str]:
    """Every request id (internal owners included) that holds a pin or a pending store."""
    ledger = _ledger(manager)
    return set(ledger.loads) | set(ledger.stores)


def pending_events(manager: CPUOffloadingManager) -> list[OffloadingEvent]:
    """The events ``take_events`` would return, without draining them."""
    # private: take_events drains; a test comparing states before and after a call must not.
    return list(manager._events or ())


def free_rows(manager: CPUOffloadingManager) -> list[int]:
    """The recycled rows, in the order the allocator takes them (from the end)."""
    # private: the order decides which row the next store gets; only the allocator needs it.
    return list(manager._free_list)


def check_invariants(manager: CPUOffloadingManager) -> None:
    """Assert every invariant of the manager's state; O(cache size).

    Slot accounting; each ready block's ``ref_cnt`` equals its pins in outstanding loads; each
    block being written is pending in exactly one request's stores; no empty ledger entries;
    the row status pool (a resident block's status is its row's; a row held by no block has
    ``ref_cnt == -1``, ready to be written).
    """
    policy = manager.policy
    ledger = _ledger(manager)
    # private: the row status pool is the allocator's alone.
    rows: list[Any] = manager._rows
    free_list = free_rows(manager)
    # Slot accounting: the rows handed out, less the free-listed ones, are the resident blocks.
    assert manager.num_free_blocks + len(policy) == manager.num_blocks, (
        f"slot accounting broken: {manager.num_free_blocks} free + {len(policy)} resident "
        f"!= {manager.num_blocks} rows"
    )
    assert len(set(free_list)) == len(free_list), "a row is free-listed twice"
    pins: dict[OffloadKey, int] = {}
    for req_id, calls in ledger.loads.items():
        assert calls and all(calls), f"request {req_id!r}: empty pending-load entry"
        for load in calls:
            for key in load:
                pins[key] = pins.get(key, 0) + 1
    writers: dict[OffloadKey, str] = {}
    for req_id, calls in ledger.stores.items():
        assert calls and all(calls), f"request {req_id!r}: empty pending-store entry"
        for store in calls:
            for key in store:
                assert key not in writers, (
                    f"key {key.hex()} pending for requests {writers[key]!r} and {req_id!r}"
                )
                writers[key] = req_id
    held: set[int] = set()
    for key, block in policy.items():
        assert block.block_id not in held, f"row {block.block_id} held twice"
        held.add(block.block_id)
        assert rows[block.block_id] is block, (
            f"key {key.hex()}: its status is not row {block.block_id}'s"
        )
        if block.ref_cnt < 0:
            assert block.ref_cnt == -1, f"key {key.hex()}: ref_cnt {block.ref_cnt}"
            assert key in writers, f"key {key.hex()} is being written by no request"
            assert key not in pins, f"key {key.hex()} is pinned while being written"
        else:
            assert key not in writers, f"key {key.hex()} is ready but pending"
            assert block.ref_cnt == pins.get(key, 0), (
                f"key {key.hex()}: ref_cnt {block.ref_cnt} != {pins.get(key, 0)} pins"
            )
    for row, block in enumerate(rows):
        assert row in held or block.ref_cnt == -1, (
            f"free row {row} has ref_cnt {block.ref_cnt}, not -1"
        )
    assert set(writers) <= {k for k, b in policy.items() if b.ref_cnt < 0}
    assert set(pins) <= {k for k, b in policy.items() if b.ref_cnt > 0}
