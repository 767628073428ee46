# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Filesystem secondary tier (type ``"fs"``): one verified block file per block under a root.

Modules: ``config`` (tier kwargs), ``file_mapper`` (layout), ``block_io`` (system calls),
``index`` (capacity accounting), ``slots`` and ``slot_hints`` (the capacity slots that bound a
root shared by several instances), ``reconcile`` (the background walk that keeps the index equal
to the disk), ``io_pool`` (I/O threads), ``block_jobs`` (a job's per-block I/O tasks), ``store``
(per-block operations), ``read_failures`` (files that keep failing to read), ``meters`` (I/O
timing), ``run_dir`` (directories at start), ``scan``
(start-up scan), ``lookup`` (async lookups), ``manager`` (``FileSystemSecondaryTier``). The
on-disk format is ``tiering.block_format``, shared with the redis tier. See ``docs/fs_tier.md``.
"""
