# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The shared region's files in their directory: their names, and who may remove a name.

A region of instance ``<id>`` is published as ``vllm_offload_<id>.mmap``; its creator builds it
first under a temporary name, ``vllm_offload_creating-<pid>-<start>-<nonce>.tmp``, that carries
the creator's pid and start time so a sweep can tell whether the creator still runs.

A region's name is only ever removed under the file's ``flock`` and after checking that it still
names the same file (``unlink_if_names``), so nobody removes a successor's region.
"""

from __future__ import annotations

import os
import re
import secrets

from vllm.v1.kv_offload.cpu.shared_region.process_identity import ProcessIdentity

INSTANCE_ID_RE = re.compile(r"[A-Za-z0-9_.-]+")
FILE_PREFIX = "vllm_offload_"
FILE_SUFFIX = ".mmap"
TMP_PREFIX = FILE_PREFIX + "creating-"
TMP_SUFFIX = ".tmp"
TMP_NAME_RE = re.compile(re.escape(TMP_PREFIX) + r"(\d+)-(\d+)-[0-9a-f]+" + re.escape(TMP_SUFFIX))
# Longest name most filesystems accept (NAME_MAX).
MAX_FILE_NAME = 255
MAX_INSTANCE_ID_LEN = MAX_FILE_NAME - len(FILE_PREFIX) - len(FILE_SUFFIX)


def region_path(instance_id: str, directory: str | os.PathLike[str] = "/dev/shm") -> str:
    """Return the backing-file path of ``instance_id`` in ``directory``.

    Raises:
        ValueError: ``instance_id`` is empty, too long, or has a character outside
            ``[A-Za-z0-9_.-]``.
    """
    if not isinstance(instance_id, str) or not INSTANCE_ID_RE.fullmatch(instance_id):
        raise ValueError(
            f"instance_id={instance_id!r} is invalid: expected a non-empty string of "
            "[A-Za-z0-9_.-] characters"
        )
    if len(instance_id) > MAX_INSTANCE_ID_LEN:
        raise ValueError(
            f"instance_id={instance_id!r} is too long: at most {MAX_INSTANCE_ID_LEN} characters"
        )
    return os.path.join(os.fspath(directory), f"{FILE_PREFIX}{instance_id}{FILE_SUFFIX}")


def temp_path(directory: str, creator: ProcessIdentity) -> str:
    """A fresh temporary name in ``directory`` for a region ``creator`` builds."""
    name = f"{TMP_PREFIX}{creator.pid}-{creator.start_ticks}-{secrets.token_hex(8)}{TMP_SUFFIX}"
    return os.path.join(directory, name)


def temp_file_creator(name: str) -> ProcessIdentity | None:
    """The creator (pid and start time only) a temporary file's name carries; None if ``name``
    is not a temporary region file's name."""
    match = TMP_NAME_RE.fullmatch(name)
    if match is None:
        return None
    return ProcessIdentity(int(match[1]), int(match[2]), 0, bytes(16))


def names_file(path: str, st: os.stat_result) -> bool:
    """Whether ``path`` (not following a symlink) is still the file ``st`` describes."""
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (current.st_dev, current.st_ino) == (st.st_dev, st.st_ino)


def unlink_if_names(path: str, st: os.stat_result) -> bool:
    """Unlink ``path`` if it still names the file ``st``; whether it did.

    Callers hold the file's ``flock``, and every removal of a region's name happens under it, so
    nobody can remove the name and publish a successor between the check and the unlink.
    """
    if not names_file(path, st):
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
