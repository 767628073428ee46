# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The CPU tier's worker side: GPU <-> CPU copies of offloaded blocks on each worker rank.

* ``gpu_worker``: ``CpuGpuOffloadingHandlers``, the two handlers (stores GPU -> CPU, loads
  CPU -> GPU) over a worker's canonical KV caches and its views of the shared region.
* ``planner``: how a job's transfer specs pair GPU blocks with CPU sub-blocks.
* ``handler``: how jobs are submitted, ordered and reported (streams, events).
* ``compute_stream``: the model's compute stream, which stores are ordered after.

Nothing here runs on the scheduler: the scheduler-side CPU tier (``cpu/manager.py``, its
policies, request ledger and reuse filter) never imports this package.
"""
