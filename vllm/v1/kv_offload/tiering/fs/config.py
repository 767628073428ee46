# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Validation of the filesystem tier's config keys (the ``secondary_tiers`` entry of type "fs").

Every key is checked here, before the tier touches the filesystem, and every error names the key,
the value and what is allowed. Sizes go through the one size parser of the package
(``vllm.v1.kv_offload.sizes``): an integer number of bytes, an integral float (``4e9``) or a
string with a binary or decimal unit (``"64GiB"``, ``"500MB"``, ``"1T"``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Literal, cast

from vllm.v1.kv_offload.sizes import SIZE_FORMS, SizeError
from vllm.v1.kv_offload.sizes import parse_size as parse_size_value
from vllm.v1.kv_offload.tiering.block_format import IntegrityKey

ODirectMode = Literal["auto", True, False]
Permissions = Literal["private", "group"]


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"fs tier: config key {key!r}={value!r} is invalid: expected {allowed}")


def parse_size(key: str, value: Any, *, allow_zero: bool = False) -> int:
    """Parse a byte count with the one size parser (``vllm.v1.kv_offload.sizes.parse_size``).

    Raises:
        ValueError: naming ``key``, for anything that parser refuses.
    """
    try:
        return parse_size_value(value, allow_zero=allow_zero)
    except SizeError:
        allowed = f"{SIZE_FORMS}{' (0 allowed)' if allow_zero else ''}"
        raise _bad(key, value, allowed) from None


