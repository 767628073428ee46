# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The background reconcile and the capacity slots, in one process (issue #12, part 3).

Several tiers over one root play the instances that share a directory. Each test drives one
mechanism deterministically: ``wait_reconciled`` waits for a complete reconcile round instead of
sleeping, and races are set up by doing, on the real directory, what the other party would do,
that party included: a live second tier, or the presence file a crashed one leaves. (A tier that
is the only writer walks the directory only when it finds evidence of a change behind its back.)
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.fs import slots as slots_module
from vllm.v1.kv_offload.tiering.fs.block_io import HOST_TAG
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.fs.run_dir import RunDirectory
from vllm.v1.kv_offload.tiering.fs.scan import RankDirWalker
from vllm.v1.kv_offload.tiering.fs.slots import SLOTS_DIR, slot_location

from .conftest import (
    ROW_BYTES,
    Primary,
    TierFactory,
    key_of,
    load,
    register_dead_writer,
    resolve_lookups,
    share,
    store,
)
from .tier_state import (
    block_file,
    check_index,
    counters,
    descriptors_of,
    lru_keys,
    scan_stats,
    slots_of,
    threads_named,
    usage,
)

FILE_SIZE = HEADER_SIZE + ROW_BYTES
FAST: dict[str, Any] = {"reconcile_interval_s": 0.01}
IDLE: dict[str, Any] = {"reconcile_interval_s": 3600}  # no pass after the start-up scan


def _slot_number(path: Path) -> int:
    return int(path.parent.name, 16) * 1024 + int(path.name, 16)


def _inodes(tier: FileSystemSecondaryTier) -> dict[int, tuple[int, list[str]]]:
    """Every regular file under the rank directory: inode -> (size, names)."""
    found: dict[int, tuple[int, list[str]]] = {}
    for dirpath, _, files in os.walk(tier.rank_dir):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            found.setdefault(st.st_ino, (st.st_size, []))[1].append(
                os.path.relpath(os.path.join(dirpath, name), tier.rank_dir)
            )
    return found


def _disk_bytes(tier: FileSystemSecondaryTier) -> int:
    return sum(size for size, _ in _inodes(tier).values())


def _block_files(tier: FileSystemSecondaryTier) -> list[Path]:
    return sorted(Path(tier.rank_dir).rglob("*.bin"))


def _slot_names(tier: FileSystemSecondaryTier) -> list[Path]:
    return sorted(p for p in (Path(tier.rank_dir) / SLOTS_DIR).glob("*/*") if p.name[0] != ".")


def _slot_of(tier: FileSystemSecondaryTier, key: Any) -> Path:
    ino = os.stat(block_file(tier, key)).st_ino
    (slot,) = [p for p in _slot_names(tier) if p.stat().st_ino == ino]
    return slot


# ---------------------------------------------------------------------------------------------
# Convergence
# ---------------------------------------------------------------------------------------------


def _before_each_leaf(monkeypatch: pytest.MonkeyPatch, hook: Callable[[], object]) -> None:
    """Run ``hook`` before the reconcile walk steps over each leaf directory."""
    # private: the walk's step over one leaf directory is the unit a reconcile batch counts,
    # and where a hung filesystem would block; no public hook reaches it.
    real_leaf = RankDirWalker._leaf

    def leaf(self: RankDirWalker, *args: Any) -> int:
        hook()
        return real_leaf(self, *args)

    monkeypatch.setattr(RankDirWalker, "_leaf", leaf)


def test_usage_converges_to_files_other_instances_wrote_and_deleted(
    make_tier: TierFactory, primary: Primary
) -> None:
    a = make_tier(**FAST)
    b = make_tier()
    keys = [key_of(i) for i in range(6)]
    assert store(b, primary, keys, list(range(6)))
    # No lookup, load or store of a touches these keys: only the reconcile can tell it.
    assert a.wait_reconciled(10)
    assert (usage(a).used_bytes, usage(a).num_blocks) == (6 * FILE_SIZE, 6)
    for key in keys[:4]:
        os.unlink(block_file(b, key))  # b (or an operator) deleted them
    assert a.wait_reconciled(10)
    assert (usage(a).used_bytes, usage(a).num_blocks) == (2 * FILE_SIZE, 2)
    assert sorted(lru_keys(a)) == sorted(keys[4:])
    # A whole leaf directory removed by an operator is forgotten too.
    leaf = Path(block_file(b, keys[4])).parent
    for path in leaf.iterdir():
        path.unlink()
    leaf.rmdir()
    assert a.wait_reconciled(10)
    assert usage(a).num_blocks == 1
    check_index(a)


