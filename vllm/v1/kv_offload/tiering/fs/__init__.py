# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Filesystem secondary tier (type ``"fs"``): one verified block file per block under a root.

Modules, one per concern: ``manager`` (``FileSystemSecondaryTier``, the tier's face), ``config``
(its keys), ``file_mapper`` (the layout), ``run_dir`` (the run's directories at start),
``block_io`` (system calls: safe directory walks, atomic writes, verified reads, file modes),
``transfers`` (the read/write path: a job's stores and loads in chunks, the lookup probe, files
that keep failing to read), ``capacity`` (the capacity index and the removal of files through
it), ``slots`` and ``slot_hints`` (the capacity slots that bound a root shared by several
instances), ``writers`` (which instances write the directory), ``scan`` (the start-up scan and
the walk of every reconcile pass), ``reconcile`` (the thread that runs them), ``lookup``
(lookups from the index, else a background probe), ``io_pool`` (the I/O threads), ``meters``
(counters, busy clocks, free space, rate-limited logs). The on-disk format is
``tiering.block_format``, shared with the redis tier. See ``docs/fs_tier.md``.
"""
