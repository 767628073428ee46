# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Cache policies of the CPU primary tier (which blocks to evict): the ``CachePolicy`` interface
and ``BlockStatus`` (``base``), LRU (``lru``), ARC (``arc``, with its lazy FIFOs in
``arc_lists``) and the name -> class registry (``factory``)."""
