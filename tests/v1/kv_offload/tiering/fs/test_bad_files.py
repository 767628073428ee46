# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""One bad file must not wipe the fs tier (issue #12, part 2).

* A file named like a block whose size is not exactly one block file of this geometry is deleted
  and counted as corrupt wherever the tier meets it (start-up scan, lookup probe, store); it is
  never indexed, so it can never make the tier evict valid blocks to "fit" it.
* A block file that keeps failing to read (a transient error such as EACCES) is retried a bounded
  number of times (``max_read_failures``), then no longer served, and the next store replaces it.
* A non-directory in place of a capacity-slot directory is replaced by a directory, at start and
  while the tier runs; a slot directory the tier cannot use makes it refuse to start, naming it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.fs import block_io

from .conftest import (
    ROW_BYTES,
    Primary,
    TierFactory,
    key_of,
    load,
    resolve_lookups,
    share,
    store,
)
from .tier_state import block_file, check_index, counters, index_of, lru_keys, scan_stats, usage

FILE_SIZE = HEADER_SIZE + ROW_BYTES
HUGE = 2 << 30  # 2 GiB, sparse: no real disk space is used


def _plant(path: str, size: int) -> None:
    """A file of ``size`` bytes (sparse) at ``path``, directories created."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)


@pytest.mark.parametrize("size", [HUGE, FILE_SIZE + 1, FILE_SIZE - 1, 0], ids=str)
def test_scan_deletes_a_wrong_size_file_instead_of_evicting_valid_blocks(
    make_tier: TierFactory, primary: Primary, size: int
) -> None:
    keys = [key_of(i) for i in range(8)]
    first = make_tier()
    assert store(first, primary, keys[:4], [0, 1, 2, 3])
    assert store(first, primary, keys[4:], [4, 5, 6, 7])
    bad_path = block_file(first, key_of(100))
    first.shutdown()
    _plant(bad_path, size)

    second = make_tier(max_bytes=8 * FILE_SIZE)
    scan = scan_stats(second)
    assert scan is not None and scan.completed
    assert not os.path.exists(bad_path), "the wrong-size file is deleted"
    assert scan.invalid_removed == 1 and counters(second)["corrupt_removed"] == 1
    assert scan.blocks == 8, "the wrong-size file is never indexed"
    assert usage(second).used_bytes == 8 * FILE_SIZE
    assert counters(second).get("blocks_evicted", 0) == 0, "no valid block was evicted"
    assert load(second, primary, keys[:4], [8, 9, 10, 11])
    assert all(primary.holds(8 + i, key) for i, key in enumerate(keys[:4]))
    check_index(second)


def test_lookup_probe_deletes_a_wrong_size_file_and_never_indexes_it(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE)
    share(tier, make_tier())  # with another writer, keys the index lacks are probed
    keys = [key_of(i) for i in range(3)]
    assert store(tier, primary, keys, [0, 1, 2])
    bad = key_of(100)
    _plant(block_file(tier, bad), HUGE)
    assert resolve_lookups(tier, [bad, *keys]) == [False, True, True, True]
    assert not os.path.exists(block_file(tier, bad))
    assert usage(tier).used_bytes == 3 * FILE_SIZE and bad not in index_of(tier)
    assert counters(tier)["corrupt_removed"] == 1
    # The next store has room without evicting anything.
    assert store(tier, primary, [key_of(3)], [3])
    assert all(os.path.exists(block_file(tier, key)) for key in keys)
    check_index(tier)


def test_store_deletes_a_truncated_file_before_rewriting_it(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    os.truncate(block_file(tier, key), 100)
    assert store(tier, primary, [key], [0])
    assert counters(tier)["corrupt_removed"] == 1
    assert usage(tier).used_bytes == FILE_SIZE
    assert load(tier, primary, [key], [1]) and primary.holds(1, key)


class _FailingOpen:
    """Makes ``os.open`` of one block file name fail with EACCES while ``on`` (for tiers made
    with the ``python_io`` fixture: the batched calls do not go through ``os.open``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.name = name
        self.on = True
        self.calls = 0
        real_open = os.open

        def fake_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if self.on and path == self.name:
                self.calls += 1
                raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(block_io.os, "open", fake_open)


@pytest.mark.usefixtures("python_io")
def test_a_block_that_keeps_failing_to_read_is_dropped_then_replaced(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(max_read_failures=3)
    key, other = key_of(1), key_of(2)
    assert store(tier, primary, [key, other], [0, 1])
    path = block_file(tier, key)
    inode = os.stat(path).st_ino
    failing = _FailingOpen(monkeypatch, Path(path).name)
    for attempt in range(3):
        # Each new request finds the block (the file is there, whole) and tries to load it.
        assert resolve_lookups(tier, [key]) == [True], f"attempt {attempt}"
        assert not load(tier, primary, [key], [4])
        assert os.path.exists(path), "a transient error never deletes the file"
    assert failing.calls == 3
    # Bounded: after three failed reads the block is no longer served ...
    assert resolve_lookups(tier, [key, other]) == [False, True]
    assert failing.calls == 3
    # ... it stays accounted (it still occupies the disk) but is the first eviction victim ...
    assert lru_keys(tier)[0] == key
    assert usage(tier).used_bytes == 2 * FILE_SIZE
    # ... and the next store replaces it instead of skipping it as already present.
    written = counters(tier)["blocks_written"]
    assert store(tier, primary, [key], [0])
    assert counters(tier)["blocks_written"] == written + 1
    assert os.stat(path).st_ino != inode
    failing.on = False
    assert resolve_lookups(tier, [key]) == [True]
    assert load(tier, primary, [key], [5]) and primary.holds(5, key)
    assert usage(tier).used_bytes == 2 * FILE_SIZE
    check_index(tier)


@pytest.mark.usefixtures("python_io")
def test_read_failures_must_be_consecutive(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(max_read_failures=2)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    failing = _FailingOpen(monkeypatch, Path(block_file(tier, key)).name)
    for _ in range(3):
        failing.on = True
        assert not load(tier, primary, [key], [4])
        failing.on = False
        assert load(tier, primary, [key], [4]) and primary.holds(4, key)
    assert resolve_lookups(tier, [key]) == [True]


@pytest.mark.usefixtures("python_io")
def test_a_block_replaced_by_another_instance_is_served_again(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(max_read_failures=1)
    other = make_tier()
    share(tier, other)
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    path = block_file(tier, key)
    failing = _FailingOpen(monkeypatch, Path(path).name)
    assert not load(tier, primary, [key], [4])
    assert resolve_lookups(tier, [key]) == [False]
    failing.on = False
    # Another instance rewrites the file (a new inode): this tier serves it again.
    os.unlink(path)
    assert store(other, primary, [key], [0])
    assert resolve_lookups(tier, [key]) == [True]
    assert load(tier, primary, [key], [5]) and primary.holds(5, key)


# ---------------------------------------------------------------------------------------------
# Damaged capacity-slot directories (issue #22 item 3)
# ---------------------------------------------------------------------------------------------


def _plant_non_directory(path: Path, kind: str, outside: Path) -> None:
    if kind == "file":
        path.write_bytes(b"not a directory")
    elif kind == "symlink to a directory":
        outside.mkdir(exist_ok=True)
        path.symlink_to(outside)
    else:  # a dangling symlink
        path.symlink_to(outside / "nowhere")


def _slot_names(rank_dir: Path) -> list[Path]:
    return sorted(p for p in (rank_dir / "slots").rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["file", "symlink to a directory", "dangling symlink"])
@pytest.mark.parametrize("where", ["slots", "slots/000"])
def test_a_non_directory_in_place_of_a_slot_directory_is_replaced_at_start(
    make_tier: TierFactory,
    primary: Primary,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    where: str,
) -> None:
    """Every store of a small cache goes through ``slots/000``: one file or symlink there made
    591 of 591 stores fail while the run looked healthy."""
    first = make_tier(max_bytes=4 * FILE_SIZE)
    rank_dir = Path(first.rank_dir)
    first.shutdown()
    shutil.rmtree(rank_dir / "slots")
    if where == "slots/000":
        (rank_dir / "slots").mkdir()
    outside = tmp_path / "outside"
    _plant_non_directory(rank_dir / where, kind, outside)

    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        tier = make_tier(max_bytes=4 * FILE_SIZE)
    assert any(str(rank_dir / where) in r.getMessage() for r in caplog.records), caplog.text
    assert (rank_dir / where).is_dir() and not (rank_dir / where).is_symlink()
    keys = [key_of(i) for i in range(3)]
    assert store(tier, primary, keys, [0, 1, 2])
    assert counters(tier)["blocks_written"] == 3 and counters(tier).get("store_failures", 0) == 0
    assert len(_slot_names(rank_dir)) == 3, "every block file holds a slot"
    assert not outside.exists() or not any(outside.iterdir()), "nothing written through a link"
    assert load(tier, primary, keys, [4, 5, 6]) and primary.holds(4, keys[0])


def test_a_slot_directory_removed_while_the_tier_runs_is_recreated(
    make_tier: TierFactory, primary: Primary, caplog: pytest.LogCaptureFixture
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE)
    rank_dir = Path(tier.rank_dir)
    assert store(tier, primary, [key_of(0)], [0])
    shutil.rmtree(rank_dir / "slots" / "000")
    (rank_dir / "slots" / "000").write_bytes(b"")  # and a file in its place
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        assert store(tier, primary, [key_of(1), key_of(2)], [1, 2])
    assert str(rank_dir / "slots" / "000") in caplog.text
    assert (rank_dir / "slots" / "000").is_dir()
    assert len(_slot_names(rank_dir)) == 2, "the new blocks hold slots"


def test_the_whole_slots_tree_removed_while_the_tier_runs_is_recreated(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(max_bytes=4 * FILE_SIZE)
    rank_dir = Path(tier.rank_dir)
    assert store(tier, primary, [key_of(0)], [0])
    shutil.rmtree(rank_dir / "slots")
    assert store(tier, primary, [key_of(1)], [1])
    assert len(_slot_names(rank_dir)) == 1


def _make_unwritable(path: Path) -> Callable[[], None]:
    """Make directory ``path`` refuse new entries, even to root (``chattr +i``) where possible;
    returns the undo. Skips when neither way works here."""
    if os.geteuid() != 0:
        path.chmod(0o500)
        return lambda: path.chmod(0o700)
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no way to make a directory unwritable")
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not permitted here: {done.stderr.decode().strip()}")
    return lambda: subprocess.run(["chattr", "-i", str(path)], check=True)


def test_an_unwritable_slot_directory_is_refused_at_start_naming_it(
    make_tier: TierFactory, primary: Primary
) -> None:
    first = make_tier(max_bytes=4 * FILE_SIZE)
    assert store(first, primary, [key_of(0)], [0])
    slot_dir = Path(first.rank_dir) / "slots" / "000"
    first.shutdown()
    undo = _make_unwritable(slot_dir)
    try:
        with pytest.raises(OSError, match=re.escape(str(slot_dir))):
            make_tier(max_bytes=4 * FILE_SIZE)
    finally:
        undo()
