# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report's judgement: did the offloaded run serve correctly, and why did it save nothing?

Owns the verdict (``judge`` for one pair of runs, ``judge_report`` for an invocation, fleet
instances included) and the plain-words explanation of a run that saved no prefill
(``no_savings_reason``). Pure functions of the figures in ``figures.py``; the renderers
(``text.py``, ``json_doc.py``) print what they return, so the text and the JSON never disagree.

A new check: one ``if`` in ``judge`` that appends its reason (and clears ``served_correctly`` or
``storage_intact`` when it is about either); the text and the JSON show it with no other edit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.entrypoints.cli.report.figures import Direction, Report, RunResult, Tier


@dataclass(frozen=True)
class Verdict:
    """Outcome of the correctness checks of the offloaded run.

    Attributes:
        passed: True when nothing wrong was served, no stored block was found corrupt and every
            secondary tier worked.
        served_correctly: every block loaded from CPU or disk matched recomputation, and every
            request's output equals the baseline's.
        storage_intact: no block on disk was found corrupt.
        tiers_working: no secondary tier failed every store, or every load, it was given during
            the run (a tier that did is broken: it only costs, and a PASS would hide it).
        reasons: one line per failed check.
    """

    passed: bool
    served_correctly: bool
    storage_intact: bool
    reasons: tuple[str, ...]
    tiers_working: bool = True


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
    """One line per secondary tier and direction in which every block of ``run`` failed."""
    lines = []
    for name, store, load in SECONDARY_DIRECTIONS:
        for direction, verb, done in ((store, "store", "stored"), (load, "load", "loaded")):
            t = run.transfers[direction]
            if t.failed_blocks and not t.blocks:
                lines.append(
                    f"the {name} tier failed every {verb} of the run ({t.failed_blocks:,} "
                    f"block(s), none {done}): see its WARNING lines (-v for more)"
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
    return Verdict(
        passed=served_correctly and storage_intact and not broken,
        served_correctly=served_correctly,
        storage_intact=storage_intact,
        reasons=tuple(reasons),
        tiers_working=not broken,
    )


def judge_report(report: Report) -> Verdict:
    """The verdict of the offloaded run (in a fleet: of every instance, and of the whole)."""
    verdict = judge(report.baseline, report.offload)
    failed = [(i, v) for i in report.instances if not (v := judge(i.baseline, i.offload)).passed]
    if not failed:
        return verdict
    names = ", ".join(str(i.index) for i, _ in failed)
    return Verdict(
        passed=False,
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
