# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report's judgement: did the offloaded run serve correctly, and why did it save nothing?

Owns the verdict (``judge`` for one pair of runs, ``judge_report`` for an invocation, fleet
instances included) and the plain-words explanations of a run that saved no prefill
(``no_savings_reason``) and of one that saved no time (``no_benefit_reason``, with the ratios
it judges by: ``benefit_ratios``). Pure functions of the figures in ``figures.py``; the
renderers (``text.py``, ``json_doc.py``) print what they return, so the text and the JSON never
disagree.

A new check: one ``if`` in ``judge`` that appends its reason (and clears ``served_correctly`` or
``storage_intact`` when it is about either); the text and the JSON show it with no other edit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.cli.report.figures import (
    TTFT_PARTS,
    Direction,
    Distribution,
    Report,
    RunResult,
    Tier,
    ratio,
)


@dataclass(frozen=True)
class Verdict:
    """Outcome of the correctness checks of the offloaded run.

    Attributes:
        passed: True when nothing wrong was served, no stored block was found corrupt, every
            secondary tier worked, and the KV blocks were verified (``--verify`` not ``none``).
        verified: the oracle checked KV blocks (``--verify loaded`` or ``all``); without it a run
            never passes, whatever else it shows.
        served_correctly: every block loaded from CPU or disk matched its reference, and every
            request's output equals the baseline's.
        storage_intact: no block on disk was found corrupt.
        tiers_working: no secondary tier failed every store, or every load, it was given during
            the run (a tier that did is broken: it only costs, and a PASS would hide it).
        reasons: one line per failed check.
    """

    passed: bool
    verified: bool
    served_correctly: bool
    storage_intact: bool
    reasons: tuple[str, ...]
    tiers_working: bool = True

    @property
    def status(self) -> str:
        """``PASS``, ``FAIL`` (a check failed) or ``UNVERIFIED`` (none failed, but the KV blocks
        were not checked: never a pass)."""
        if not (self.served_correctly and self.storage_intact and self.tiers_working):
            return "FAIL"
        return "PASS" if self.verified else "UNVERIFIED"


def compare_outputs(
    baseline: Mapping[str, Sequence[int]], offload: Mapping[str, Sequence[int]]
) -> list[str]:
    """Request ids whose outputs differ between the runs (or that only one run finished)."""
    ids = sorted(set(baseline) | set(offload))
    return [
        r
        for r in ids
        if r not in baseline or r not in offload or tuple(baseline[r]) != tuple(offload[r])
    ]


SECONDARY_DIRECTIONS: tuple[tuple[str, Direction, Direction], ...] = (
    ("fs", Direction.CPU_TO_FS, Direction.FS_TO_CPU),
    ("redis", Direction.CPU_TO_REDIS, Direction.REDIS_TO_CPU),
)
"""Each secondary tier's name, store direction and load direction."""


def failed_tiers(run: RunResult) -> list[str]:
    """One line per secondary tier and direction in which everything of ``run`` failed: every
    job the tier reported (where it counts jobs: ``store_jobs_failed == store_jobs > 0``), or
    every block (where it does not, or a tier failed blocks without failing their jobs); for a
    redis tier whose server never answered, one line saying so, and why."""
    lines = []
    for name, store, load in SECONDARY_DIRECTIONS:
        if name == "redis" and run.redis_down is not None:
            lines.append(
                f"the redis tier never answered ({run.redis_down}): it stored and served "
                "nothing; see its WARNING lines"
            )
            continue
        for direction, verb, done in ((store, "store", "stored"), (load, "load", "loaded")):
            t = run.transfers[direction]
            if t.jobs and t.failed_jobs == t.jobs:
                what = f"{t.failed_jobs:,} job(s)"
                if t.failed_blocks:
                    what += f", {t.failed_blocks:,} block(s)"
            elif t.failed_blocks and not t.blocks:
                what = f"{t.failed_blocks:,} block(s)"
            else:
                continue
            lines.append(
                f"the {name} tier failed every {verb} of the run ({what}, none {done}): see its "
                "WARNING lines (-v for more)"
            )
    return lines


