# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload run --fs-clear``: delete the fs tier's files under ``--fs-root`` and exit.

Owns what the command removes (only what the fs tier wrote, in the layout of
``docs/fs_tier.md``) and the one line it prints about it; no engine is started.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import sys
from pathlib import Path

from vllm.entrypoints.cli.report.text import PROG, format_bytes
from vllm.v1.kv_offload.tiering.fs.file_mapper import CONFIG_FILE

_FLEET_DIR = re.compile(r"engine-\d+")


def clear_fs(root: Path) -> int:
    """Delete the fs tier's files under ``root`` and print what went; the exit code."""
    try:
        runs, removed = clear_fs_root(root)
    except OSError as e:
        sys.stderr.write(f"{PROG}: error: cannot clear {root}: {e}\n")
        return 1
    sys.stdout.write(
        f"{PROG}: removed {runs} run director{'y' if runs == 1 else 'ies'} "
        f"({format_bytes(removed)}) of the fs tier from {root}\n"
    )
    return 0


def clear_fs_root(root: Path) -> tuple[int, int]:
    """Delete the fs tier's files under ``root``; return (run directories, bytes) removed.

    Only what the tier writes is touched: each ``<name>/`` that holds a ``config.json``, with its
    block directories ``<name>_r<rank>/`` (the layout of ``docs/fs_tier.md``), in ``root`` and in
    the fleet's instance directories ``root/engine-<i>/`` (removed when that leaves them empty).
    Anything else under ``root`` stays, so a mistyped ``--fs-root $HOME`` deletes nothing of
    the user's.

    Raises:
        OSError: a directory could not be listed or removed.
    """
    if not root.is_dir():
        return 0, 0
    # A fleet (--engines N) gives each instance its own directory engine-<i> under the root.
    fleet_dirs = [d for d in root.iterdir() if d.is_dir() and _FLEET_DIR.fullmatch(d.name)]
    runs, removed_bytes = _clear_runs(root)
    for directory in fleet_dirs:
        n, size = _clear_runs(directory)
        runs, removed_bytes = runs + n, removed_bytes + size
        with contextlib.suppress(OSError):  # not empty: something else lives there
            directory.rmdir()
    return runs, removed_bytes


def _clear_runs(root: Path) -> tuple[int, int]:
    runs = [d for d in root.iterdir() if d.is_dir() and (d / CONFIG_FILE).is_file()]
    removed_bytes = 0
    for run in runs:
        doomed = [run] + [
            d
            for d in root.iterdir()
            if d.is_dir()
            and d.name.startswith(f"{run.name}_r")
            and d.name[len(run.name) + 2 :]
            and d.name[len(run.name) + 2 :].isdigit()
        ]
        for d in doomed:
            removed_bytes += _tree_bytes(d)
            shutil.rmtree(d)
    return len(runs), removed_bytes


def _tree_bytes(path: Path) -> int:
    """The bytes of the files under ``path``, each file once: a block file also has a hard link
    in ``slots/`` (the capacity index's), which frees no byte of its own."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total
