# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Who a process is, in a way that survives pid reuse and reboots, and whether it still runs.

The shared region's trailer records its creator's identity (``ProcessIdentity``); the sweep and
joiners use ``process_is_alive`` to tell a live creator from a dead one whose pid may since have
gone to another process.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a process is, in a way that survives pid reuse and reboots.

    Attributes:
        pid: the process id (in ``pidns``).
        start_ticks: its start time in clock ticks after boot (``/proc/<pid>/stat`` field 22);
            0 where ``/proc`` is unavailable.
        pidns: the inode of its pid namespace (``/proc/self/ns/pid``); 0 if unknown.
        boot_id: the kernel's boot id (16 bytes); zeros if unknown.
    """

    pid: int
    start_ticks: int
    pidns: int
    boot_id: bytes


def _read_start_ticks(pid: int) -> tuple[str, int] | None:
    """``(state, start_ticks)`` of process ``pid`` from ``/proc``; None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
    # ")"; state is field 3 and starttime field 22 of the whole line.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])


def _current_identity_uncached() -> ProcessIdentity:
    pid = os.getpid()
    start_ticks = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        found = _read_start_ticks(pid)
        if found is not None:
            start_ticks = found[1]
    pidns = 0
    with contextlib.suppress(OSError):
        pidns = os.stat("/proc/self/ns/pid").st_ino
    boot_id = bytes(16)
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = bytes.fromhex(f.read().strip().replace("-", ""))[:16].ljust(16, b"\0")
    return ProcessIdentity(pid, start_ticks, pidns, boot_id)


_identity_cache: ProcessIdentity | None = None


def current_identity() -> ProcessIdentity:
    """This process's identity (recomputed after a fork)."""
    global _identity_cache
    identity = _identity_cache
    if identity is None or identity.pid != os.getpid():
        identity = _identity_cache = _current_identity_uncached()
    return identity


def process_is_alive(identity: ProcessIdentity) -> bool | None:
    """Whether the process ``identity`` still runs: True, False, or None when this process
    cannot tell (it lives in another pid namespace, or its ``/proc`` entry is unreadable)."""
    me = current_identity()
    no_boot_id = bytes(16)
    if no_boot_id not in (identity.boot_id, me.boot_id) and identity.boot_id != me.boot_id:
        return False  # from an earlier boot
    if identity.pidns and me.pidns and identity.pidns != me.pidns:
        return None
    if identity.pid <= 0:
        return False
    if not os.path.isdir("/proc/self"):
        # No procfs: only whether the pid exists.
        try:
            os.kill(identity.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        found = _read_start_ticks(identity.pid)
    except (OSError, ValueError, IndexError):
        return None
    if found is None:
        return False
    state, start_ticks = found
    if state in ("Z", "X"):
        return False  # exited, not reaped yet
    # A different start time: the pid now belongs to another process.
    return not identity.start_ticks or start_ticks == identity.start_ticks