def test_files_found_by_the_reconcile_rank_by_age(make_tier: TierFactory, primary: Primary) -> None:
    a = make_tier(max_bytes=8 * FILE_SIZE, **FAST)
    b = make_tier()
    old, new = key_of(1), key_of(2)
    assert store(b, primary, [old], [0])
    past = os.stat(block_file(b, old)).st_mtime - 3600
    os.utime(block_file(b, old), (past, past))
    assert a.wait_reconciled(10)
    assert store(a, primary, [key_of(3)], [1])
    assert store(b, primary, [new], [2])  # written while a runs: recent
    assert a.wait_reconciled(10)
    assert lru_keys(a) == [old, key_of(3), new]


def test_reconcile_steps_are_bounded(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = make_tier()
    keys = [key_of(i) for i in range(6)]
    assert store(writer, primary, keys, list(range(6)))
    assert len({Path(block_file(writer, k)).parent for k in keys}) == 6
    times: list[float] = []
    _before_each_leaf(monkeypatch, lambda: times.append(time.monotonic()))
    # One entry per step: each leaf directory (2 entries: itself and its file) is a step.
    tier = make_tier(reconcile_interval_s=0.02, reconcile_batch=1)
    times.clear()
    assert tier.wait_reconciled(10)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert len(gaps) >= 5 and min(gaps) >= 0.019, gaps


def test_the_scheduler_never_waits_for_a_stuck_reconcile(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    started, release = threading.Event(), threading.Event()
    tier = make_tier(**FAST)
    make_tier(**IDLE)  # another writer: tier walks the directory again
    key = key_of(1)
    assert store(tier, primary, [key], [0])

    def stuck() -> None:
        started.set()
        assert release.wait(30)

    _before_each_leaf(monkeypatch, stuck)
    # A timeout only tests shorten: no public setting for how long shutdown waits for a thread.
    monkeypatch.setattr(FileSystemSecondaryTier, "_THREAD_STOP_TIMEOUT_S", 0.05)
    try:
        assert started.wait(10)
        assert resolve_lookups(tier, [key]) == [True]
        assert load(tier, primary, [key], [5]) and primary.holds(5, key)
        assert store(tier, primary, [key_of(2)], [1])
        tier.shutdown()  # returns although the reconcile is stuck
        open_fds = descriptors_of(tier.rank_dir)  # kept open for the stuck thread
    finally:
        release.set()
    for thread in threads_named("vllm_fs_tier_fs_scan"):
        thread.join(10)
    for fd in open_fds:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# The bound: capacity slots
# ---------------------------------------------------------------------------------------------


def test_stores_evict_files_other_instances_wrote(make_tier: TierFactory, primary: Primary) -> None:
    a = make_tier(max_bytes=4 * FILE_SIZE)
    b = make_tier(max_bytes=4 * FILE_SIZE)  # started before a wrote: knows none of a's files
    for i in range(4):
        assert store(a, primary, [key_of(i)], [i])
    for i in range(10, 16):
        assert store(b, primary, [key_of(i)], [i % 16])
        assert len(_block_files(a)) <= 4 and _disk_bytes(a) <= 4 * FILE_SIZE
    assert len(_slot_names(a)) == 4
    assert all(p.stat().st_nlink == 2 for p in _block_files(a)), "every block file has a slot"
    assert counters(b)["blocks_evicted"] >= 2


def test_every_block_file_holds_a_slot_and_a_full_directory_evicts_lru(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(max_bytes=3 * FILE_SIZE, enable_events=True)
    keys = [key_of(i) for i in range(5)]
    for i, key in enumerate(keys):
        assert store(tier, primary, [key], [i])
    assert {str(p) for p in _block_files(tier)} == {block_file(tier, k) for k in keys[2:]}
    assert {p.stat().st_ino for p in _slot_names(tier)} == {
        p.stat().st_ino for p in _block_files(tier)
    }
    slots = slots_of(tier)
    assert slots is not None
    believed = {slots.slot_of(p.stat().st_ino) for p in _block_files(tier)}
    assert None not in believed and len(believed) == 3, "the tier knows each file's slot"


@pytest.mark.parametrize("shared", [False, True], ids=["sole writer", "shared root"])
def test_a_garbage_slot_is_freed(make_tier: TierFactory, primary: Primary, shared: bool) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE, **FAST)
    if shared:
        share(tier, make_tier(max_bytes=4 * FILE_SIZE))
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    os.unlink(block_file(tier, key))  # its slot now names an inode nothing else names
    if not shared:
        # Alone, the tier trusts its index until it meets the change: the load that finds the
        # file gone is the evidence that sends the reconcile through the directory.
        assert tier.sole_writer and resolve_lookups(tier, [key]) == [True]
        assert not load(tier, primary, [key], [1])
    assert tier.wait_reconciled(10) and tier.wait_reconciled(10)
    assert _slot_names(tier) == [] and _disk_bytes(tier) == 0
    assert usage(tier).used_bytes == 0


def test_a_crashed_writers_claim_is_freed(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE, **FAST)
    assert store(tier, primary, [key_of(1)], [0])
    leaf = Path(block_file(tier, key_of(1))).parent
    presence = register_dead_writer(tier, create=False)
    pid = presence.name.split(".")[1]
    tmp = leaf / f".{'ab' * 32}.{HOST_TAG}.{pid}.0badc0de.12345678.tmp"
    free = min({0, 1, 2, 3} - {_slot_number(p) for p in _slot_names(tier)})
    sub, name = slot_location(free)
    (Path(tier.rank_dir) / SLOTS_DIR / sub).mkdir(exist_ok=True)
    # As the writer did: the claim (slot link) before the file has any byte.
    staging = Path(tier.rank_dir).parent / "staging"
    staging.write_bytes(b"x" * 100)
    os.link(staging, Path(tier.rank_dir) / SLOTS_DIR / sub / name)
    os.link(staging, tmp)
    staging.unlink()
    # The dead writer's presence file sends the reconcile through the directory: the pass
    # removes its temporary file and frees the slot that file claimed. Created last, as a
    # writer's leftovers are all there before anyone sees it gone (created first, a pass could
    # run between it and the files, forget the writer, and never walk the directory again).
    presence.touch()
    assert tier.wait_reconciled(10) and tier.wait_reconciled(10)
    assert not tmp.exists() and len(_slot_names(tier)) == 1, _inodes(tier)
    assert _disk_bytes(tier) == FILE_SIZE


def test_slotless_files_are_given_slots_up_to_the_bound_at_start(
    make_tier: TierFactory, primary: Primary
) -> None:
    first = make_tier()  # no max_bytes: no slots
    keys = [key_of(i) for i in range(5)]
    assert store(first, primary, keys, list(range(5)))
    first.shutdown()
    second = make_tier(max_bytes=3 * FILE_SIZE, enable_events=True)
    scan = scan_stats(second)
    assert scan is not None and (scan.adopted, scan.unslotted_removed) == (3, 2)
    assert len(_block_files(second)) == 3 and len(_slot_names(second)) == 3
    assert all(p.stat().st_nlink == 2 for p in _block_files(second))
    assert usage(second).used_bytes == 3 * FILE_SIZE
    removed = [k for e in second.take_events() if e.removed for k in e.keys]
    assert len(removed) == 2


def test_lowering_max_bytes_keeps_files_within_the_new_slots(
    make_tier: TierFactory, primary: Primary
) -> None:
    first = make_tier(max_bytes=6 * FILE_SIZE)
    keys = [key_of(i) for i in range(6)]
    assert store(first, primary, keys, list(range(6)))
    first.shutdown()
    second = make_tier(max_bytes=3 * FILE_SIZE, enable_events=True)
    assert second.wait_reconciled(10)
    removed = [k for e in second.take_events() if e.removed for k in e.keys]
    assert len(removed) == 3, "files that lost their slot are reported as evicted"
    slots = _slot_names(second)
    assert len(slots) == 3 and all(_slot_number(p) < 3 for p in slots), slots
    assert len(_block_files(second)) == 3 and _disk_bytes(second) == 3 * FILE_SIZE
    assert usage(second).used_bytes == 3 * FILE_SIZE
    for path in _block_files(second):
        assert path.stat().st_nlink == 2


def test_without_hard_links_instances_evict_each_others_files(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RunDirectory, "supports_hard_links", lambda self, writer: False)
    a = make_tier(max_bytes=4 * FILE_SIZE, **FAST)
    b = make_tier(max_bytes=4 * FILE_SIZE, **FAST)
    assert slots_of(a) is None and slots_of(b) is None
    assert store(a, primary, [key_of(i) for i in range(4)], [0, 1, 2, 3])
    assert store(b, primary, [key_of(i) for i in range(10, 14)], [4, 5, 6, 7])
    # Over the bound (8 files) until the instances reconcile: then each evicts what it finds.
    assert a.wait_reconciled(10) and b.wait_reconciled(10)
    assert a.wait_reconciled(10) and b.wait_reconciled(10)
    assert len(_block_files(a)) <= 4
    for tier in (a, b):
        assert usage(tier).used_bytes == len(_block_files(a)) * FILE_SIZE


# ---------------------------------------------------------------------------------------------
# The slot protocol's races
# ---------------------------------------------------------------------------------------------


def test_a_release_from_stale_knowledge_leaves_a_live_slot_alone(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    slot = _slot_of(tier, key)
    n = _slot_number(slot)
    slots = slots_of(tier)
    assert slots is not None
    assert not slots.release(n, slot.stat().st_ino + 12345)  # not the inode it holds
    assert not slots.release(n, None)  # not garbage: the block file names it too
    assert slot.exists() and os.stat(block_file(tier, key)).st_nlink == 2


def test_a_live_slot_grabbed_by_mistake_is_put_back(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slot changed between a releaser's look and its grab: the grab holds a live inode."""
    tier = make_tier(max_bytes=4 * FILE_SIZE, **IDLE)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    slot = _slot_of(tier, key)
    n = _slot_number(slot)
    real_stat = slots_module.os.stat
    calls = 0

    def garbage_at_first_look(path: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        st = real_stat(path, *args, **kwargs)
        calls += 1
        if calls == 1:  # the look before the grab saw garbage
            return os.stat_result((*st[:3], 1, *st[4:]))
        return st

    slots = slots_of(tier)
    assert slots is not None
    monkeypatch.setattr(slots_module.os, "stat", garbage_at_first_look)
    assert not slots.release(n, None)
    monkeypatch.undo()
    assert slot.exists() and slot.stat().st_ino == os.stat(block_file(tier, key)).st_ino
    assert not [p for p in slot.parent.iterdir() if p.name.startswith(".")], "no grab left"


@pytest.mark.usefixtures("python_io")  # the slot is lost in Python's os.replace
def test_a_published_file_that_lost_its_slot_claims_another(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE, **IDLE)
    real_replace = os.replace

    def lose_the_slot_while_writing(src: Any, dst: Any, **kwargs: Any) -> None:
        """A releaser took the writer's slot by mistake and could not put it back."""
        for p in _slot_names(tier):
            p.unlink()
        real_replace(src, dst, **kwargs)

    from vllm.v1.kv_offload.tiering.fs import block_io

    monkeypatch.setattr(block_io.os, "replace", lose_the_slot_while_writing)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    monkeypatch.undo()
    assert counters(tier)["slots_lost"] == 1
    assert os.stat(block_file(tier, key)).st_nlink == 2 and len(_slot_names(tier)) == 1


def test_a_retransmitted_nfs_link_counts_as_claimed(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE, **IDLE)
    real_link = slots_module.os.link

    def link_then_lose_the_reply(*args: Any, **kwargs: Any) -> None:
        real_link(*args, **kwargs)
        raise FileExistsError("the retransmitted LINK found the name made by the first one")

    monkeypatch.setattr(slots_module.os, "link", link_then_lose_the_reply)
    assert store(tier, primary, [key_of(1)], [0])
    monkeypatch.undo()
    assert len(_slot_names(tier)) == 1
    assert os.stat(block_file(tier, key_of(1))).st_nlink == 2


def test_a_dead_releasers_grab_is_recovered(make_tier: TierFactory, primary: Primary) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE, **FAST)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    slot = _slot_of(tier, key)
    dead = register_dead_writer(tier, create=False)
    grab = slot.parent / f".g0.{HOST_TAG}.{dead.name.split('.')[1]}.0badc0de.12345678.tmp"
    os.rename(slot, grab)  # the releaser died between its grab and its unlink
    # Its presence file after the grab: a round that finds the dead writer also finds its grab
    # (one that ran between the two would end the writer's recovery before the grab existed).
    dead.touch()
    assert tier.wait_reconciled(10) and tier.wait_reconciled(10)
    assert not grab.exists()
    assert len(_slot_names(tier)) == 1 and os.stat(block_file(tier, key)).st_nlink == 2


def test_two_slots_of_one_inode_are_reduced_to_one(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE, **FAST)
    share(tier, make_tier(max_bytes=4 * FILE_SIZE))  # such doubles come from races between them
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    slot = _slot_of(tier, key)
    other = 0 if slot.name != "000" else 1
    sub, name = slot_location(other)
    os.link(slot, Path(tier.rank_dir) / SLOTS_DIR / sub / name)  # raises unless linked
    # (No st_nlink == 3 check here: the background reconcile may already have run.)
    assert tier.wait_reconciled(10)
    assert os.stat(block_file(tier, key)).st_nlink == 2 and len(_slot_names(tier)) == 1
