# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report as a JSON document (``--json``): the same figures as the text, for programs.

Owns the document's layout, documented in ``docs/cli.md`` and versioned by ``SCHEMA_VERSION``:
``report_json`` builds it from a ``Report`` (the figures of ``figures.py``, the verdict and the
no-savings reason of ``verdict.py``). A new key is one line in the function that builds its
object (``run_json`` for a run's figures, ``report_json`` for the comparison); adding keys keeps
the schema version, renaming or removing one bumps it.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.entrypoints.cli.report.figures import (
    TTFT_PARTS,
    Direction,
    Distribution,
    FsTierState,
    InstanceResult,
    PolicyRun,
    Report,
    RoutingFigures,
    RunResult,
    StepSample,
    Tier,
    TransferFigures,
)
from vllm.entrypoints.cli.report.verdict import (
    Verdict,
    benefit_ratios,
    compare_outputs,
    judge,
    judge_report,
    no_benefit_reason,
    no_savings_reason,
)

SCHEMA_VERSION = 1
"""Bumped whenever a JSON field is renamed or removed (adding fields keeps the version)."""


def distribution_json(d: Distribution) -> dict[str, Any]:
    """The JSON object of a summary (count, median, p99, mean, max)."""
    return {"count": d.count, "median": d.median, "p99": d.p99, "mean": d.mean, "max": d.max}


def transfer_json(t: TransferFigures, wall_s: float) -> dict[str, Any]:
    """The JSON object of one direction; ``average_bytes_per_s`` spreads the bytes over the run."""
    return {
        "blocks": t.blocks,
        "bytes": t.bytes,
        "busy_s": t.busy_s,
        "failed_blocks": t.failed_blocks,
        "skipped_blocks": t.skipped_blocks,
        "jobs": t.jobs,
        "failed_jobs": t.failed_jobs,
        "served_bytes": t.served_bytes,
        "throughput_bytes_per_s": t.throughput(),
        "average_bytes_per_s": t.bytes / wall_s if wall_s > 0 else 0.0,
    }


def sample_json(s: StepSample) -> dict[str, Any]:
    """The JSON object of one step's sample."""
    return {"t_s": round(s.t_s, 4), "tokens": dict(s.tokens), "bytes_moved": dict(s.bytes_moved)}


def fs_json(fs: FsTierState) -> dict[str, Any]:
    """The JSON object of the fs tier's state before and after a run."""
    return {
        "root_dir": fs.root_dir,
        "max_bytes": fs.max_bytes,
        "warm_start": fs.warm,
        "files_at_start": fs.files_at_start,
        "bytes_at_start": fs.bytes_at_start,
        "files_at_end": fs.files_at_end,
        "bytes_at_end": fs.bytes_at_end,
    }


# The load guard's tier names (``load_guard.CPU_TIER``, the secondary tiers' types) in the
# report's tier keys.
_GUARD_TIERS = {"CPU": Tier.CPU, "fs": Tier.FS, "redis": Tier.REDIS}


def load_guard_json(run: RunResult) -> dict[str, Any] | None:
    """The JSON object of the load guard's figures in a run (None: the guard was off).

    ``tiers`` has an entry per tier the guard decided on or measured, under the report's tier
    keys (``cpu_tier``, ``fs_tier``, ``redis_tier``); the estimates are absent before their
    first sample.
    """
    g = run.load_guard
    if g is None:
        return None
    tiers: dict[str, dict[str, Any]] = {}
    for name, tier in _GUARD_TIERS.items():
        if f"{name}.decisions" not in g and f"{name}.s_per_block" not in g:
            continue
        entry: dict[str, Any] = {
            "guard_decisions": g.get(f"{name}.decisions", 0),
            "guard_skipped_hits": g.get(f"{name}.skipped_hits", 0),
            "guard_skipped_tokens": g.get(f"{name}.skipped_tokens", 0),
            "guard_probes": g.get(f"{name}.probes", 0),
        }
        if f"{name}.s_per_block" in g:
            entry["load_latency_s"] = g[f"{name}.latency_s"]
            entry["load_s_per_block"] = g[f"{name}.s_per_block"]
        tiers[tier.value] = entry
    return {
        "enabled": True,
        "compute_s_per_token": g.get("compute_s_per_token"),
        "step_overhead_s": g.get("step_overhead_s"),
        "tiers": tiers,
    }


def run_json(run: RunResult, samples: bool = True) -> dict[str, Any]:
    """The JSON object of one run (without ``samples`` when False: a fleet instance's)."""
    doc: dict[str, Any] = {
        "label": run.label,
        "offload": run.offload,
        "wall_s": run.wall_s,
        "verify_s": run.verify_s,
        "engine_thread_cpu_s": run.engine_thread_cpu_s,
        "engine_thread_idle_s": run.engine_thread_idle_s,
        "engine_thread_runqueue_wait_s": run.engine_thread_runqueue_wait_s,
        "engine_thread_blocked_s": run.engine_thread_blocked_s,
        "cpu_s_by_component": dict(run.cpu_s_by_component),
        "verify_cpu_s": run.verify_cpu_s,
        "requests_per_s": run.requests_per_s,
        "prompt_tokens_per_s": run.prompt_tokens_per_s,
        "outputs_digest": run.outputs_digest,
        "requests": {"submitted": run.num_requests, "finished": run.num_finished},
        "prompt_tokens": {
            "total": run.prompt_tokens,
            "computed": run.computed_tokens,
            **{t.value: run.served[t] for t in Tier},
        },
        "hit_rate": {t.value: run.hit_rate(t) for t in Tier},
        "share": {"computed": run.share(None), **{t.value: run.share(t) for t in Tier}},
        "output_tokens": run.output_tokens,
        "steps": run.steps,
        "preemptions": run.preemptions,
        "overhead_us_per_step": distribution_json(Distribution.of(run.overhead_us)),
        "worker_overhead_us_per_step": distribution_json(Distribution.of(run.worker_overhead_us)),
        "ttft_ms": distribution_json(Distribution.of(run.ttft_ms)),
        "ttft_parts_ms": {
            name: distribution_json(Distribution.of(run.ttft_parts_ms.get(name, [])))
            for name in TTFT_PARTS
        },
        "latency_ms": distribution_json(Distribution.of(run.latency_ms)),
        "transfers": {d.value: transfer_json(run.transfers[d], run.wall_s) for d in Direction},
        "verification": {
            "mode": run.verify_mode,
            "blocks_verified": run.blocks_verified,
            "blocks_checked": run.blocks_checked,
            "blocks_mismatched": run.blocks_mismatched,
            "corrupt_blocks_detected": run.corrupt_blocks_detected,
            "failed_loads": run.failed_loads,
            "blocks_verified_from_redis": run.blocks_verified_from_redis,
        },
        "fs_tier": None if run.fs is None else fs_json(run.fs),
        "redis_url": run.redis_url,
        "redis_down": run.redis_down,
        "cross_instance_tokens": run.cross_instance_tokens,
        "load_guard": load_guard_json(run),
    }
    if run.offload:
        for key, values in (
            ("connector_thread_cpu_us", run.connector_thread_cpu_us),
            ("worker_connector_thread_cpu_us", run.worker_connector_thread_cpu_us),
        ):
            d = Distribution.of(values)
            doc[key] = {"median": d.median, "p99": d.p99}
        doc["lookup_deferred_requests"] = run.lookup_deferred_requests
        doc["transfer_wait_requests"] = run.transfer_wait_requests
        doc["lookup_deferred_requests_by_tier"] = dict(run.lookup_deferred_requests_by_tier)
    if samples:
        doc["samples"] = [sample_json(s) for s in run.samples]
    return doc


def verdict_json(v: Verdict) -> dict[str, Any]:
    """The JSON object of a verdict."""
    return {
        "status": v.status,
        "verified": v.verified,
        "served_correctly": v.served_correctly,
        "storage_intact": v.storage_intact,
        "tiers_working": v.tiers_working,
        "reasons": list(v.reasons),
    }


def instance_json(inst: InstanceResult) -> dict[str, Any]:
    """The JSON object of a fleet instance (its runs' figures, without samples, and verdict)."""
    return {
        "index": inst.index,
        "runs": {r.label: run_json(r, samples=False) for r in (inst.baseline, inst.offload)},
        "verdict": verdict_json(judge(inst.baseline, inst.offload)),
    }


def report_json(report: Report) -> dict[str, Any]:
    """The JSON document of the report."""
    b, o = report.baseline, report.offload
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": report.settings,
        "runs": {"baseline": run_json(b), "offload": run_json(o)},
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_start": report.load_average[0] if report.load_average else None,
            "load_average_end": report.load_average[1] if report.load_average else None,
        },
        "comparison": {
            "prefill_tokens_saved": report.prefill_tokens_saved,
            "prefill_tokens_saved_fraction": report.prefill_tokens_saved_fraction,
            **benefit_ratios(report),
            "outputs_identical": not compare_outputs(b.outputs, o.outputs),
            "no_savings_reason": no_savings_reason(report),
            "no_benefit_reason": no_benefit_reason(report),
        },
        "verdict": verdict_json(judge_report(report)),
        "fleet": (
            {
                "engines": len(report.instances),
                "router": report.routing.policy if report.routing else None,
                "routing": routing_json(report.routing) if report.routing else None,
                "instances": [instance_json(i) for i in report.instances],
                "routing_comparison": [policy_run_json(p) for p in report.policy_runs] or None,
            }
            if report.instances
            else None
        ),
        "kv_events": report.kv_events,
    }


def routing_json(r: RoutingFigures) -> dict[str, Any]:
    """The JSON object of how a run was routed (``policy`` and per-instance ``requests``)."""
    return {
        "policy": r.policy,
        "requests": list(r.requests),
        "expected_cached_tokens": dict(r.expected_cached_tokens),
        "expected_computed_tokens": r.expected_computed_tokens,
        "guard_exclusions": r.guard_exclusions,
        "measured_costs": list(r.measured_costs),
        "events": r.events,
    }


def policy_run_json(p: PolicyRun) -> dict[str, Any]:
    """One policy's offloaded run of ``--compare-routing`` (its figures and its routing)."""
    return {"routing": routing_json(p.routing), "run": run_json(p.result, samples=False)}
