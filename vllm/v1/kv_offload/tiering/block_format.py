# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The block format shared by the secondary tiers: a fixed 4 KiB header followed by the payload.

One format, one implementation: the fs tier writes it as a block file, the redis tier as the value
of one key. Both bind a block to its key and run and check it the same way, so a value (or file)
whose header, key, run or checksum does not match is always rejected as ``BlockFileCorrupt``.

Layout (``HEADER_SIZE + payload_len`` bytes)::

    offset 0     header, HEADER_SIZE (4096) bytes, little-endian:
                   0  magic            8s   b"VLLMKVB\\0"
                   8  format_version   u16  FORMAT_VERSION
                  10  flags            u16  0 (reserved)
                  12  header_size      u32  HEADER_SIZE
                  16  payload_len      u64  bytes of the payload (one primary row)
                  24  checksum_kind    u32  1 = CRC-32 (zlib), 2 = CRC-32C (Castagnoli)
                  28  checksum         u32
                  32  run_digest       32s  SHA-256 of the run's identity fields (canonical JSON)
                  64  key_len          u32
                  68  key              key_len bytes (the full OffloadKey)
          68+key_len  header_crc       u32  CRC-32 of bytes [0, 68 + key_len)
                      zero padding up to HEADER_SIZE
    offset 4096  payload, payload_len bytes: the primary row, verbatim

Two checksum kinds, one format: readers accept both and verify with the kind the header names.
The fs tier writes CRC-32 (it overlaps the checksum with disk I/O on many threads); the redis
tier writes CRC-32C, which the ``crc32c`` package computes with the CPU's CRC instruction at
several times zlib's speed: on the network path the checksum runs on the one thread that also
feeds the socket, so its cost shows directly in the throughput (see docs/benchmarks.md).

The header is a whole page so that, in a file, the payload starts page-aligned: with O_DIRECT the
payload is read straight into (and written straight from) the page-aligned primary row. In Redis
the page costs nothing extra in memory for power-of-two rows: the allocator's size class above a
2^k-byte value already has room for it (see docs/redis_tier.md).

Validation on load (``verify_parts`` for a header and a payload read apart, ``verify_block`` for a
value held in memory as one piece) rejects, as ``BlockFileCorrupt``: a wrong magic, version or
header size, a header CRC mismatch (bit flip in the header), a payload length, run digest or key
other than expected (a foreign block), a payload CRC mismatch (bit flip in the payload), and a
block of the wrong total size (truncated or padded).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import crc32c

FORMAT_VERSION = 1
HEADER_SIZE = 4096
MAGIC = b"VLLMKVB\x00"
CHECKSUM_CRC32 = 1
CHECKSUM_CRC32C = 2
_CHECKSUMS = {CHECKSUM_CRC32: zlib.crc32, CHECKSUM_CRC32C: crc32c.crc32c}

_FIXED = struct.Struct("<8sHHIQII32sI")
_CRC = struct.Struct("<I")
MAX_KEY_BYTES = HEADER_SIZE - _FIXED.size - _CRC.size
"""Longest key a header can hold."""


class BlockFileCorrupt(Exception):
    """The file (or value) is not a valid block for the expected key: it must be deleted.

    Attributes:
        reason: what was wrong, for the log.
        file_id: ``(st_dev, st_ino)`` of the file that was examined, when known, so that only
            that file is deleted (not a fresh one renamed over it meanwhile).
    """

    def __init__(self, reason: str, file_id: tuple[int, int] | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.file_id = file_id


def file_size(payload_len: int) -> int:
    """Total bytes of a block file with a ``payload_len``-byte payload."""
    return HEADER_SIZE + payload_len


def payload_checksum(payload: memoryview, kind: int = CHECKSUM_CRC32) -> int:
    """Checksum of ``payload``: CRC-32 (zlib, ~3 GB/s per core) or CRC-32C (hardware, ~10+ GB/s
    per core); both release the GIL for large buffers."""
    return _CHECKSUMS[kind](payload)


@dataclass(frozen=True, slots=True)
class PayloadChecksum:
    """The payload checksum a header records: its kind and value."""

    kind: int
    value: int

    def matches(self, payload: memoryview) -> bool:
        """Whether ``payload`` has this checksum (one pass over it)."""
        return payload_checksum(payload, self.kind) == self.value


def encode_header(
    buf: memoryview,
    *,
    key: bytes,
    run_digest: bytes,
    payload_len: int,
    checksum: int,
    checksum_kind: int = CHECKSUM_CRC32,
) -> None:
    """Write the header of a block into ``buf`` (``HEADER_SIZE`` bytes, writable); ``checksum``
    is ``payload_checksum(payload, checksum_kind)``.

    Raises:
        ValueError: ``key`` is longer than ``MAX_KEY_BYTES`` or ``run_digest`` is not 32 bytes.
    """
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds the header limit of {MAX_KEY_BYTES}")
    if len(run_digest) != 32:
        raise ValueError(f"run digest must be 32 bytes, got {len(run_digest)}")
    assert len(buf) == HEADER_SIZE, f"header buffer of {len(buf)} bytes"
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        FORMAT_VERSION,
        0,
        HEADER_SIZE,
        payload_len,
        checksum_kind,
        checksum,
        run_digest,
        len(key),
    )
    end = _FIXED.size + len(key)
    buf[_FIXED.size : end] = key
    _CRC.pack_into(buf, end, zlib.crc32(buf[:end]))
    buf[end + _CRC.size :] = bytes(HEADER_SIZE - end - _CRC.size)


