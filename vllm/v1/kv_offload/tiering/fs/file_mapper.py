# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Where the filesystem tier keeps a run's files: run identity and key -> path mapping.

Layout under ``root_dir``::

    <root_dir>/<model>_<digest>/config.json                          the run's fields (JSON)
    <root_dir>/<model>_<digest>_r<rank>/<hhh>/<hh>_g<group>/<hash>.bin  one block file

* ``<model>_<digest>``: the run's identity name (``tiering.run_identity``: the sanitised model
  name and the first 16 hex digits of the SHA-256 of the fields that change a block file's bytes),
  so different runs never share a directory and runs with equal fields share files. The full
  32-byte digest is also written into every block header.
* ``<rank>``: always 0. A block file holds a whole primary row, i.e. every worker's slice of the
  block (all tensor-parallel ranks and pipeline stages, whose sizes are part of the digest), and
  one tier instance in the scheduler serves all of them. The ``_r<rank>`` suffix keeps the layout
  open for per-worker files side by side.
* ``<hash>``: the block hash of the key in lower-case hex when it is 3 to 64 bytes long;
  otherwise ``z`` followed by the hex BLAKE2b-256 digest of the block hash (the header then holds
  the full key). ``<hhh>`` and ``<hh>`` are its first five hex digits (after the ``z``): two
  levels of fan-out (4096 x 256 directories) keep directories small.
* ``<group>``: the KV-cache group index in decimal.

Nothing taken from a key or a config value reaches a path except through hex digits, decimal
integers and the sanitised model name, so no path can leave ``root_dir``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.tiering.run_identity import RunIdentity

RANK = 0
"""The ``_r<rank>`` of every block directory: files hold whole rows (all workers' slices)."""

BLOCK_SUFFIX = ".bin"
CONFIG_FILE = "config.json"
_MIN_RAW_HASH_BYTES = 3  # five hex digits name the two directory levels
_MAX_RAW_HASH_BYTES = 64  # longer hashes are digested to keep names short
_HASHED_PREFIX = "z"
_MAX_GROUP_IDX = (1 << 32) - 1

_DIR1_RE = re.compile(r"^[0-9a-f]{3}$")
_DIR2_RE = re.compile(r"^([0-9a-f]{2})_g(0|[1-9][0-9]{0,9})$")
_NAME_RE = re.compile(r"^(z[0-9a-f]{64}|[0-9a-f]{6,128})\.bin$")


@dataclass(frozen=True, slots=True)
class BlockPath:
    """Location of one block file relative to the rank directory.

    Attributes:
        dir1: ``<hhh>``.
        dir2: ``<hh>_g<group>``.
        name: ``<hash>.bin``.
    """

    dir1: str
    dir2: str
    name: str

    @property
    def rel(self) -> str:
        """``<hhh>/<hh>_g<group>/<hash>.bin``."""
        return f"{self.dir1}/{self.dir2}/{self.name}"

    @property
    def stem(self) -> str:
        """The file name without ``.bin`` (used to name temporary files)."""
        return self.name[: -len(BLOCK_SUFFIX)]


class FileMapper:
    """Maps a run to its directories and keys to block files.

    Pure computation: touches no file. ``O(len(key))`` per call.

    Attributes:
        root_dir: the (absolute, resolved) root.
        run_fields: the identity fields of the run.
        run_config_json: ``run_fields`` as canonical JSON (what ``config.json`` holds).
        run_digest: SHA-256 of ``run_config_json`` (32 bytes), stamped into every block header.
        base_name: ``<model>_<digest>``, the config directory's name.
        rank_dir_name: ``<model>_<digest>_r<rank>``, the block directory's name.
    """

    def __init__(self, root_dir: str, run_fields: Mapping[str, Any]) -> None:
        identity = RunIdentity.from_fields(run_fields)
        self.root_dir = root_dir
        self.run_fields = dict(identity.fields)
        self.run_config_json = identity.config_json
        self.run_digest = identity.digest
        self.base_name = identity.name
        self.rank_dir_name = f"{self.base_name}_r{RANK}"

    @staticmethod
    def block_path(key: OffloadKey) -> BlockPath:
        """The file of block ``key`` (relative to the rank directory)."""
        block_hash = get_offload_block_hash(key)
        group_idx = get_offload_group_idx(key)
        if _MIN_RAW_HASH_BYTES <= len(block_hash) <= _MAX_RAW_HASH_BYTES:
            hex_name = block_hash.hex()
            stem = hex_name
        else:
            hex_name = hashlib.blake2b(block_hash, digest_size=32).hexdigest()
            stem = _HASHED_PREFIX + hex_name
        return BlockPath(hex_name[:3], f"{hex_name[3:5]}_g{group_idx}", stem + BLOCK_SUFFIX)

    @staticmethod
    def parse_block_path(dir1: str, dir2: str, name: str) -> tuple[OffloadKey | None, int] | None:
        """Recover what a block file name says about its key.

        Returns:
            None if the three components are not a well-formed block file path (foreign files,
            which the tier ignores); otherwise ``(key, group_idx)`` where ``key`` is None for a
            digested name (the key must then be read from the file's header).
        """
        if _DIR1_RE.match(dir1) is None:
            return None
        dir2_match = _DIR2_RE.match(dir2)
        name_match = _NAME_RE.match(name)
        if dir2_match is None or name_match is None:
            return None
        group_idx = int(dir2_match.group(2))
        if group_idx > _MAX_GROUP_IDX:
            return None
        stem = name_match.group(1)
        hex_name = stem[1:] if stem.startswith(_HASHED_PREFIX) else stem
        if hex_name[:3] != dir1 or hex_name[3:5] != dir2_match.group(1):
            return None
        if stem.startswith(_HASHED_PREFIX):
            return None, group_idx
        if len(hex_name) % 2:
            return None
        return make_offload_key(bytes.fromhex(hex_name), group_idx), group_idx
