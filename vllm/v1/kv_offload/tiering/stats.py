# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``TieringStats``: what the tiering manager counts per secondary tier, for monitoring.

The manager updates it with plain integer adds (tier hits, jobs submitted and in flight; a lookup
that misses every tier adds nothing) and, once per finished job (not per key), records a
``TierJobSample``: the job's size and how long it took from submission to the poll that saw it
finish. The connector's stats collector drains the samples once per step (``report``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.kv_offload.metrics import CounterSet, MetricsRecorder, report_tier_stats, tier_label

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

MAX_PENDING_SAMPLES = 100_000
"""Most job samples kept until collected; bounds memory when nobody collects (benchmarks)."""


@functools.cache
def _tiering_counters(label: str) -> CounterSet:
    """The counters ``TieringStats.report`` keeps per tier, in the order of its totals."""
    t = (label,)
    return (
        ("vllm:kv_offload_tiering_chunk_queries", t),
        ("vllm:kv_offload_tiering_chunk_hits", t),
        ("vllm:kv_offload_tiering_promotion_jobs", t),
        ("vllm:kv_offload_tiering_cascade_jobs", t),
        ("vllm:kv_offload_tiering_promotion_job_failures", t),
        ("vllm:kv_offload_tiering_cascade_job_failures", t),
    )


@dataclass(frozen=True, slots=True)
class TierJobSample:
    """One finished primary <-> secondary job.

    Attributes:
        tier_idx: the secondary tier (index in lookup order).
        is_promotion: a load (tier -> primary) rather than a cascade (primary -> tier).
        num_blocks: blocks of the job.
        seconds: from ``submit_*`` until the poll that saw the job's result; a poll happens once
            per step, so this includes up to a step of waiting.
        success: whether the tier reported success.
    """

    tier_idx: int
    is_promotion: bool
    num_blocks: int
    seconds: float
    success: bool


class TieringStats:
    """Per-tier counters of a ``TieringOffloadingManager`` (cumulative, never reset).

    Attributes:
        hits: per tier, lookups it answered with a hit (a promotion was then attempted).
        primary_misses_before_reset: the primary's lookup misses before its counters were last
            zeroed by ``reset_cache``. Lookups reaching tier 0 are the primary's misses; those
            reaching tier ``i + 1`` are those reaching tier ``i`` less its hits (a hit ends the
            lookup, a miss or "not yet" goes on), so only hits need counting per key.
        promotion_jobs, cascade_jobs: per tier, jobs submitted.
        failed_promotion_jobs, failed_cascade_jobs: per tier, jobs reported failed (or whose
            submit raised).
        active_promotion_jobs, active_cascade_jobs: per tier, jobs submitted and not reported.
    """

    def __init__(self, num_tiers: int) -> None:
        self.hits = [0] * num_tiers
        self.primary_misses_before_reset = 0
        self.promotion_jobs = [0] * num_tiers
        self.cascade_jobs = [0] * num_tiers
        self.failed_promotion_jobs = [0] * num_tiers
        self.failed_cascade_jobs = [0] * num_tiers
        self.active_promotion_jobs = [0] * num_tiers
        self.active_cascade_jobs = [0] * num_tiers
        self._samples: list[TierJobSample] = []

    def on_submit(self, tier_idx: int, is_promotion: bool) -> None:
        """A job was handed to tier ``tier_idx``."""
        if is_promotion:
            self.promotion_jobs[tier_idx] += 1
            self.active_promotion_jobs[tier_idx] += 1
        else:
            self.cascade_jobs[tier_idx] += 1
            self.active_cascade_jobs[tier_idx] += 1

    def on_finish(
        self, tier_idx: int, is_promotion: bool, num_blocks: int, seconds: float, success: bool
    ) -> None:
        """A job of tier ``tier_idx`` finished (reported, or its submit raised)."""
        if is_promotion:
            self.active_promotion_jobs[tier_idx] -= 1
            if not success:
                self.failed_promotion_jobs[tier_idx] += 1
        else:
            self.active_cascade_jobs[tier_idx] -= 1
            if not success:
                self.failed_cascade_jobs[tier_idx] += 1
        if len(self._samples) < MAX_PENDING_SAMPLES:
            self._samples.append(
                TierJobSample(tier_idx, is_promotion, num_blocks, seconds, success)
            )

    def take_samples(self) -> list[TierJobSample]:
        """The jobs finished since the last call."""
        samples, self._samples = self._samples, []
        return samples

    def report(
        self,
        recorder: MetricsRecorder,
        tiers: Sequence[SecondaryTierManager],
        row_bytes: int,
        primary_misses: int,
    ) -> None:
        """Report every tier's counters and gauges, its own ``get_stats()``, and the jobs
        finished since the last report.

        Args:
            recorder: where to report.
            tiers: the secondary tiers, in lookup order.
            row_bytes: bytes of one primary row (a job's block in the job-size histogram).
            primary_misses: the primary's lookup misses since its last ``reset_cache``.
        """
        reaching = self.primary_misses_before_reset + primary_misses
        for i, tier in enumerate(tiers):
            label = tier_label(i, tier.tier_type)
            t = (label,)
            hits = self.hits[i]
            recorder.counter_totals(
                _tiering_counters(label),
                (
                    reaching,
                    hits,
                    self.promotion_jobs[i],
                    self.cascade_jobs[i],
                    self.failed_promotion_jobs[i],
                    self.failed_cascade_jobs[i],
                ),
            )
            reaching -= hits
            active = self.active_promotion_jobs[i]
            recorder.gauge("vllm:kv_offload_tiering_active_promotion_jobs", active, t)
            active = self.active_cascade_jobs[i]
            recorder.gauge("vllm:kv_offload_tiering_active_cascade_jobs", active, t)
            stats = tier.get_stats()
            if stats is not None:
                report_tier_stats(recorder, label, stats)
        for sample in self.take_samples():
            tier_type = tiers[sample.tier_idx].tier_type
            direction = (
                (f"{tier_type}_to_CPU",) if sample.is_promotion else (f"CPU_to_{tier_type}",)
            )
            if sample.success:
                recorder.count("vllm:kv_offload_transfer_jobs", 1, direction)
                recorder.observe(
                    "vllm:kv_offload_transfer_latency_seconds", sample.seconds, direction
                )
                size = sample.num_blocks * row_bytes
                recorder.observe("vllm:kv_offload_transfer_size_bytes", size, direction)
            else:
                recorder.count("vllm:kv_offload_transfer_failed_jobs", 1, direction)
