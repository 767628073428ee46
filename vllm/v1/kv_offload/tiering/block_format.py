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
                  10  flags            u16  0, or FLAG_KEYED (the MAC trailer follows header_crc)
                  12  header_size      u32  HEADER_SIZE
                  16  payload_len      u64  bytes of the payload (one primary row)
                  24  checksum_kind    u32  1 = CRC-32 (zlib), 2 = CRC-32C (Castagnoli)
                  28  checksum         u32
                  32  run_digest       32s  SHA-256 of the run's identity fields (canonical JSON)
                  64  key_len          u32
                  68  key              key_len bytes (the full OffloadKey)
          68+key_len  header_crc       u32  CRC-32 of bytes [0, 68 + key_len)
                      only with FLAG_KEYED, the MAC trailer:
          72+key_len  mac_kind         u32  1 = HMAC-SHA256
          76+key_len  key_id           8s   IntegrityKey.key_id of the writer's key
          84+key_len  mac              32s  the MAC (see below)
                      zero padding up to HEADER_SIZE
    offset 4096  payload, payload_len bytes: the primary row, verbatim

Two checksum kinds, one format: readers accept both and verify with the kind the header names.
Both tiers write CRC-32C, which the ``crc32c`` package computes with the CPU's CRC instruction
at several times zlib's speed, holding the GIL up to 256 KiB (a few microseconds per block:
cheaper for the engine thread than a GIL release and re-take per block, docs/benchmarks.md);
the fs tier wrote CRC-32 (zlib) before, and its files stay readable.

The header is a whole page so that, in a file, the payload starts page-aligned: with O_DIRECT the
payload is read straight into (and written straight from) the page-aligned primary row. In Redis
the page costs nothing extra in memory for power-of-two rows: the allocator's size class above a
2^k-byte value already has room for it (see docs/redis_tier.md).

Validation on load (``verify_parts`` for a header and a payload read apart, ``verify_block`` for a
value held in memory as one piece) rejects, as ``BlockFileCorrupt``: a wrong magic, version,
flags or header size, a header CRC mismatch (bit flip in the header), a payload length, run
digest or key other than expected (a foreign block), a payload CRC mismatch (bit flip in the
payload), and a block of the wrong total size (truncated or padded).

Keyed integrity (optional)
--------------------------
The CRCs catch accidents, not a writer: anyone who can write to the shared store can recompute
them. With a fleet secret (``IntegrityKey``), every block carries a MAC: HMAC-SHA256, under a key
derived from the secret, of the whole ``HEADER_SIZE``-byte header (its ``mac`` field zero) followed
by the payload. The header binds key, run and length, so a valid block copied under another key
fails as a foreign block; nothing without the secret can make a block that verifies.

* Writers: ``encode_header(..., integrity=key, payload=payload)`` (or ``write_block_header`` /
  ``encode_block_header(..., integrity=key)``) sets ``FLAG_KEYED`` and writes the trailer.
  Without a key the header is byte-identical to the format before keyed integrity existed
  (``flags`` 0, zero padding).
* Readers with a key (``verify_parts``/``verify_block``/``decode_header`` with ``integrity=key``):
  a keyed block with this key id whose MAC does not verify raises ``BlockForged`` (a subclass of
  ``BlockFileCorrupt``: delete it, count it, never serve it). A block written without a key, or
  with another key id (a fleet that changed its secret, or another fleet), raises
  ``BlockNotAuthenticated``, which is not ``BlockFileCorrupt``: a miss, neither deleted nor counted
  as forged. ``decode_header`` (header only, e.g. an index scan) checks the key id, not the MAC.
* Readers without a key verify the CRCs of any block, keyed or not, as before.

