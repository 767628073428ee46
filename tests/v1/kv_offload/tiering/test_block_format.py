# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the block header: round trip, detection of every kind of damage, keyed integrity."""

from __future__ import annotations

import hashlib
import mmap
import struct
import zlib
from pathlib import Path

import pytest

from tests.v1.kv_offload.tiering.key_files import key_file
from vllm.v1.kv_offload.tiering.block_format import (
    CHECKSUM_CRC32,
    CHECKSUM_CRC32C,
    FLAG_KEYED,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    BlockFileCorrupt,
    BlockForged,
    BlockNotAuthenticated,
    IntegrityKey,
    PayloadChecksum,
    decode_header,
    encode_block_header,
    encode_header,
    file_size,
    payload_checksum,
    verify_block,
    write_block_header,
)

DIGEST = hashlib.sha256(b"run").digest()
KEY = hashlib.sha256(b"block").digest() + b"\x00\x00\x00\x03"
PAYLOAD_LEN = 1 << 20


def _header(key: bytes = KEY, checksum: int = 1234) -> bytearray:
    buf = bytearray(b"\xff" * HEADER_SIZE)  # stale bytes must be overwritten
    encode_header(
        memoryview(buf), key=key, run_digest=DIGEST, payload_len=PAYLOAD_LEN, checksum=checksum
    )
    return buf


def test_round_trip_and_zero_padding() -> None:
    buf = _header()
    assert decode_header(memoryview(buf), key=KEY, run_digest=DIGEST, payload_len=PAYLOAD_LEN) == (
        KEY,
        PayloadChecksum(CHECKSUM_CRC32C, 1234),  # the default kind
    )
    assert (
        decode_header(memoryview(buf), key=None, run_digest=DIGEST, payload_len=PAYLOAD_LEN)[0]
        == KEY
    )
    assert not any(buf[68 + len(KEY) + 4 :])
    assert file_size(PAYLOAD_LEN) == HEADER_SIZE + PAYLOAD_LEN


def test_every_single_bit_flip_of_the_header_is_detected() -> None:
    used = 68 + len(KEY) + 4
    for byte in range(used):
        for bit in (0, 7):
            buf = _header()
            buf[byte] ^= 1 << bit
            with pytest.raises(BlockFileCorrupt):
                decode_header(memoryview(buf), key=KEY, run_digest=DIGEST, payload_len=PAYLOAD_LEN)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"key": KEY[:-1] + b"\x04"}, "holds key"),
        ({"run_digest": bytes(32)}, "another run"),
        ({"payload_len": PAYLOAD_LEN + 4096}, "payload length"),
    ],
)
def test_foreign_headers_are_rejected(kwargs: dict[str, object], reason: str) -> None:
    args: dict[str, object] = {"key": KEY, "run_digest": DIGEST, "payload_len": PAYLOAD_LEN}
    args.update(kwargs)
    with pytest.raises(BlockFileCorrupt, match=reason):
        decode_header(memoryview(_header()), **args)  # type: ignore[arg-type]


def test_garbage_and_short_headers_are_rejected() -> None:
    with pytest.raises(BlockFileCorrupt, match="magic"):
        decode_header(memoryview(bytes(HEADER_SIZE)), key=KEY, run_digest=DIGEST, payload_len=1)
    with pytest.raises(BlockFileCorrupt, match="header of"):
        decode_header(memoryview(bytes(100)), key=KEY, run_digest=DIGEST, payload_len=1)


def test_key_length_limits() -> None:
    longest = b"k" * MAX_KEY_BYTES
    buf = _header(key=longest)
    assert decode_header(memoryview(buf), key=longest, run_digest=DIGEST, payload_len=PAYLOAD_LEN)
    with pytest.raises(ValueError, match="exceeds"):
        _header(key=longest + b"k")