def judge(baseline: RunResult, offload: RunResult) -> Verdict:
    """Derive the verdict of ``offload`` from its own checks and the baseline's outputs."""
    reasons: list[str] = []
    if offload.blocks_mismatched:
        reasons.append(f"{offload.blocks_mismatched} loaded block(s) differed from recomputation")
    differing = compare_outputs(baseline.outputs, offload.outputs)
    if differing:
        shown = ", ".join(differing[:5]) + (" ..." if len(differing) > 5 else "")
        reasons.append(
            f"{len(differing)} request(s) produced other outputs than the baseline: {shown}"
        )
    served_correctly = not reasons
    if offload.corrupt_blocks_detected:
        where = "on disk or in redis" if offload.redis_url is not None else "on disk"
        reasons.append(
            f"{offload.corrupt_blocks_detected} corrupt block(s) detected {where} "
            "(discarded and recomputed, never served)"
        )
    storage_intact = offload.corrupt_blocks_detected == 0
    broken = failed_tiers(offload)
    reasons += broken
    verified = offload.verify_mode != "none"
    if not verified:
        reasons.append("not verified: --verify none checked no KV block")
    return Verdict(
        passed=served_correctly and storage_intact and not broken and verified,
        verified=verified,
        served_correctly=served_correctly,
        storage_intact=storage_intact,
        reasons=tuple(reasons),
        tiers_working=not broken,
    )


def judge_report(report: Report) -> Verdict:
    """The verdict of the offloaded run (in a fleet: of every instance, and of the whole)."""
    verdict = judge(report.baseline, report.offload)
    failed = [
        (i, v) for i in report.instances if (v := judge(i.baseline, i.offload)).status == "FAIL"
    ]
    if not failed:
        return verdict
    names = ", ".join(str(i.index) for i, _ in failed)
    return Verdict(
        passed=False,
        verified=verdict.verified,
        served_correctly=verdict.served_correctly and all(v.served_correctly for _, v in failed),
        storage_intact=verdict.storage_intact and all(v.storage_intact for _, v in failed),
        reasons=(*verdict.reasons, f"instance(s) {names} failed their own verdict"),
        tiers_working=verdict.tiers_working and all(v.tiers_working for _, v in failed),
    )


