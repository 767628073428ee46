# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The CPU primary tier.

Scheduler side, at this level: ``manager`` (``CPUOffloadingManager``: rows, reference counts,
events, statistics), ``request_ledger`` (which request holds each pin and pending store),
``reuse_filter`` (``store_threshold``) and ``policies/`` (LRU, ARC, out-of-tree policies).
Both sides: ``spec`` (``CPUOffloadingSpec``, which builds the manager and the workers'
handlers) and ``common`` (the transfer descriptors, at upstream's path). The shared host region
is the ``shared_region`` package; the worker side's GPU <-> CPU copies are the ``transfer``
package. ``shared_offload_region`` and ``gpu_worker`` keep upstream vLLM's module paths of
``SharedOffloadRegion`` and ``CpuGpuOffloadingHandlers``.
"""
