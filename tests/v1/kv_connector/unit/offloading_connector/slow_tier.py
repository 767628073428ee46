# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A tier made slow on purpose, and a two-pass workload over it (the load guard's test and
``benchmarks/kv_offload/bench_load_guard.py``).

``SlowTier`` is the in-memory example tier whose loads are reported only ``load_delay_s`` after
they were submitted: far slower than recomputing the blocks. ``serve_two_passes`` stores the
prompts, drops the CPU tier and the GPU prefix cache (``reset_prefix_cache``; secondary tiers
keep their data) and serves the prompts again one at a time, so every hit is in the slow tier.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typing_extensions import override

from tests.v1.kv_connector.unit.offloading_connector.utils import make_config, random_tokens
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.model_executor.models.llama_config import get_preset
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.tiering.base import JobResult, TierJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

SLOW_TIER = f"{__name__}:SlowTier"
"""The ``type`` of ``SlowTier`` in ``secondary_tiers`` (and its tier type, the guard's name)."""


class SlowTier(ExampleSecondaryTierManager):
    """The example tier, reporting each load ``load_delay_s`` after its submission."""

    def __init__(self, *args: Any, load_delay_s: float = 0.25, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._delay_s = load_delay_s
        self._loads: dict[int, float] = {}  # job id -> when it may be reported
        self._held: list[JobResult] = []

    @override
    def submit_load(self, job: TierJob) -> None:
        self._loads[job.job_id] = time.perf_counter() + self._delay_s
        super().submit_load(job)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._held.extend(super().get_finished_jobs())
        now = time.perf_counter()
        ready = [r for r in self._held if self._loads.get(r.job_id, 0.0) <= now]
        self._held = [r for r in self._held if self._loads.get(r.job_id, 0.0) > now]
        for result in ready:
            self._loads.pop(result.job_id, None)
        return ready

    @override
    def drain_jobs(self) -> None:
        """Block until every held load may be reported (the contract of ``drain_jobs``)."""
        if self._loads:
            time.sleep(max(0.0, max(self._loads.values()) - time.perf_counter()))


@dataclass
class TwoPassResult:
    """What ``serve_two_passes`` measured of its second pass.

    Attributes:
        ttfts_s: each request's time to first token, in seconds, in order.
        stats: the connector's statistics at the end (empty without offloading).
        metrics: every step's connector metrics, aggregated.
        wall_s, cpu_s: the second pass's wall time and the engine thread's CPU time.
    """

    ttfts_s: list[float]
    stats: dict[str, Any]
    metrics: OffloadingConnectorStats
    wall_s: float
    cpu_s: float


def _ttfts(engine: EngineCore, prompts: list[list[int]], tag: str) -> list[float]:
    """Serve ``prompts`` one at a time (1 output token each); each one's TTFT in seconds."""
    ttfts = []
    for i, prompt in enumerate(prompts):
        req_id = f"{tag}{i}"
        start = time.perf_counter()
        engine.add_request(req_id, prompt, max_tokens=1)
        first: float | None = None
        while engine.has_unfinished_requests() or first is None:
            for out in engine.step_or_wait():
                if out.request_id == req_id and out.new_token_ids and first is None:
                    first = time.perf_counter() - start
        ttfts.append(first)
    return ttfts


def serve_two_passes(
    tmp_path: Path,
    offload: bool,
    guard: bool = True,
    *,
    num_prompts: int = 6,
    prompt_tokens: int = 256,
    delay_s: float = 0.25,
    preset: str = "tiny",
    seed: int = 7,
    secondary_tiers: list[dict[str, Any]] | None = None,
) -> TwoPassResult:
    """Store ``num_prompts`` prompts, reset, serve them again one at a time (see the module
    docstring); ``offload=False`` runs the baseline (no connector). ``secondary_tiers``
    replaces the ``SlowTier`` of ``delay_s`` (e.g. a redis tier behind a slow link)."""
    tmp_path.mkdir(parents=True)
    metrics = OffloadingConnectorStats()
    rng = random.Random(seed)
    prompts = [random_tokens(rng, prompt_tokens) for _ in range(num_prompts)]
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": secondary_tiers or [{"type": SLOW_TIER, "load_delay_s": delay_s}],
        "load_guard": guard,
    }
    p = get_preset(preset)
    config = make_config(
        tmp_path,
        cpu_blocks=4 * num_prompts * prompt_tokens // 16 if offload else None,
        extra=extra,
        model="transformer",
        model_preset=preset,
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_size=p.head_dim,
        num_gpu_blocks=2 * prompt_tokens // 16 + 8,
        max_num_batched_tokens=max(512, prompt_tokens),
    )
    with EngineCore(config) as engine:
        engine.kv_connector_stats_sink = metrics.aggregate  # type: ignore[assignment]
        _ttfts(engine, prompts, "store")
        while engine.has_pending_work():  # the cascades to the slow tier
            engine.step_or_wait()
        engine.reset_prefix_cache()
        start, start_cpu = time.perf_counter(), time.thread_time()
        ttfts = _ttfts(engine, prompts, "hit")
        wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        return TwoPassResult(ttfts, dict(engine.connector_stats()), metrics, wall, cpu)


def serve_three_ways(
    tmp_path: Path, **kwargs: Any
) -> tuple[TwoPassResult, TwoPassResult, TwoPassResult]:
    """``serve_two_passes`` as the baseline, with the load guard and without it (in that order),
    each in its own directory under ``tmp_path``; ``kwargs`` go to every run."""
    return (
        serve_two_passes(tmp_path / "base", offload=False, **kwargs),
        serve_two_passes(tmp_path / "guard", offload=True, **kwargs),
        serve_two_passes(tmp_path / "off", offload=True, guard=False, **kwargs),
    )
