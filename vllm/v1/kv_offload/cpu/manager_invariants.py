# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The internal invariants of ``CPUOffloadingManager``, checked in full (tests, debugging).

Kept apart from the manager because nothing on a serving path runs it: it walks the whole cache
(O(cache size)) and only reads the manager's state.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.cpu.policies.base import BlockStatus, CachePolicy
from vllm.v1.kv_offload.cpu.request_ledger import Calls


def check_manager_invariants(
    policy: CachePolicy,
    rows: list[BlockStatus],
    num_allocated: int,
    free_list: list[int],
    loads: Calls,
    stores: Calls,
    pool_error: str,
) -> None:
    """Assert every invariant of a manager's state (``CPUOffloadingManager.check_invariants``).

    Args:
        policy: the manager's cache policy (the resident blocks).
        rows: the row status pool, one ``BlockStatus`` per row.
        num_allocated: rows handed out by the bump pointer so far.
        free_list: recycled rows.
        loads: the pins ledger (``req_id -> key tuples of outstanding prepare_load calls``).
        stores: the pending-stores ledger.
        pool_error: the message for broken slot accounting.
    """
    assert num_allocated - len(free_list) == len(policy), pool_error
    assert len(set(free_list)) == len(free_list), "a row is free-listed twice"
    pins: dict[OffloadKey, int] = {}
    for req_id, calls in loads.items():
        assert calls and all(calls), f"request {req_id!r}: empty pending-load entry"
        for load in calls:
            for key in load:
                pins[key] = pins.get(key, 0) + 1
    writers: dict[OffloadKey, str] = {}
    for req_id, calls in stores.items():
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
        if block.ref_cnt < 0:
            assert block.ref_cnt == -1, f"key {key.hex()}: ref_cnt {block.ref_cnt}"
            assert key in writers, f"key {key.hex()} is being written by no request"
            assert key not in pins, f"key {key.hex()} is pinned while being written"
        else:
            assert key not in writers, f"key {key.hex()} is ready but pending"
            assert block.ref_cnt == pins.get(key, 0), (
                f"key {key.hex()}: ref_cnt {block.ref_cnt} != {pins.get(key, 0)} pins"
            )
    # The row status pool: a resident block's status is its row's; a row held by no block
    # is ready to be written (ref_cnt -1), so allocation need not reset it.
    for key, block in policy.items():
        assert rows[block.block_id] is block, (
            f"key {key.hex()}: its status is not row {block.block_id}'s"
        )
    for row, block in enumerate(rows):
        assert row in held or block.ref_cnt == -1, (
            f"free row {row} has ref_cnt {block.ref_cnt}, not -1"
        )
    assert set(writers) <= {k for k, b in policy.items() if b.ref_cnt < 0}
    assert set(pins) <= {k for k, b in policy.items() if b.ref_cnt > 0}
