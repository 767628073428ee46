# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Worker side of KV offloading, medium-neutral: the ``OffloadingHandler`` interface, the
``OffloadingWorker`` that routes each job to the handler of its (source, destination) media, and
the canonical view of a worker's KV caches (``canonical``). The CPU tier's handlers are in
``vllm.v1.kv_offload.cpu.transfer``."""