def _suggest_smaller_pool(settings: Mapping[str, Any]) -> str:
    gpu_blocks = int(settings.get("gpu_blocks", 0))
    smallest = int(settings.get("min_gpu_blocks", 1))
    smaller = max(smallest, gpu_blocks // 4)
    if smaller < gpu_blocks:
        return f"try --gpu-blocks {smaller}"
    return f"try --num-clients {2 * int(settings.get('num_clients', 1))}"


def no_savings_reason(report: Report) -> str | None:
    """Why the offloaded run computed no fewer prompt tokens than the baseline, or None.

    Told from the run's own figures, from the likeliest cause to the least likely: nothing was
    offloaded; offloaded blocks were never asked for again (the GPU prefix cache held the working
    set); or the tiers served, but the baseline's GPU prefix cache happened to serve more.
    """
    if report.prefill_tokens_saved > 0:
        return None
    b, o = report.baseline, report.offload
    from_tiers = o.served[Tier.CPU] + o.served[Tier.FS] + o.served[Tier.REDIS]
    if o.transfers[Direction.GPU_TO_CPU].blocks == 0:
        block = report.settings.get("offload_block_size")
        return (
            f"nothing was offloaded: no request filled a whole offloaded block of {block} tokens "
            "(try a smaller --offload-block-size or longer prompts)"
        )
    if from_tiers == 0:
        return (
            "the GPU prefix cache held the whole working set, so no request needed a block "
            f"after it was evicted: {_suggest_smaller_pool(report.settings)}"
        )
    return (
        f"the {'CPU, fs and redis' if o.redis_url else 'CPU and fs'} tiers served "
        f"{from_tiers:,} tokens, but the baseline's GPU prefix cache "
        f"served {b.served[Tier.GPU]:,} to this run's {o.served[Tier.GPU]:,} (the two runs "
        "interleave requests differently)"
    )


_PART_WORDS = {
    "slot": "waiting for a slot",
    "lookup": "waiting on the tiers (lookups, promotions into the CPU tier)",
    "loading": "loading into the GPU (CPU -> GPU copies)",
    "prefill": "prefill to the first token",
}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def benefit_ratios(report: Report) -> dict[str, float | None]:
    """The offload run's figures over the baseline's: ``wall_time_ratio`` (timed windows),
    ``ttft_median_ratio``, ``ttft_p99_ratio``, ``throughput_ratio`` (requests per second);
    None where the baseline's figure is 0."""
    b, o = report.baseline, report.offload
    bt, ot = Distribution.of(b.ttft_ms), Distribution.of(o.ttft_ms)
    return {
        "wall_time_ratio": ratio(o.wall_s, b.wall_s),
        "ttft_median_ratio": ratio(ot.median, bt.median),
        "ttft_p99_ratio": ratio(ot.p99, bt.p99),
        "throughput_ratio": ratio(o.requests_per_s, b.requests_per_s),
    }


_NOTABLE_SHARE = 0.05
"""A change in the engine thread's waits is named when it exceeds this share of the baseline's
wall time."""


def _engine_thread_notes(b: RunResult, o: RunResult) -> list[str]:
    """The engine thread's waits that grew notably from the baseline (``_NOTABLE_SHARE``):
    asleep inside its steps (the GIL, a lock, I/O) and waiting for a core."""
    grew = []
    threshold = _NOTABLE_SHARE * b.wall_s
    for what, base_s, off_s in (
        (
            "was blocked inside its steps for {off:.2f} s against the baseline's {base:.2f} s "
            "(on the GIL while another thread held it, a lock or I/O)",
            b.engine_thread_blocked_s,
            o.engine_thread_blocked_s,
        ),
        (
            "waited {off:.2f} s for a core against the baseline's {base:.2f} s",
            b.engine_thread_runqueue_wait_s,
            o.engine_thread_runqueue_wait_s,
        ),
    ):
        if base_s is not None and off_s is not None and off_s - base_s > threshold:
            grew.append(what.format(off=off_s, base=base_s))
    return [f"the offload run's engine thread {' and '.join(grew)}"] if grew else []


def no_benefit_reason(report: Report) -> str | None:
    """Why the offloaded run's TTFT median or wall time was no better than the baseline's, in
    plain words naming the measured cause; None when both were better.

    The cause is the part of TTFT (``TTFT_PARTS``, means per request) that grew most from the
    baseline to the offloaded run, set against the prefill time it saved; a run that saved no
    prefill says so, and so are the engine thread's waits that grew (``_engine_thread_notes``)
    and a machine busier than its CPUs (load average).
    """
    ratios = benefit_ratios(report)
    worse = [
        f"{what} {r:.2f}x the baseline's"
        for what, r in (
            ("TTFT median", ratios["ttft_median_ratio"]),
            ("wall time", ratios["wall_time_ratio"]),
        )
        if r is not None and r >= 1.0
    ]
    if not worse:
        return None
    b, o = report.baseline, report.offload
    means = {
        name: (_mean(b.ttft_parts_ms.get(name, ())), _mean(o.ttft_parts_ms.get(name, ())))
        for name in TTFT_PARTS
    }
    grew, (base_ms, off_ms) = max(means.items(), key=lambda kv: kv[1][1] - kv[1][0])
    saved_ms = means["prefill"][0] - means["prefill"][1]
    if report.prefill_tokens_saved <= 0:
        cause = "it computed no fewer prompt tokens than the baseline (see why above)"
    elif off_ms <= base_ms:
        cause = (
            "no part of TTFT the engine measured grew, so the time went outside the engine's "
            "steps (the front end, or other processes on the machine)"
        )
    elif grew == "prefill":
        cause = (
            f"prefill to the first token took {off_ms:.1f} ms per request against the "
            f"baseline's {base_ms:.1f} ms although {report.prefill_tokens_saved:,} fewer prompt "
            f"tokens were computed: the offload run's steps were slower (its engine thread used "
            f"{o.engine_thread_cpu_s:.1f} s of CPU against {b.engine_thread_cpu_s:.1f} s)"
        )
    else:
        base_prefill, off_prefill = means["prefill"]
        saved = (
            f"more than the {saved_ms:.1f} ms of prefill per request that the tiers saved"
            if saved_ms > 0
            else f"and prefill to the first token was no shorter ({off_prefill:.1f} ms against "
            f"{base_prefill:.1f} ms)"
        )
        cause = (
            f"{_PART_WORDS[grew]} took {off_ms:.1f} ms per request on average against the "
            f"baseline's {base_ms:.1f} ms, {saved}"
        )
    notes = _engine_thread_notes(b, o)
    if report.settings.get("model") == "hash":
        notes.append(
            "the hash stand-in computes almost for free, so saved prefill saves little time"
        )
    if report.load_average is not None:
        cpus = os.cpu_count() or 1
        load = max(report.load_average)
        if load > cpus:
            notes.append(f"the machine was busy (load average up to {load:.2f} on {cpus} CPUs)")
    return f"{' and '.join(worse)}: {cause}" + "".join(f"; {n}" for n in notes)
