# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The catalogue of the offloading connector's metrics: name, type, labels, buckets, meaning.

One entry per metric that ``OffloadingConnectorStats`` carries or the Prometheus exporter
serves. Names follow upstream vLLM where upstream has the metric (``upstream=True``: same name,
type and label set, e.g. ``vllm:kv_offload_store_bytes``); the others are ours and documented as
such in ``docs/metrics.md``, which lists exactly this table (a test keeps the two in sync).

Label conventions:

* ``transfer_type``: ``"<SRC>_to_<DST>"`` in upstream's spelling: ``GPU_to_CPU``, ``CPU_to_GPU``,
  and for a secondary tier of type ``t``: ``CPU_to_<t>`` (cascade) and ``<t>_to_CPU``
  (promotion), e.g. ``CPU_to_fs``.
* ``tier``: upstream's tiering label: ``"0:primary"`` for the CPU tier (the only tier without
  tiering), ``"<i+1>:<type>"`` for secondary tier ``i``, e.g. ``"1:fs"``.

The exporter adds its own labels in front of these (``model_name``, ``engine``, ``run``).
Prometheus appends ``_total`` to counter names when it exposes them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm.v1.kv_offload.metrics import PRIMARY_TIER_LABEL, tier_label

__all__ = ["BY_NAME", "CATALOG", "PRIMARY_TIER_LABEL", "MetricDef", "MetricType", "tier_label"]


class MetricType(str, enum.Enum):
    """How a metric's values combine (the ``"types"`` of ``OffloadingConnectorStats.data``)."""

    COUNTER = "counter"
    """Values are increments: they add up over steps and over worker ranks."""
    GAUGE = "gauge"
    """Values are levels: the latest one wins."""
    HISTOGRAM = "histogram"
    """Values are lists of observations (one per job, call or step): they concatenate."""


@dataclass(frozen=True)
class MetricDef:
    """One metric of the catalogue.

    Attributes:
        name: the Prometheus name (without the ``_total`` suffix of counters).
        type: counter, gauge or histogram.
        labelnames: the metric's own labels (the exporter's come in front).
        documentation: what it measures (the Prometheus HELP text).
        unit: the unit of its values, for the docs (``"bytes"``, ``"seconds"``, ...).
        buckets: histogram bucket bounds (histograms only).
        upstream: whether upstream vLLM defines the same metric.
        source: which side produces it: ``"worker"``, ``"scheduler"``, ``"tier"`` or ``"engine"``.
    """

    name: str
    type: MetricType
    labelnames: tuple[str, ...]
    documentation: str
    unit: str
    buckets: tuple[float, ...] = ()
    upstream: bool = False
    source: str = "scheduler"


TRANSFER_TYPE = "transfer_type"
TIER = "tier"


# Upstream's byte buckets (jobs of many large blocks) and ours, which also resolve the small jobs
# of small models: powers of 4 from 4 KiB to 1 GiB.
UPSTREAM_SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
SIZE_BUCKETS = tuple(float(4**k) for k in range(6, 16))
LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
SYNC_DELAY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
ASYNC_DELAY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
STEP_BUCKETS = (1e-6, 1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.1)
WAIT_STEP_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)

_C, _G, _H = MetricType.COUNTER, MetricType.GAUGE, MetricType.HISTOGRAM
_TT = (TRANSFER_TYPE,)
_TIER = (TIER,)


def _m(
    name: str,
    type_: MetricType,
    labels: tuple[str, ...],
    unit: str,
    doc: str,
    *,
    buckets: tuple[float, ...] = (),
    upstream: bool = False,
    source: str = "scheduler",
) -> MetricDef:
    return MetricDef(f"vllm:{name}", type_, labels, doc, unit, buckets, upstream, source)


