# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the block file header: round trip and detection of every kind of damage."""

from __future__ import annotations

import hashlib
import mmap

import pytest

from vllm.v1.kv_offload.tiering.block_format import (
    CHECKSUM_CRC32,
    CHECKSUM_CRC32C,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    BlockFileCorrupt,
    PayloadChecksum,
    decode_header,
    encode_block_header,
    encode_header,
    file_size,
    payload_checksum,
    verify_block,
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
        PayloadChecksum(CHECKSUM_CRC32, 1234),
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
