# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The tier forgets a job once it reported it, also under ``python -O`` (asserts stripped)."""

from __future__ import annotations

import textwrap

from tests.subprocesses import run_python

# Runs in a child interpreter started with -O. The breaker is tripped first (one store against a
# port nothing listens on), so the second job is failed at submit and nothing but the tier's job
# table could still hold it (and its block_ids array) after get_finished_jobs() reported it.
_SCRIPT = textwrap.dedent(
    """
    import gc, mmap, sys, weakref
    import numpy as np
    from tests.v1.kv_offload.utils import make_cpu_spec
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import JobMetadata
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if __debug__:
        sys.exit("not run with -O")
    ROW = 64 << 10
    mm = mmap.mmap(-1, 4 * ROW)
    view = memoryview(mm).cast("B", (4, ROW))
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "redis", "url": "redis://127.0.0.1:1", "timeout_s": 0.5}, view,
        make_cpu_spec(ROW, 4),
    )
    ctx = ReqContext("t")
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(2)]
    tier.submit_store(JobMetadata(1, keys, np.arange(2, dtype=np.int64), False, ctx))
    tier.drain_jobs()
    if [tuple(r) for r in tier.get_finished_jobs()] != [(1, False)]:  # no assert under -O
        sys.exit("the first job was not reported as failed")
    if tier.wait_reachable(0):
        sys.exit("the breaker did not open")
    rows = np.arange(2, dtype=np.int64)
    alive = weakref.ref(rows)
    tier.submit_store(JobMetadata(2, keys, rows, False, ctx))
    del rows
    reported = [tuple(r) for r in tier.get_finished_jobs()]
    gc.collect()
    print(reported, "held" if alive() is not None else "released")
    tier.shutdown()
    """
)


def test_reported_jobs_are_released_under_python_O() -> None:
    out = run_python("-O", "-c", _SCRIPT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "[(2, False)] released", out.stdout + out.stderr
