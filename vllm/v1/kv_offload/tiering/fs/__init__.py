"""Filesystem secondary tier (type ``"fs"``): one verified block file per block under a root.

Modules: ``config`` (tier kwargs), ``file_mapper`` (layout), ``block_file`` (on-disk format),
``block_io`` (system calls), ``index`` (capacity accounting), ``io_pool`` (I/O threads),
``block_jobs`` (a job's per-block I/O tasks), ``store`` (per-block operations), ``run_dir``
(directories at start), ``scan`` (start-up scan), ``lookup`` (async lookups), ``manager``
(``FileSystemSecondaryTier``). See ``docs/fs_tier.md``.
"""