def _parse_int(key: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _bad(key, value, f"an integer in [{lo}, {hi}]")
    return value


def default_io_threads() -> int:
    """I/O threads of each kind when the config does not say: as many as the host has CPUs,
    from 2 to 8. The threads mostly wait for the disk (``fsync``), so a few per kind keep it
    busy; more would only add wake-ups on a small host."""
    return min(8, max(2, os.cpu_count() or 2))


def _parse_threads(key: str, value: Any) -> int:
    return default_io_threads() if value is None else _parse_int(key, value, 1, 256)


def _parse_seconds(key: str, value: Any, *, positive: bool) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise _bad(key, value, f"a finite number of seconds {'> 0' if positive else '>= 0'}")
    return float(value)


@dataclass(frozen=True)
class FsTierConfig:
    """The filesystem tier's validated settings.

    Attributes:
        root_dir: absolute, symlink-resolved root directory shared by every run.
        n_read_threads: I/O threads that prefer loads (they take stores when no load is queued);
            by default ``default_io_threads()``: the host's CPUs, from 2 to 8.
        n_write_threads: I/O threads that prefer stores (they take loads when no store is
            queued); same default.
        max_bytes: bound on the bytes of block files of this run directory (LRU eviction above
            it); None means bounded only by ``min_free_bytes``.
        min_free_bytes: free bytes the tier leaves on the filesystem; a store that would go below
            it is skipped (failed) instead of being attempted. None means
            ``min(1 GiB, 5 % of the filesystem)``, resolved by the tier.
        o_direct: ``"auto"`` probes O_DIRECT at start and falls back to buffered I/O; True
            requires it (construction fails if unsupported); False never uses it.
        enable_events: record ``OffloadingEvent`` s (medium ``"STORAGE"``) for blocks written or
            removed by this tier.
        stale_tmp_age_s: a temporary file of a writer that may still be alive (another host or
            a live process) is deleted by the scan only once it is this old.
        reconcile_interval_s: seconds between two steps of the background reconcile, which
            re-reads the run directory to learn what other instances (or operators) wrote and
            deleted.
        reconcile_batch: directory entries (files and directories) one reconcile step examines;
            a full pass over ``E`` entries takes ``ceil(E / reconcile_batch)`` steps.
        max_read_failures: consecutive failed reads (transient errors such as EACCES or EIO) of
            one block file after which the tier stops serving it: lookups miss, it becomes the
            first eviction victim, and the next store of the block replaces it.
        permissions: ``"private"``: directories 0700 and files 0600, whatever the umask (only
            the user running the tier can read the cached blocks); ``"group"``: directories
            2770 (set-group-ID) and files 0660, for a cache shared by the users of the root's
            group.
        integrity: the fleet's integrity key (``block_format.IntegrityKey``, from the
            ``integrity_key_env`` or ``integrity_key_file`` key): every block file then carries
            a MAC, and a file whose MAC does not verify is never served. None: CRCs only.
    """

    root_dir: str
    n_read_threads: int
    n_write_threads: int
    max_bytes: int | None = None
    min_free_bytes: int | None = None
    o_direct: ODirectMode = "auto"
    enable_events: bool = False
    stale_tmp_age_s: float = 600.0
    reconcile_interval_s: float = 1.0
    reconcile_batch: int = 1024
    max_read_failures: int = 3
    permissions: Permissions = "private"
    integrity: IntegrityKey | None = None

    @classmethod
    def from_kwargs(
        cls,
        *,
        root_dir: Any,
        n_read_threads: Any = None,
        n_write_threads: Any = None,
        max_bytes: Any = None,
        min_free_bytes: Any = None,
        o_direct: Any = "auto",
        enable_events: Any = False,
        stale_tmp_age_s: Any = 600.0,
        reconcile_interval_s: Any = 1.0,
        reconcile_batch: Any = 1024,
        max_read_failures: Any = 3,
        permissions: Any = "private",
        integrity_key_env: Any = None,
        integrity_key_file: Any = None,
    ) -> FsTierConfig:
        """Validate raw config values (e.g. decoded JSON) and normalise them; reads the
        integrity secret.

        ``root_dir`` is made absolute and its symlinks resolved, once, here: the tier never
        follows a symlink below it.

        Raises:
            ValueError: a missing ``root_dir`` or any invalid value, naming the key (never a
                secret).
        """
        if root_dir is None:
            raise ValueError(
                "fs tier: config key 'root_dir' is required (the directory that holds the "
                "block files)"
            )
        if isinstance(root_dir, os.PathLike):
            root_dir = os.fspath(root_dir)
        if not isinstance(root_dir, str) or not root_dir or "\0" in root_dir:
            raise _bad("root_dir", root_dir, "a non-empty directory path (str or os.PathLike)")
        if not isinstance(enable_events, bool):
            raise _bad("enable_events", enable_events, "a bool")
        if not (isinstance(o_direct, bool) or (isinstance(o_direct, str) and o_direct == "auto")):
            raise _bad("o_direct", o_direct, "'auto', true or false")
        if permissions not in ("private", "group") or not isinstance(permissions, str):
            raise _bad("permissions", permissions, "'private' or 'group'")
        return cls(
            root_dir=os.path.realpath(os.path.abspath(os.path.expanduser(root_dir))),
            n_read_threads=_parse_threads("n_read_threads", n_read_threads),
            n_write_threads=_parse_threads("n_write_threads", n_write_threads),
            max_bytes=None if max_bytes is None else parse_size("max_bytes", max_bytes),
            min_free_bytes=(
                None
                if min_free_bytes is None
                else parse_size("min_free_bytes", min_free_bytes, allow_zero=True)
            ),
            o_direct=cast(ODirectMode, o_direct),
            enable_events=enable_events,
            stale_tmp_age_s=_parse_seconds("stale_tmp_age_s", stale_tmp_age_s, positive=False),
            reconcile_interval_s=_parse_seconds(
                "reconcile_interval_s", reconcile_interval_s, positive=True
            ),
            reconcile_batch=_parse_int("reconcile_batch", reconcile_batch, 1, 1 << 24),
            max_read_failures=_parse_int("max_read_failures", max_read_failures, 1, 1000),
            permissions=cast(Permissions, permissions),
            integrity=IntegrityKey.from_config(
                env=integrity_key_env, file=integrity_key_file, tier="fs"
            ),
        )