@pytest.mark.parametrize("kind", [CHECKSUM_CRC32, CHECKSUM_CRC32C])
def test_checksum_sees_a_single_bit_flip_anywhere(kind: int) -> None:
    mm = mmap.mmap(-1, PAYLOAD_LEN)
    view = memoryview(mm)
    view[:] = hashlib.shake_128(b"payload").digest(PAYLOAD_LEN)
    reference = payload_checksum(view, kind)
    for offset in (0, 4095, PAYLOAD_LEN // 2, PAYLOAD_LEN - 1):
        view[offset] ^= 0x01
        assert payload_checksum(view, kind) != reference
        view[offset] ^= 0x01
    assert payload_checksum(view, kind) == reference
    view.release()
    mm.close()


@pytest.mark.parametrize("kind", [CHECKSUM_CRC32, CHECKSUM_CRC32C])
def test_verify_block_accepts_both_kinds_and_rejects_any_mismatch(kind: int) -> None:
    payload = memoryview(hashlib.shake_128(b"p").digest(PAYLOAD_LEN))
    block = encode_block_header(KEY, DIGEST, payload, kind) + payload.tobytes()
    assert verify_block(block, key=KEY, run_digest=DIGEST, payload_len=PAYLOAD_LEN) == payload
    flipped = bytearray(block)
    flipped[-1] ^= 0x80
    bad: list[tuple[bytes, dict[str, object], str]] = [
        (block[:-1], {}, "bytes, expected"),  # truncated
        (block + b"x", {}, "bytes, expected"),  # padded
        (bytes(flipped), {}, "payload checksum"),
        (block, {"key": KEY[:-1] + b"\x04"}, "holds key"),  # another key's valid block
        (block, {"run_digest": bytes(32)}, "another run"),
        (b"garbage" * 10, {}, "bytes, expected"),
    ]
    for value, override, reason in bad:
        args: dict[str, object] = {"key": KEY, "run_digest": DIGEST, "payload_len": PAYLOAD_LEN}
        args.update(override)
        with pytest.raises(BlockFileCorrupt, match=reason):
            verify_block(value, **args)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Keyed integrity
# ---------------------------------------------------------------------------------------------

SECRET = b"\x00fleet secret, binary\xff"
FLEET = IntegrityKey(SECRET)
PAYLOAD = memoryview(hashlib.shake_128(b"p").digest(1 << 16))


def _keyed(payload: memoryview = PAYLOAD, key: IntegrityKey = FLEET) -> bytearray:
    return bytearray(encode_block_header(KEY, DIGEST, payload, integrity=key)) + payload


def _verify(block: bytes | bytearray, integrity: IntegrityKey | None = FLEET) -> memoryview:
    return verify_block(
        bytes(block), key=KEY, run_digest=DIGEST, payload_len=len(PAYLOAD), integrity=integrity
    )


@pytest.mark.parametrize(
    ("kind", "sha256"),
    [
        (CHECKSUM_CRC32, "f578e72941eeb176a8fd2fc5b40e0b6adca0883bfbbf5edfc39eece08c80a896"),
        (CHECKSUM_CRC32C, "5d9db2c90ac1602330ae5a9427f890fa95aadc54473107d37faf300e9ee786e8"),
    ],
)
def test_unkeyed_headers_are_byte_identical_to_the_format_before_integrity(
    kind: int, sha256: str
) -> None:
    # Pinned to headers written before keyed integrity existed: existing caches stay readable
    # and blocks written now are the same bytes.
    header = encode_block_header(KEY, DIGEST, PAYLOAD, kind)
    assert hashlib.sha256(header).hexdigest() == sha256


@pytest.mark.parametrize("integrity", [None, FLEET])
def test_a_header_written_in_place_is_the_value_header(integrity: IntegrityKey | None) -> None:
    # The fs tier writes headers into its page-aligned buffers, the redis tier takes them as
    # bytes: one format, CRC-32C by default in both.
    buf = bytearray(b"\xff" * HEADER_SIZE)  # stale bytes must be overwritten
    write_block_header(memoryview(buf), PAYLOAD, key=KEY, run_digest=DIGEST, integrity=integrity)
    assert bytes(buf) == encode_block_header(KEY, DIGEST, PAYLOAD, integrity=integrity)
    assert int.from_bytes(buf[24:28], "little") == CHECKSUM_CRC32C
    assert _verify(bytes(buf) + PAYLOAD.tobytes(), integrity=integrity) == PAYLOAD


def test_keyed_round_trip_says_so_in_the_header_with_a_key_id() -> None:
    block = _keyed()
    assert _verify(block) == PAYLOAD
    flags = int.from_bytes(block[10:12], "little")
    assert flags == FLAG_KEYED
    assert FLEET.key_id in block[:HEADER_SIZE] and len(FLEET.key_id) == 8
    assert SECRET not in block and IntegrityKey(SECRET).key_id == FLEET.key_id
    # A reader without a key reads a keyed block by its CRCs, as before.
    assert _verify(block, integrity=None) == PAYLOAD
    assert repr(FLEET) == f"IntegrityKey(key_id={FLEET.key_id.hex()})"


def test_a_block_correct_in_every_field_but_its_mac_is_forged() -> None:
    # A writer without the secret: header and payload CRCs right, MAC made with another key but
    # the fleet's key id (what a forger copying a real header would write).
    forged = _keyed(key=IntegrityKey(b"not the fleet's secret!"))
    good = _keyed()
    trailer = 68 + len(KEY) + 4
    forged[trailer + 4 : trailer + 12] = FLEET.key_id
    assert forged[:trailer] == good[:trailer] and forged[HEADER_SIZE:] == good[HEADER_SIZE:]
    with pytest.raises(BlockForged, match="MAC mismatch"):
        _verify(forged)
    assert issubclass(BlockForged, BlockFileCorrupt)  # deleted like any corrupt block


@pytest.mark.parametrize("where", ["payload", "padding", "mac", "key_id_and_crc"])
def test_any_change_to_a_keyed_block_is_refused(where: str) -> None:
    block = _keyed()
    trailer = 68 + len(KEY) + 4
    if where == "payload":
        # Both CRCs recomputed, as a forger would: only the MAC catches it.
        payload = bytearray(PAYLOAD)
        payload[100] ^= 1
        block = bytearray(block[:HEADER_SIZE]) + payload
        struct.pack_into("<I", block, 28, payload_checksum(memoryview(payload), CHECKSUM_CRC32C))
        end = 68 + len(KEY)
        struct.pack_into("<I", block, end, zlib.crc32(bytes(block[:end])))
        with pytest.raises(BlockForged):
            _verify(block)
        return
    if where == "padding":
        block[HEADER_SIZE - 1] = 1
    elif where == "mac":
        block[trailer + 12] ^= 1
    else:
        block[trailer + 4] ^= 1  # another key id: not ours, so not forged either
        with pytest.raises(BlockNotAuthenticated, match="another key"):
            _verify(block)
        return
    with pytest.raises(BlockForged):
        _verify(block)


def test_an_unkeyed_block_is_refused_by_a_reader_that_requires_a_key() -> None:
    block = encode_block_header(KEY, DIGEST, PAYLOAD) + PAYLOAD.tobytes()
    with pytest.raises(BlockNotAuthenticated, match="without an integrity key") as info:
        _verify(block)
    assert info.value.key_id is None
    assert not isinstance(info.value, BlockFileCorrupt), "a miss, not deleted"
    with pytest.raises(BlockNotAuthenticated):  # a header-only scan refuses it too
        decode_header(
            memoryview(block)[:HEADER_SIZE],
            key=None,
            run_digest=DIGEST,
            payload_len=len(PAYLOAD),
            integrity=FLEET,
        )


def test_after_a_key_change_old_blocks_are_misses_not_forgeries() -> None:
    old = _keyed(key=IntegrityKey(b"last year's secret"))
    new_key = IntegrityKey(b"this year's secret")
    with pytest.raises(BlockNotAuthenticated, match="another key") as info:
        _verify(old, integrity=new_key)
    assert info.value.key_id == IntegrityKey(b"last year's secret").key_id
    assert not isinstance(info.value, BlockFileCorrupt)


def test_keyed_blocks_still_fail_as_corrupt_for_accidents() -> None:
    block = _keyed()
    block[-1] ^= 0x80  # a bit flip the CRC catches: corrupt, not forged
    with pytest.raises(BlockFileCorrupt, match="payload checksum") as info:
        _verify(block)
    assert not isinstance(info.value, BlockForged)
    with pytest.raises(BlockFileCorrupt, match="holds key"):  # a valid block moved to another key
        verify_block(
            bytes(_keyed()),
            key=KEY[:-1] + b"\x09",
            run_digest=DIGEST,
            payload_len=len(PAYLOAD),
            integrity=FLEET,
        )


def test_keyed_key_length_limit_and_missing_payload() -> None:
    buf = memoryview(bytearray(HEADER_SIZE))
    with pytest.raises(ValueError, match="needs the payload"):
        encode_header(buf, key=KEY, run_digest=DIGEST, payload_len=4, checksum=0, integrity=FLEET)
    with pytest.raises(ValueError, match="exceeds"):
        encode_block_header(b"k" * MAX_KEY_BYTES, DIGEST, PAYLOAD, integrity=FLEET)


def test_secrets_from_files_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Path(key_file(tmp_path, SECRET))
    assert IntegrityKey.from_file(str(path)).key_id == FLEET.key_id  # raw bytes, not stripped
    path.write_bytes(SECRET + b"\n")
    assert IntegrityKey.from_file(str(path)).key_id != FLEET.key_id
    monkeypatch.setenv("KVO_TEST_SECRET", "a text secret of 24 bytes")
    env_key = IntegrityKey.from_config(env="KVO_TEST_SECRET", file=None, tier="t")
    assert env_key is not None
    assert env_key.key_id == IntegrityKey(b"a text secret of 24 bytes").key_id
    assert IntegrityKey.from_config(env=None, file=None, tier="t") is None


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("short_file", "holds 15 bytes; at least 16"),
        ("group_readable", "accessible to other users"),
        ("other_readable", "accessible to other users"),
        ("missing_file", "cannot be read"),
        ("directory", "not a regular file|cannot be read"),
        ("short_env", "holds 3 bytes"),
        ("unset_env", "is not set"),
        ("both", "at most one"),
        ("empty_name", "'integrity_key_env'=''"),
    ],
)
def test_bad_secrets_are_refused_without_showing_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setup: str, match: str
) -> None:
    path = tmp_path / "key"
    secret = b"S3cret-S3cret-S3cret"
    path.write_bytes(secret)
    path.chmod(0o600)
    env: str | None = None
    file: str | None = str(path)
    if setup == "short_file":
        path.write_bytes(secret[:15])
    elif setup == "group_readable":
        path.chmod(0o640)
    elif setup == "other_readable":
        path.chmod(0o604)
    elif setup == "missing_file":
        file = str(tmp_path / "nope")
    elif setup == "directory":
        file = str(tmp_path)
    elif setup in ("short_env", "unset_env", "empty_name", "both"):
        file = None if setup != "both" else file
        env = "" if setup == "empty_name" else "KVO_TEST_SECRET"
        if setup == "short_env":
            monkeypatch.setenv("KVO_TEST_SECRET", "S3c")
        else:
            monkeypatch.delenv("KVO_TEST_SECRET", raising=False)
    with pytest.raises(ValueError, match=match) as info:
        IntegrityKey.from_config(env=env, file=file, tier="redis")
    assert str(info.value).startswith("redis tier: ")
    assert "S3c" not in str(info.value)
