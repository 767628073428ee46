# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The CPU tier's shared host region: one file-backed mapping per engine instance, created by
the scheduler and joined by every worker (``SharedOffloadRegion``).

Its face is what this package exports:

* ``SharedOffloadRegion``: create or join the region, its rows and per-worker views, teardown.
* ``SharedRegionError``: a region that cannot be created or joined (a peer's file, a timeout).
* ``RegionGeometry``: the row layout both sides must agree on.
* ``ProcessIdentity``: who created a region file (pid, start time, pid namespace, boot id).
* ``sweep_stale_regions``: remove the files of creators that no longer run.

Modules, one concern each: ``region`` (the mapping, rows, views and teardown), ``publish``
(creating or joining the file under its lock), ``trailer`` (the geometry and the on-file
metadata), ``files`` (the files' names, and removing a name only while it names the same
file), ``prefault`` (faulting pages in without disturbing peers' bytes), ``sweep`` (removing
dead creators' files) and ``process_identity``.
"""

from vllm.v1.kv_offload.cpu.shared_region.process_identity import ProcessIdentity
from vllm.v1.kv_offload.cpu.shared_region.publish import SharedRegionError
from vllm.v1.kv_offload.cpu.shared_region.region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.shared_region.sweep import sweep_stale_regions
from vllm.v1.kv_offload.cpu.shared_region.trailer import RegionGeometry

__all__ = [
    "ProcessIdentity",
    "RegionGeometry",
    "SharedOffloadRegion",
    "SharedRegionError",
    "sweep_stale_regions",
]
