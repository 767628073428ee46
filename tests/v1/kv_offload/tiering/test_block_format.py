"""Tests of the block file header: round trip and detection of every kind of damage."""

from __future__ import annotations

import hashlib
import mmap

import pytest

from vllm.v1.kv_offload.tiering.block_format import (
    HEADER_SIZE,
    MAX_KEY_BYTES,
    BlockFileCorrupt,
    decode_header,
    encode_header,
    file_size,
    payload_checksum,
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
        1234,
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


def test_checksum_sees_a_single_bit_flip_anywhere() -> None:
    mm = mmap.mmap(-1, PAYLOAD_LEN)
    view = memoryview(mm)
    view[:] = hashlib.shake_128(b"payload").digest(PAYLOAD_LEN)
    reference = payload_checksum(view)
    for offset in (0, 4095, PAYLOAD_LEN // 2, PAYLOAD_LEN - 1):
        view[offset] ^= 0x01
        assert payload_checksum(view) != reference
        view[offset] ^= 0x01
    assert payload_checksum(view) == reference
    view.release()
    mm.close()
