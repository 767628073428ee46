# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The fs tier's batched system calls: a task's opens, looks, creations, writes, renames and
reads, each kind in one call with the GIL released once.

Every system call the I/O threads make from Python releases the GIL and takes it back; a block
costs about ten of them, and on a small host each take-back waits for the engine thread, which
in turn waits for the I/O thread's next release (docs/benchmarks.md, "The offload machinery's own
cost"). ``vllm._kv_offload_fs_io`` (``csrc/fs_io.c``, built by ``pip install`` with the system's
C compiler) makes those of a whole task in a few calls. It decides nothing: per block it says
what happened. ``BlockTransfers`` takes every load or dedupe look that left the common path (a
directory or file missing where it was expected, a file of the wrong kind or size, an error)
through the Python code, which then makes the same decisions as without it, and undoes a store
that failed as the Python code does (docs/fs_tier.md, "Batched system calls").

Without the module (not built: another platform, no C compiler) or with
``VLLM_KV_OFFLOAD_FS_NATIVE_IO=0`` the tier makes every call from Python; what it stores and
loads is the same.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from vllm.logger import init_logger

logger = init_logger(__name__)

MODULE = "vllm._kv_offload_fs_io"
DISABLE_ENV = "VLLM_KV_OFFLOAD_FS_NATIVE_IO"
"""``0`` (or ``false``, ``no``, ``off``): make every system call from Python."""

ABI_VERSION = 3
"""The ``ABI_VERSION`` of the module this code calls; a module built from other sources is not
used (a stale build in a source checkout)."""


def load_native_io() -> ModuleType | None:
    """The batched system calls' module, or None where the tier makes the calls from Python
    (logged once at DEBUG, with the reason). Called when an fs tier starts."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("0", "false", "no", "off"):
        logger.debug("fs tier: system calls from Python (%s=0)", DISABLE_ENV)
        return None
    try:
        module = importlib.import_module(MODULE)
    except ImportError as e:
        logger.debug("fs tier: system calls from Python (%s not built: %s)", MODULE, e)
        return None
    if getattr(module, "ABI_VERSION", None) != ABI_VERSION:
        logger.warning(
            "fs tier: %s is from another build (ABI %s, expected %d); the tier makes its system "
            "calls from Python. Reinstall the package to rebuild it.",
            MODULE,
            getattr(module, "ABI_VERSION", None),
            ABI_VERSION,
        )
        return None
    return module
