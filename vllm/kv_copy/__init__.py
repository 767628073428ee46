# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Batched KV-block copies between GPU KV caches and host memory (the implementation behind
``vllm._custom_ops``, which is the public face: import from there).

Modules, one concern each:

* ``errors``: the exceptions every copy raises.
* ``regions``: the description of a job (``BlockSide``, ``CopyRegion``, ``REGION_DTYPE``).
* ``checks``: the Python twin of the C library's argument checks.
* ``host_copy``: the torch backend (copies between host addresses, region by region).
* ``method_choice``: which CUDA path (SM-copy kernel or batched DMA) a job takes.
* ``cuda_library``: the ctypes binding of the CUDA copy library built from ``csrc/``.
* ``cuda_resources``: CUDA streams and events owned by Python objects.
"""
