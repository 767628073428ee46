# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The shared region file's geometry and its on-file metadata: join marks and trailer.

After the ``num_blocks`` rows (``total_bytes``) the file holds a metadata area of whole pages::

    +---------------------------------+-----------------------+-------------------+
    | join marks: 1 byte per          | zeros                 | trailer (the last |
    | participant (scheduler, 0..M-1) |                       | TRAILER.size B)   |
    +---------------------------------+-----------------------+-------------------+

The trailer holds a magic, the format version, the geometry, whether the scheduler side takes
part, and the creator's identity: pid, start time (``/proc/<pid>/stat``), pid namespace and boot
id, which together survive pid reuse. Join marks are read and written only under the file's
``flock``.
"""

from __future__ import annotations

import os
import secrets
import struct
from dataclasses import dataclass
from typing import NamedTuple

from vllm.v1.kv_offload.cpu.shared_region.process_identity import ProcessIdentity

MAGIC = b"VLLMKVR\x00"
FORMAT_VERSION = 1
# magic, version, flags (bit 0: the scheduler side joins), num_workers, num_blocks, row_bytes,
# worker_page_bytes, creator pid, creator start time (clock ticks after boot), creator pid
# namespace (inode), creator boot id, nonce.
TRAILER = struct.Struct("<8sIIIQQQQQQ16s16s")
FLAG_EXPECT_SCHEDULER = 1
JOINED = b"\x01"


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class RegionGeometry:
    """Sizes of a region file (``M = num_workers``, ``S = worker_page_bytes``).

    Attributes:
        num_blocks: number of rows.
        worker_page_bytes: bytes of one worker's slot in a row (``S``).
        num_workers: number of worker slots per row (``M``).
        row_bytes: ``round_up(M * S, alignment)``.
        total_bytes: the rows, ``num_blocks * row_bytes`` (what is mapped).
        file_bytes: ``total_bytes`` plus the metadata area (whole pages).
        expect_scheduler: whether the scheduler side is a participant besides every worker.
    """

    num_blocks: int
    worker_page_bytes: int
    num_workers: int
    row_bytes: int
    total_bytes: int
    file_bytes: int
    expect_scheduler: bool

    @classmethod
    def compute(
        cls,
        num_blocks: int,
        worker_page_bytes: int,
        num_workers: int,
        expect_scheduler: bool,
        alignment: int,
    ) -> RegionGeometry:
        """The geometry of a region with rows and metadata padded to ``alignment`` bytes."""
        row_bytes = round_up(num_workers * worker_page_bytes, alignment)
        total_bytes = num_blocks * row_bytes
        # Join marks (one byte per participant: the scheduler, then ranks 0..M-1), the trailer.
        meta_bytes = round_up(num_workers + 1 + TRAILER.size, alignment)
        return cls(
            num_blocks,
            worker_page_bytes,
            num_workers,
            row_bytes,
            total_bytes,
            total_bytes + meta_bytes,
            bool(expect_scheduler),
        )

    def mark_offset(self, rank: int | None) -> int:
        """File offset of a participant's join mark: the scheduler's (``rank`` None) first,
        then worker ``rank``'s."""
        return self.total_bytes + (0 if rank is None else 1 + rank)


class Trailer(NamedTuple):
    """What a region file's trailer says (the nonce left out)."""

    version: int
    flags: int
    num_workers: int
    num_blocks: int
    row_bytes: int
    worker_page_bytes: int
    creator: ProcessIdentity

    @property
    def expect_scheduler(self) -> bool:
        return bool(self.flags & FLAG_EXPECT_SCHEDULER)


def pack_trailer(geometry: RegionGeometry, creator: ProcessIdentity) -> bytes:
    """The trailer of a region of ``geometry`` that ``creator`` makes (with a fresh nonce)."""
    return TRAILER.pack(
        MAGIC,
        FORMAT_VERSION,
        FLAG_EXPECT_SCHEDULER if geometry.expect_scheduler else 0,
        geometry.num_workers,
        geometry.num_blocks,
        geometry.row_bytes,
        geometry.worker_page_bytes,
        creator.pid,
        creator.start_ticks,
        creator.pidns,
        creator.boot_id,
        secrets.token_bytes(16),
    )


def read_trailer(fd: int, size: int) -> Trailer | None:
    """The trailer of the file ``fd`` of ``size`` bytes; None if it has no valid trailer."""
    if size < TRAILER.size:
        return None
    data = os.pread(fd, TRAILER.size, size - TRAILER.size)
    if len(data) != TRAILER.size:
        return None
    (
        magic,
        version,
        flags,
        num_workers,
        num_blocks,
        row_bytes,
        worker_page_bytes,
        pid,
        start_ticks,
        pidns,
        boot_id,
        _nonce,
    ) = TRAILER.unpack(data)
    if magic != MAGIC:
        return None
    creator = ProcessIdentity(pid, start_ticks, pidns, boot_id)
    return Trailer(version, flags, num_workers, num_blocks, row_bytes, worker_page_bytes, creator)


def all_joined(fd: int, geometry: RegionGeometry) -> bool:
    """Whether every expected participant has marked the region ``fd`` (caller holds the lock)."""
    marks = os.pread(fd, geometry.num_workers + 1, geometry.total_bytes)
    expected = marks if geometry.expect_scheduler else marks[1:]
    return expected.count(JOINED) == len(expected)