def decode_header(
    buf: memoryview, *, key: bytes | None, run_digest: bytes, payload_len: int
) -> tuple[bytes, PayloadChecksum]:
    """Validate the header in ``buf`` and return ``(key, payload checksum)``.

    Args:
        buf: the first ``HEADER_SIZE`` bytes of the file.
        key: the expected key, or None to accept any (the start-up scan reads keys this way).
        run_digest: the expected run digest.
        payload_len: the expected payload length.

    Raises:
        BlockFileCorrupt: on any mismatch (see the module docstring).
    """
    if len(buf) != HEADER_SIZE:
        raise BlockFileCorrupt(f"header of {len(buf)} bytes, expected {HEADER_SIZE}")
    (
        magic,
        version,
        _flags,
        header_size,
        file_payload_len,
        checksum_kind,
        checksum,
        file_digest,
        key_len,
    ) = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BlockFileCorrupt(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise BlockFileCorrupt(f"format version {version}, expected {FORMAT_VERSION}")
    if header_size != HEADER_SIZE or key_len > MAX_KEY_BYTES:
        raise BlockFileCorrupt(f"header size {header_size} / key length {key_len} out of range")
    end = _FIXED.size + key_len
    (header_crc,) = _CRC.unpack_from(buf, end)
    if zlib.crc32(buf[:end]) != header_crc:
        raise BlockFileCorrupt("header checksum mismatch")
    if checksum_kind not in _CHECKSUMS:
        raise BlockFileCorrupt(f"unknown checksum kind {checksum_kind}")
    if file_payload_len != payload_len:
        raise BlockFileCorrupt(f"payload length {file_payload_len}, expected {payload_len}")
    if file_digest != run_digest:
        raise BlockFileCorrupt("file belongs to another run (run digest mismatch)")
    file_key = bytes(buf[_FIXED.size : end])
    if key is not None and file_key != key:
        raise BlockFileCorrupt(f"file holds key {file_key.hex()}, expected {key.hex()}")
    return file_key, PayloadChecksum(checksum_kind, checksum)


def encode_block_header(
    key: bytes, run_digest: bytes, payload: memoryview, checksum_kind: int = CHECKSUM_CRC32C
) -> bytes:
    """Return the ``HEADER_SIZE``-byte header of ``payload`` stored under ``key``.

    Computes the payload's checksum (one pass over ``payload``; the GIL is released meanwhile).

    Raises:
        ValueError: as ``encode_header``.
    """
    header = bytearray(HEADER_SIZE)
    encode_header(
        memoryview(header),
        key=key,
        run_digest=run_digest,
        payload_len=len(payload),
        checksum=payload_checksum(payload, checksum_kind),
        checksum_kind=checksum_kind,
    )
    return bytes(header)


def verify_block(
    block: bytes | memoryview, *, key: bytes, run_digest: bytes, payload_len: int
) -> memoryview:
    """Check a whole block held in memory (header and payload) and return its payload.

    Args:
        block: ``HEADER_SIZE + payload_len`` bytes as stored (e.g. a Redis value).
        key: the key it must be bound to.
        run_digest: the run it must belong to.
        payload_len: the expected payload length.

    Returns:
        A read-only view of the payload inside ``block`` (no copy).

    Raises:
        BlockFileCorrupt: wrong total size, bad header, another key or run, or a payload checksum
            mismatch.
    """
    view = memoryview(block).cast("B")
    if len(view) != HEADER_SIZE + payload_len:
        raise BlockFileCorrupt(f"{len(view)} bytes, expected {HEADER_SIZE + payload_len}")
    payload = view[HEADER_SIZE:]
    verify_parts(view[:HEADER_SIZE], payload, key=key, run_digest=run_digest)
    return payload


def verify_parts(header: memoryview, payload: memoryview, *, key: bytes, run_digest: bytes) -> None:
    """Check a block read in two parts: its header, and its payload where it landed (a primary
    row). The payload's length is the one expected.

    Raises:
        BlockFileCorrupt: bad header, another key or run, another payload length, or a payload
            checksum mismatch.
    """
    _, checksum = decode_header(header, key=key, run_digest=run_digest, payload_len=len(payload))
    if not checksum.matches(payload):
        raise BlockFileCorrupt("payload checksum mismatch")