Adopting it in a tier: build the key once from the tier's config with
``IntegrityKey.from_config(env=..., file=..., tier=...)`` (None without a secret), pass it as
``integrity=`` to the calls above, and handle ``BlockNotAuthenticated`` as a miss. The secret is
never kept in a printable attribute; ``IntegrityKey``'s repr shows only its key id.
"""

from __future__ import annotations

import hmac
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from vllm.v1.kv_offload.tiering.secret_files import read_private_file

FORMAT_VERSION = 1
HEADER_SIZE = 4096
MAGIC = b"VLLMKVB\x00"
CHECKSUM_CRC32 = 1
CHECKSUM_CRC32C = 2
# With the CPU's CRC instruction a 64 KiB payload takes about 5 us: up to _CRC32C_HOLD_MAX bytes
# the checksum runs holding the GIL, since releasing and re-taking it costs the engine thread more
# than that (each release lets another thread in, and the releasing thread then waits its turn).
# Larger payloads, and every payload without the instruction (a software CRC), go the crc32c
# package's default way: the GIL released for buffers of 32 KiB and more, as zlib's CRC-32 does.
_CRC32C_HOLD_MAX = 256 * 1024 if crc32c.hardware_based else 0


def _crc32c(payload: memoryview) -> int:
    return crc32c.crc32c(payload, gil_release_mode=0 if len(payload) <= _CRC32C_HOLD_MAX else -1)


_CHECKSUMS: dict[int, Callable[[memoryview], int]] = {
    CHECKSUM_CRC32: zlib.crc32,
    CHECKSUM_CRC32C: _crc32c,
}

FLAG_KEYED = 0x0001
"""``flags`` bit: the header carries the MAC trailer (keyed integrity)."""
MAC_HMAC_SHA256 = 1
KEY_ID_BYTES = 8
MAC_BYTES = 32
MIN_SECRET_BYTES = 16
"""Shortest fleet secret ``IntegrityKey`` accepts."""

_FIXED = struct.Struct("<8sHHIQII32sI")
_CRC = struct.Struct("<I")
_MAC_TRAILER = struct.Struct(f"<I{KEY_ID_BYTES}s{MAC_BYTES}s")
MAX_KEY_BYTES = HEADER_SIZE - _FIXED.size - _CRC.size
"""Longest key a header can hold (``_MAC_TRAILER.size`` less with keyed integrity)."""
_KEY_ID_LABEL = b"vllm-kv-offload key id v1"
_MAC_KEY_LABEL = b"vllm-kv-offload block mac v1"


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


class BlockForged(BlockFileCorrupt):
    """A keyed block, bound to the reader's key id, whose MAC does not verify: written by someone
    without the fleet secret (or damaged in a way its CRCs missed). Delete it, count it, never
    serve it."""


class BlockNotAuthenticated(Exception):
    """A reader that requires keyed integrity found a block it cannot authenticate: one written
    without a key, or with another key id. Not ``BlockFileCorrupt``: treat it as a miss, neither
    delete it nor count it as forged (another fleet, or this one before its secret changed, may
    own it).

    Attributes:
        reason: what was wrong, for the log.
        key_id: the block's key id, or None if it was written without a key.
    """

    def __init__(self, reason: str, key_id: bytes | None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.key_id = key_id


class IntegrityKey:
    """A fleet secret for keyed block integrity (HMAC-SHA256), see the module docstring.

    Two values are derived from the secret with HMAC-SHA256 under fixed labels: the MAC key, and
    ``key_id`` (8 bytes, stamped into each keyed header), which names the key without revealing it.
    The secret itself is not kept; nothing printable holds the MAC key. Thread-safe: ``mac``
    copies a keyed template per call.

    Attributes:
        key_id: identifies the key (equal secrets, equal ids).
    """

    __slots__ = ("_template", "key_id")

    def __init__(self, secret: bytes) -> None:
        """Derive the key from ``secret``.

        Raises:
            ValueError: ``secret`` is not bytes or shorter than ``MIN_SECRET_BYTES`` (the
                message never contains it).
        """
        if not isinstance(secret, (bytes, bytearray)):
            raise ValueError(f"the integrity secret must be bytes, got {type(secret).__name__}")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the integrity secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
            )
        self.key_id = hmac.digest(secret, _KEY_ID_LABEL, "sha256")[:KEY_ID_BYTES]
        self._template = hmac.new(hmac.digest(secret, _MAC_KEY_LABEL, "sha256"), None, "sha256")

    def __repr__(self) -> str:
        return f"IntegrityKey(key_id={self.key_id.hex()})"

    def mac(self, header: memoryview, payload: memoryview) -> bytes:
        """The MAC of a keyed block: ``header`` is the full header with its ``mac`` field zero.
        One pass over ``payload`` (the GIL is released for large buffers)."""
        h = self._template.copy()
        h.update(header)
        h.update(payload)
        return h.digest()

    @classmethod
    def from_file(cls, path: str) -> IntegrityKey:
        """The key whose secret is the raw bytes of file ``path`` (binary allowed, nothing
        decoded or stripped).

        Raises:
            ValueError: the file cannot be read, is not a regular file, is readable or writable
                by other users (group or others), or holds fewer than ``MIN_SECRET_BYTES``. The
                message names the path, never the contents.
        """
        secret = read_private_file(path, "integrity key file")
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"integrity key file {path!r} holds {len(secret)} bytes; at least "
                f"{MIN_SECRET_BYTES} are required"
            )
        return cls(secret)

    @classmethod
    def from_env(cls, name: str) -> IntegrityKey:
        """The key whose secret is environment variable ``name`` (its bytes).

        Raises:
            ValueError: the variable is unset or shorter than ``MIN_SECRET_BYTES`` bytes (the
                message names the variable, never its value).
        """
        value = os.environ.get(name)
        if value is None:
            raise ValueError(f"integrity key environment variable {name!r} is not set")
        secret = os.fsencode(value)  # the variable's bytes as the OS holds them
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"integrity key environment variable {name!r} holds {len(secret)} bytes; at "
                f"least {MIN_SECRET_BYTES} are required"
            )
        return cls(secret)

    @classmethod
    def from_config(cls, *, env: object, file: object, tier: str) -> IntegrityKey | None:
        """The key a tier's config names: ``integrity_key_env`` (a variable name) or
        ``integrity_key_file`` (a path), at most one; None if neither is set.

        Raises:
            ValueError: both set, a value that is not a non-empty string, or as ``from_env`` /
                ``from_file``; the message names the config key (never the secret).
        """
        if env is not None and file is not None:
            raise ValueError(
                f"{tier} tier: set at most one of 'integrity_key_env' and 'integrity_key_file'"
            )
        for key, value, what in (
            ("integrity_key_env", env, "an environment variable name"),
            ("integrity_key_file", file, "a path"),
        ):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"{tier} tier: config key {key!r}={value!r} is invalid: expected {what}"
                )
        try:
            if isinstance(env, str):
                return cls.from_env(env)
            if isinstance(file, str):
                return cls.from_file(file)
        except ValueError as e:
            raise ValueError(f"{tier} tier: {e}") from None
        return None


def file_size(payload_len: int) -> int:
    """Total bytes of a block file with a ``payload_len``-byte payload."""
    return HEADER_SIZE + payload_len


def payload_checksum(payload: memoryview, kind: int = CHECKSUM_CRC32C) -> int:
    """Checksum of ``payload``: CRC-32C (the default, what both tiers write: the CPU's
    instruction, ~14 GB/s per core, the GIL held up to 256 KiB; without the instruction a
    software CRC that releases the GIL for large buffers) or CRC-32 (zlib, ~3 GB/s per core, the
    GIL released for large buffers; files written before CRC-32C carry it)."""
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
    checksum_kind: int = CHECKSUM_CRC32C,
    integrity: IntegrityKey | None = None,
    payload: memoryview | None = None,
) -> None:
    """Write the header of a block into ``buf`` (``HEADER_SIZE`` bytes, writable); ``checksum``
    is ``payload_checksum(payload, checksum_kind)``.

    Args:
        integrity: sign the block with this key (``FLAG_KEYED`` and the MAC trailer); then
            ``payload`` (the bytes that will follow the header, ``payload_len`` of them) is
            required, for the MAC. None: the unkeyed header.

    Raises:
        ValueError: ``key`` is longer than ``MAX_KEY_BYTES`` (less the MAC trailer when keyed),
            ``run_digest`` is not 32 bytes, or ``integrity`` without ``payload``.
    """
    end = _FIXED.size + len(key)
    limit = MAX_KEY_BYTES - (_MAC_TRAILER.size if integrity is not None else 0)
    if len(key) > limit:
        raise ValueError(f"key of {len(key)} bytes exceeds the header limit of {limit}")
    if len(run_digest) != 32:
        raise ValueError(f"run digest must be 32 bytes, got {len(run_digest)}")
    if integrity is not None and (payload is None or len(payload) != payload_len):
        raise ValueError("a keyed header needs the payload (payload_len bytes) for its MAC")
    assert len(buf) == HEADER_SIZE, f"header buffer of {len(buf)} bytes"
    _FIXED.pack_into(
        buf,
        0,
        MAGIC,
        FORMAT_VERSION,
        0 if integrity is None else FLAG_KEYED,
        HEADER_SIZE,
        payload_len,
        checksum_kind,
        checksum,
        run_digest,
        len(key),
    )
    buf[_FIXED.size : end] = key
    _CRC.pack_into(buf, end, zlib.crc32(buf[:end]))
    buf[end + _CRC.size :] = bytes(HEADER_SIZE - end - _CRC.size)
    if integrity is not None:
        assert payload is not None  # checked above
        trailer = end + _CRC.size
        _MAC_TRAILER.pack_into(buf, trailer, MAC_HMAC_SHA256, integrity.key_id, bytes(MAC_BYTES))
        mac_at = trailer + _MAC_TRAILER.size - MAC_BYTES
        buf[mac_at : mac_at + MAC_BYTES] = integrity.mac(buf, payload)


def decode_header(
    buf: memoryview,
    *,
    key: bytes | None,
    run_digest: bytes,
    payload_len: int,
    integrity: IntegrityKey | None = None,
) -> tuple[bytes, PayloadChecksum]:
    """Validate the header in ``buf`` and return ``(key, payload checksum)``.

    Args:
        buf: the first ``HEADER_SIZE`` bytes of the file.
        key: the expected key, or None to accept any (the start-up scan reads keys this way).
        run_digest: the expected run digest.
        payload_len: the expected payload length.
        integrity: the reader's key: the block must be keyed with its key id (the MAC itself,
            which needs the payload, is checked by ``verify_parts``). None: keyed or not.

    Raises:
        BlockFileCorrupt: on any mismatch (see the module docstring).
        BlockNotAuthenticated: ``integrity`` is set and the block was written without a key or
            with another key id.
    """
    file_key, checksum, _ = _decode(
        buf, key=key, run_digest=run_digest, payload_len=payload_len, integrity=integrity
    )
    return file_key, checksum


def _decode(
    buf: memoryview,
    *,
    key: bytes | None,
    run_digest: bytes,
    payload_len: int,
    integrity: IntegrityKey | None,
) -> tuple[bytes, PayloadChecksum, int | None]:
    """``decode_header``'s checks; also returns the offset of the MAC in ``buf`` when
    ``integrity`` requires checking one (else None)."""
    if len(buf) != HEADER_SIZE:
        raise BlockFileCorrupt(f"header of {len(buf)} bytes, expected {HEADER_SIZE}")
    (
        magic,
        version,
        flags,
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
    if flags & ~FLAG_KEYED:
        raise BlockFileCorrupt(f"unknown flags {flags:#06x}")
    if checksum_kind not in _CHECKSUMS:
        raise BlockFileCorrupt(f"unknown checksum kind {checksum_kind}")
    if file_payload_len != payload_len:
        raise BlockFileCorrupt(f"payload length {file_payload_len}, expected {payload_len}")
    if file_digest != run_digest:
        raise BlockFileCorrupt("file belongs to another run (run digest mismatch)")
    file_key = bytes(buf[_FIXED.size : end])
    if key is not None and file_key != key:
        raise BlockFileCorrupt(f"file holds key {file_key.hex()}, expected {key.hex()}")
    mac_at = None
    if integrity is not None:
        if not flags & FLAG_KEYED:
            raise BlockNotAuthenticated("written without an integrity key", None)
        trailer = end + _CRC.size
        if trailer + _MAC_TRAILER.size > HEADER_SIZE:
            raise BlockFileCorrupt(f"key length {key_len} leaves no room for the MAC")
        mac_kind, key_id, _ = _MAC_TRAILER.unpack_from(buf, trailer)
        if key_id != integrity.key_id:
            raise BlockNotAuthenticated(f"signed with another key (id {key_id.hex()})", key_id)
        if mac_kind != MAC_HMAC_SHA256:
            raise BlockNotAuthenticated(f"unknown MAC kind {mac_kind}", key_id)
        mac_at = trailer + _MAC_TRAILER.size - MAC_BYTES
    return file_key, PayloadChecksum(checksum_kind, checksum), mac_at


def write_block_header(
    buf: memoryview,
    payload: memoryview,
    *,
    key: bytes,
    run_digest: bytes,
    checksum_kind: int = CHECKSUM_CRC32C,
    integrity: IntegrityKey | None = None,
) -> None:
    """Write the header of ``payload`` stored under ``key`` into ``buf`` (``HEADER_SIZE`` bytes,
    writable), keyed with ``integrity`` if given.

    Computes the payload's checksum (one pass over ``payload``), and with ``integrity`` its MAC
    (a second pass).

    Raises:
        ValueError: as ``encode_header``.
    """
    encode_header(
        buf,
        key=key,
        run_digest=run_digest,
        payload_len=len(payload),
        checksum=payload_checksum(payload, checksum_kind),
        checksum_kind=checksum_kind,
        integrity=integrity,
        payload=payload,
    )


def encode_block_header(
    key: bytes,
    run_digest: bytes,
    payload: memoryview,
    checksum_kind: int = CHECKSUM_CRC32C,
    integrity: IntegrityKey | None = None,
) -> bytes:
    """``write_block_header`` into a new ``HEADER_SIZE``-byte ``bytes`` (a value's header).

    Raises:
        ValueError: as ``encode_header``.
    """
    header = bytearray(HEADER_SIZE)
    write_block_header(
        memoryview(header),
        payload,
        key=key,
        run_digest=run_digest,
        checksum_kind=checksum_kind,
        integrity=integrity,
    )
    return bytes(header)


def verify_block(
    block: bytes | memoryview,
    *,
    key: bytes,
    run_digest: bytes,
    payload_len: int,
    integrity: IntegrityKey | None = None,
) -> memoryview:
    """Check a whole block held in memory (header and payload) and return its payload.

    Args:
        block: ``HEADER_SIZE + payload_len`` bytes as stored (e.g. a Redis value).
        key: the key it must be bound to.
        run_digest: the run it must belong to.
        payload_len: the expected payload length.
        integrity: the reader's key, as for ``verify_parts``.

    Returns:
        A read-only view of the payload inside ``block`` (no copy).

    Raises:
        BlockFileCorrupt: wrong total size, bad header, another key or run, or a payload checksum
            mismatch; ``BlockForged`` for a MAC that does not verify.
        BlockNotAuthenticated: as ``verify_parts``.
    """
    view = memoryview(block).cast("B")
    if len(view) != HEADER_SIZE + payload_len:
        raise BlockFileCorrupt(f"{len(view)} bytes, expected {HEADER_SIZE + payload_len}")
    payload = view[HEADER_SIZE:]
    verify_parts(view[:HEADER_SIZE], payload, key=key, run_digest=run_digest, integrity=integrity)
    return payload


def verify_parts(
    header: memoryview,
    payload: memoryview,
    *,
    key: bytes,
    run_digest: bytes,
    integrity: IntegrityKey | None = None,
) -> None:
    """Check a block read in two parts: its header, and its payload where it landed (a primary
    row). The payload's length is the one expected.

    Args:
        integrity: the reader's key: the block must be keyed with it and its MAC must verify.
            None: the CRCs of any block, keyed or not.

    Raises:
        BlockFileCorrupt: bad header, another key or run, another payload length, or a payload
            checksum mismatch; ``BlockForged`` (a subclass) for a MAC that does not verify.
        BlockNotAuthenticated: ``integrity`` is set and the block was written without a key or
            with another key id.
    """
    _, checksum, mac_at = _decode(
        header, key=key, run_digest=run_digest, payload_len=len(payload), integrity=integrity
    )
    if not checksum.matches(payload):
        raise BlockFileCorrupt("payload checksum mismatch")
    if integrity is None or mac_at is None:
        return
    unsigned = bytearray(header)
    mac = bytes(unsigned[mac_at : mac_at + MAC_BYTES])
    unsigned[mac_at : mac_at + MAC_BYTES] = bytes(MAC_BYTES)
    if not hmac.compare_digest(integrity.mac(memoryview(unsigned), payload), mac):
        raise BlockForged("MAC mismatch (not written with the fleet's integrity key)")