CATALOG: tuple[MetricDef, ...] = (
    # GPU <-> CPU transfers, upstream's names (unlabelled: load = CPU_to_GPU, store = GPU_to_CPU).
    _m(
        "kv_offload_store_bytes",
        _C,
        (),
        "bytes",
        "Bytes copied GPU -> CPU, summed over worker ranks.",
        upstream=True,
        source="worker",
    ),
    _m(
        "kv_offload_load_bytes",
        _C,
        (),
        "bytes",
        "Bytes copied CPU -> GPU, summed over worker ranks.",
        upstream=True,
        source="worker",
    ),
    _m(
        "kv_offload_store_time",
        _C,
        (),
        "seconds",
        "Time the GPU -> CPU copy jobs ran, summed over jobs and ranks.",
        upstream=True,
        source="worker",
    ),
    _m(
        "kv_offload_load_time",
        _C,
        (),
        "seconds",
        "Time the CPU -> GPU copy jobs ran, summed over jobs and ranks.",
        upstream=True,
        source="worker",
    ),
    _m(
        "kv_offload_store_size",
        _H,
        (),
        "bytes",
        "Bytes of each GPU -> CPU copy job (one observation per job and rank).",
        buckets=UPSTREAM_SIZE_BUCKETS,
        upstream=True,
        source="worker",
    ),
    _m(
        "kv_offload_load_size",
        _H,
        (),
        "bytes",
        "Bytes of each CPU -> GPU copy job (one observation per job and rank).",
        buckets=UPSTREAM_SIZE_BUCKETS,
        upstream=True,
        source="worker",
    ),
    _m(
        "kv_offload_allocation_failure",
        _C,
        (),
        "calls",
        "prepare_store calls that found no room (the blocks are offered again next step).",
        upstream=True,
    ),
    _m(
        "kv_offload_stores_skipped",
        _C,
        (),
        "blocks",
        "Blocks the manager's reuse filter declined to store (only when the manager reports it).",
        upstream=True,
    ),
    _m(
        "kv_offload_lookup_sync_delay_seconds",
        _H,
        (),
        "seconds",
        "Time of one connector lookup (get_num_new_matched_tokens) call.",
        buckets=SYNC_DELAY_BUCKETS,
        upstream=True,
    ),
    _m(
        "kv_offload_lookup_async_delay_seconds",
        _H,
        (),
        "seconds",
        "From a request's first deferred lookup until its lookup resolves.",
        buckets=ASYNC_DELAY_BUCKETS,
        upstream=True,
    ),
    _m(
        "kv_offload_cpu_cache_usage_perc",
        _G,
        (),
        "ratio",
        "Allocated CPU-tier blocks over capacity (0..1), in-flight and evictable ones included.",
        upstream=True,
    ),
    # Every direction, ours: one family per quantity, labelled by direction.
    _m(
        "kv_offload_transfer_jobs",
        _C,
        _TT,
        "jobs",
        "Transfer jobs that finished successfully (GPU directions: per rank).",
        source="worker",
    ),
    _m(
        "kv_offload_transfer_blocks",
        _C,
        _TT,
        "blocks",
        "Blocks moved successfully (one block = one offloaded block of one KV-cache group).",
    ),
    _m(
        "kv_offload_transfer_bytes",
        _C,
        _TT,
        "bytes",
        "Bytes moved successfully (GPU directions: summed over ranks; fs: whole block files).",
    ),
    _m(
        "kv_offload_transfer_failed_blocks",
        _C,
        _TT,
        "blocks",
        "Blocks whose transfer failed (fs -> CPU: corrupt files included).",
    ),
    _m("kv_offload_transfer_failed_jobs", _C, _TT, "jobs", "Transfer jobs that failed."),
    _m(
        "kv_offload_transfer_latency_seconds",
        _H,
        _TT,
        "seconds",
        "Duration of each transfer job (GPU: the copy on the worker; tiers: submit to report).",
        buckets=LATENCY_BUCKETS,
    ),
    _m(
        "kv_offload_transfer_size_bytes",
        _H,
        _TT,
        "bytes",
        "Bytes of each transfer job (tiers: primary rows moved).",
        buckets=SIZE_BUCKETS,
    ),
    # Tiering, upstream's names.
    _m(
        "kv_offload_tiering_chunk_queries",
        _C,
        _TIER,
        "blocks",
        "Block lookups that reached the tier (primary: answered hit or miss).",
        upstream=True,
    ),
    _m(
        "kv_offload_tiering_chunk_hits",
        _C,
        _TIER,
        "blocks",
        "Block lookups the tier answered with a hit.",
        upstream=True,
    ),
    _m(
        "kv_offload_tiering_write_bytes",
        _C,
        _TIER,
        "bytes",
        "Bytes written to the secondary tier (cascades).",
        upstream=True,
        source="tier",
    ),
    _m(
        "kv_offload_tiering_read_bytes",
        _C,
        _TIER,
        "bytes",
        "Bytes read from the secondary tier (promotions).",
        upstream=True,
        source="tier",
    ),
    _m(
        "kv_offload_tiering_write_time",
        _C,
        _TIER,
        "seconds",
        "Wall time the tier's I/O threads spent writing.",
        upstream=True,
        source="tier",
    ),
    _m(
        "kv_offload_tiering_read_time",
        _C,
        _TIER,
        "seconds",
        "Wall time the tier's I/O threads spent reading.",
        upstream=True,
        source="tier",
    ),
    _m(
        "kv_offload_tiering_promotion_job_failures",
        _C,
        _TIER,
        "jobs",
        "Promotion jobs (tier -> primary) that failed.",
        upstream=True,
    ),
    _m(
        "kv_offload_tiering_cascade_job_failures",
        _C,
        _TIER,
        "jobs",
        "Cascade jobs (primary -> tier) that failed.",
        upstream=True,
    ),
    _m(
        "kv_offload_tiering_active_promotion_jobs",
        _G,
        _TIER,
        "jobs",
        "Promotion jobs submitted and not reported yet.",
        upstream=True,
    ),
    _m(
        "kv_offload_tiering_active_cascade_jobs",
        _G,
        _TIER,
        "jobs",
        "Cascade jobs submitted and not reported yet.",
        upstream=True,
    ),
    # Per tier, ours.
    _m(
        "kv_offload_tiering_promotion_jobs",
        _C,
        _TIER,
        "jobs",
        "Promotion jobs submitted (one per tier, request and step).",
    ),
    _m("kv_offload_tiering_cascade_jobs", _C, _TIER, "jobs", "Cascade jobs submitted."),
    _m(
        "kv_offload_tier_used_blocks",
        _G,
        _TIER,
        "blocks",
        "Blocks the tier holds (primary: allocated rows).",
    ),
    _m(
        "kv_offload_tier_used_bytes",
        _G,
        _TIER,
        "bytes",
        "Bytes those blocks occupy on the tier's medium.",
    ),
    _m(
        "kv_offload_tier_capacity_blocks",
        _G,
        _TIER,
        "blocks",
        "Blocks the tier can hold (absent when unbounded).",
    ),
    _m(
        "kv_offload_tier_capacity_bytes",
        _G,
        _TIER,
        "bytes",
        "Bytes the tier may use (absent when unbounded).",
    ),
    _m(
        "kv_offload_tier_evicted_blocks",
        _C,
        _TIER,
        "blocks",
        "Blocks the tier evicted to make room.",
    ),
    _m(
        "kv_offload_tier_corrupt_blocks",
        _C,
        _TIER,
        "blocks",
        "Blocks found corrupt when read (discarded; the tokens are recomputed).",
    ),
    _m(
        "kv_offload_tier_skipped_blocks",
        _C,
        _TIER,
        "blocks",
        "Blocks a cascade did not write because the tier held them already.",
    ),
    # The connector, ours.
    _m(
        "kv_offload_jobs_in_flight",
        _G,
        (),
        "jobs",
        "GPU <-> CPU jobs created and not yet reported by every worker.",
    ),
    _m(
        "kv_offload_flushed_jobs",
        _C,
        (),
        "jobs",
        "Jobs the workers had to finish before a forward pass (preemption, block reuse, reset).",
    ),
    _m(
        "kv_offload_lookup_deferrals",
        _C,
        (),
        "lookups",
        "Lookups answered 'ask again next step' (one per request and step waited).",
    ),
    _m(
        "kv_offload_lookup_wait_steps",
        _H,
        (),
        "steps",
        "Steps a request waited on deferred lookups before its lookup resolved.",
        buckets=WAIT_STEP_BUCKETS,
    ),
    _m(
        "kv_offload_schedule_end_seconds",
        _H,
        (),
        "seconds",
        "Time of manager.on_schedule_end(), once per step.",
        buckets=STEP_BUCKETS,
    ),
    _m(
        "kv_offload_scheduler_step_seconds",
        _H,
        (),
        "seconds",
        "Time of the whole scheduler-side connector per engine step (manager included).",
        buckets=STEP_BUCKETS,
        source="engine",
    ),
    _m(
        "kv_offload_scheduler_step_cpu_seconds",
        _H,
        (),
        "seconds",
        "Engine-thread CPU time of the whole scheduler-side connector per engine step (manager "
        "included).",
        buckets=STEP_BUCKETS,
        source="engine",
    ),
    # The load guard (offloading/load_guard.py; absent when the guard is off).
    _m(
        "kv_offload_load_guard_skipped_hits",
        _C,
        _TIER,
        "hits",
        "Hits in the tier the load guard computed instead of loading (loading was slower).",
    ),
    _m(
        "kv_offload_load_guard_skipped_tokens",
        _C,
        _TIER,
        "tokens",
        "Tokens of those hits: recomputed because loading them was estimated slower.",
    ),
    _m(
        "kv_offload_load_guard_probes",
        _C,
        _TIER,
        "hits",
        "Hits the load guard loaded although it estimated loading slower (re-probes).",
    ),
    _m(
        "kv_offload_load_guard_load_latency_seconds",
        _G,
        _TIER,
        "seconds",
        "The load guard's estimate of a load's fixed wait in the tier, beyond its step.",
    ),
    _m(
        "kv_offload_load_guard_load_seconds_per_block",
        _G,
        _TIER,
        "seconds",
        "The load guard's estimate of a load's wait per block in the tier, beyond its step.",
    ),
    _m(
        "kv_offload_load_guard_compute_seconds_per_token",
        _G,
        (),
        "seconds",
        "The load guard's estimate of the engine's prefill time per token.",
    ),
    _m(
        "kv_offload_load_guard_step_seconds",
        _G,
        (),
        "seconds",
        "The load guard's estimate of a step's fixed cost, charged to every load.",
    ),
    # Tokens, per tier (engine-level: the report's figures).
    _m(
        "prefix_cache_queries",
        _C,
        (),
        "tokens",
        "Prompt tokens placed (looked up in the GPU prefix cache).",
        upstream=True,
        source="engine",
    ),
    _m(
        "prefix_cache_hits",
        _C,
        (),
        "tokens",
        "Placed tokens the GPU prefix cache served.",
        upstream=True,
        source="engine",
    ),
    _m(
        "kv_offload_tier_lookup_tokens",
        _C,
        _TIER,
        "tokens",
        "Placed tokens that reached the tier (missed every faster cache).",
        source="engine",
    ),
    _m(
        "kv_offload_tier_hit_tokens",
        _C,
        _TIER,
        "tokens",
        "Placed tokens the tier served (loaded and verified).",
        source="engine",
    ),
)
"""Every metric, in the order of ``docs/metrics.md``."""

BY_NAME: dict[str, MetricDef] = {m.name: m for m in CATALOG}
