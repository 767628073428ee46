"""Filesystem secondary tier (type ``"fs"``): one verified block file per block under a root.

Modules: ``config`` (tier kwargs), ``file_mapper`` (layout), ``block_io`` (system calls),
``index`` (capacity accounting), ``io_pool`` (I/O threads), ``store`` (per-block operations),
``run_dir`` (directories at start), ``scan`` (start-up scan), ``lookup`` (async lookups),
``manager`` (``FileSystemSecondaryTier``). The on-disk format is ``tiering.block_format``,
shared with the redis tier. See ``docs/fs_tier.md``.
"""
