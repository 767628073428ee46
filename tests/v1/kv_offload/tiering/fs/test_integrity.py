# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Keyed integrity in the fs tier (issue #23 item 4): with a fleet secret every block file carries
a MAC; a file whose MAC does not verify is a miss, deleted, counted, never served, however valid
its CRCs; a file written without the secret (or under another) is a miss, kept, not called
forged; a tier without a secret reads unkeyed caches as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm.v1.kv_offload.tiering.block_format import (
    FLAG_KEYED,
    HEADER_SIZE,
    IntegrityKey,
)

from ..key_files import SECRET, key_file
from .conftest import Primary, TierFactory, key_of, load, reseal_block_file, resolve_lookups, store
from .tier_state import block_file


def _flags(path: str) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(12)[10:12], "little")


def _forge(path: str) -> None:
    """Change one payload byte and recompute both CRCs, as anyone who can write to the root can:
    the header stays well-formed, bound to its key and run; only the MAC no longer matches."""

    def flip(data: bytearray) -> None:
        data[HEADER_SIZE + 100] ^= 0xFF

    reseal_block_file(path, flip)


def test_a_keyed_fleet_shares_blocks_bit_exact(
    make_tier: TierFactory, primary: Primary, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "a printable fleet secret"  # an environment variable holds no NUL byte
    monkeypatch.setenv("KVO_FLEET_SECRET", text)
    writer = make_tier(integrity_key_file=key_file(tmp_path, text.encode()))
    keys = [key_of(i) for i in range(3)]
    assert store(writer, primary, keys, [0, 1, 2])
    assert all(_flags(block_file(writer, k)) & FLAG_KEYED for k in keys)
    writer.shutdown()
    # The same secret from an environment variable: the same key, the blocks verify.
    reader = make_tier(integrity_key_env="KVO_FLEET_SECRET")
    assert reader.config.integrity is not None
    assert reader.config.integrity.key_id == IntegrityKey(text.encode()).key_id
    assert load(reader, primary, keys, [4, 5, 6])
    assert all(primary.holds(4 + i, k) for i, k in enumerate(keys))
    assert text not in repr(reader.config)


def test_a_block_correct_in_every_field_but_its_mac_is_refused_deleted_and_counted(
    make_tier: TierFactory, primary: Primary, tmp_path: Path
) -> None:
    tier = make_tier(integrity_key_file=key_file(tmp_path))
    key, other = key_of(1), key_of(2)
    assert store(tier, primary, [key, other], [0, 1])
    path = block_file(tier, key)
    _forge(path)
    assert not load(tier, primary, [key], [4])
    assert not primary.holds(4, key)
    assert not os.path.exists(path), "a forged block is deleted"
    counters = tier.get_stats().counters
    assert counters["forged_removed"] == 1 and counters["corrupt_removed"] == 0
    assert resolve_lookups(tier, [key, other]) == [False, True]
    # A tier without the secret cannot tell: its CRCs are right. That is what the MAC adds.
    assert store(tier, primary, [key], [0])
    _forge(path)
    tier.shutdown()
    unkeyed = make_tier()
    assert load(unkeyed, primary, [key], [5])


def test_a_block_written_without_the_key_is_a_miss_kept_and_then_replaced(
    make_tier: TierFactory, primary: Primary, tmp_path: Path
) -> None:
    unkeyed = make_tier()
    key = key_of(1)
    assert store(unkeyed, primary, [key], [0])
    unkeyed.shutdown()
    path = tier_path = block_file(unkeyed, key)
    inode = os.stat(path).st_ino
    tier = make_tier(integrity_key_file=key_file(tmp_path))
    assert resolve_lookups(tier, [key]) == [True], "found on disk (the scan reads no header)"
    assert not load(tier, primary, [key], [4])
    assert os.stat(tier_path).st_ino == inode, "neither deleted ..."
    counters = tier.get_stats().counters
    assert counters["unauthenticated_misses"] == 1
    assert counters["forged_removed"] == counters["corrupt_removed"] == 0, "... nor called forged"
    assert resolve_lookups(tier, [key]) == [False], "never served: lookups miss it"
    # The fleet's next store of the block replaces it with a keyed one, which is served.
    assert store(tier, primary, [key], [0])
    assert os.stat(path).st_ino != inode and _flags(path) & FLAG_KEYED
    assert resolve_lookups(tier, [key]) == [True]
    assert load(tier, primary, [key], [5]) and primary.holds(5, key)


def test_a_changed_secret_reads_old_blocks_as_misses(
    make_tier: TierFactory, primary: Primary, tmp_path: Path
) -> None:
    old = make_tier(integrity_key_file=key_file(tmp_path, b"the old fleet secret"))
    key = key_of(1)
    assert store(old, primary, [key], [0])
    old.shutdown()
    new = make_tier(integrity_key_file=key_file(tmp_path, b"the new fleet secret", "new.key"))
    assert not load(new, primary, [key], [4])
    assert os.path.exists(block_file(new, key))
    counters = new.get_stats().counters
    assert counters["unauthenticated_misses"] == 1 and counters["forged_removed"] == 0


def test_without_a_secret_an_unkeyed_cache_is_read_as_before(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier()
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    assert _flags(block_file(tier, key)) == 0, "byte-identical to the format without keys"
    assert load(tier, primary, [key], [4]) and primary.holds(4, key)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"integrity_key_env": "KVO_NO_SUCH_VARIABLE"}, "KVO_NO_SUCH_VARIABLE"),
        ({"integrity_key_env": "A", "integrity_key_file": "/x"}, "at most one"),
        ({"integrity_key_file": ""}, "integrity_key_file"),
    ],
)
def test_integrity_keys_are_validated(
    make_tier: TierFactory, kwargs: dict[str, str], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_tier(**kwargs)


def test_a_key_file_others_may_read_or_too_short_is_refused(
    make_tier: TierFactory, tmp_path: Path
) -> None:
    readable = key_file(tmp_path, mode=0o644)
    with pytest.raises(ValueError, match="fs tier") as info:
        make_tier(integrity_key_file=readable)
    assert SECRET.decode("latin-1") not in str(info.value)
    with pytest.raises(ValueError, match="at least 16"):
        make_tier(integrity_key_file=key_file(tmp_path, b"short", "short.key"))
