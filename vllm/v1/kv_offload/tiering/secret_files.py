# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Reading a secret from a file that only its owner may access.

A secret kept in a file (a Redis password, a fleet's integrity key) stays out of command lines
(``ps``) and configs, but only if nobody else can read or change the file: one readable by a
group or by others is refused, not used with a warning.
"""

from __future__ import annotations

import os
import stat


def read_private_file(path: str, what: str) -> bytes:
    """The raw bytes of file ``path``.

    Args:
        path: the file (a symlink is followed: the target is checked).
        what: what the file holds, for the errors (e.g. "integrity key file").

    Raises:
        ValueError: the file cannot be read, is not a regular file, or any group or other
            permission bit is set. The message names ``what`` and the path, never the contents.
    """
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{what} {path!r} is not a regular file")
            if st.st_mode & 0o077:
                raise ValueError(
                    f"{what} {path!r} is accessible to other users (mode "
                    f"{stat.S_IMODE(st.st_mode):04o}); make it private: chmod 600"
                )
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from None
