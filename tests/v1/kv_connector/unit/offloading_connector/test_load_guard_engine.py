# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The load guard in a real engine (the transformer's smallest preset) with a slow tier.

``SlowTier`` is the in-memory example tier whose loads are reported only ``load_delay_s`` after
they were submitted: a tier made slow on purpose, far slower than recomputing the blocks. The
prompts are stored, the CPU tier and the GPU prefix cache are dropped (``reset_prefix_cache``;
secondary tiers keep their data), and the prompts are served again one at a time, so every hit
is in the slow tier. With the guard the first request waits (the estimates start optimistic) and
the others are computed: the TTFT median is the baseline's. Without it every request waits.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from typing_extensions import override

from tests.v1.kv_connector.unit.offloading_connector.utils import make_config, random_tokens
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.tiering.base import JobResult, TierJob
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

DELAY_S = 0.25
NUM_PROMPTS = 6
PROMPT_TOKENS = 256
SLOW_TIER = f"{__name__}:SlowTier"


class SlowTier(ExampleSecondaryTierManager):
    """The example tier, reporting each load ``load_delay_s`` after its submission."""

    def __init__(self, *args: Any, load_delay_s: float = DELAY_S, **kwargs: Any) -> None:
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


def _config(tmp_path: Path, offload: bool, guard: bool = True) -> Any:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": [{"type": SLOW_TIER}],
        "load_guard": guard,
    }
    return make_config(
        tmp_path,
        cpu_blocks=128 if offload else None,
        extra=extra,
        model="transformer",
        num_gpu_blocks=40,
        max_num_batched_tokens=512,
    )


def _ttfts(engine: EngineCore, prompts: list[list[int]], tag: str) -> list[float]:
    """Serve ``prompts`` one at a time (1 output token each); each one's TTFT in seconds."""
    ttfts = []
    for i, prompt in enumerate(prompts):
        req_id = f"{tag}{i}"
        start = time.perf_counter()
        engine.add_request(req_id, prompt, max_tokens=1)
        first: float | None = None
        while engine.has_unfinished_requests() or first is None:
            for out in engine.step():
                if out.request_id == req_id and out.new_token_ids and first is None:
                    first = time.perf_counter() - start
        ttfts.append(first)
    return ttfts


def _serve(
    tmp_path: Path, offload: bool, guard: bool = True
) -> tuple[float, dict[str, Any], OffloadingConnectorStats]:
    """The TTFT median of the second pass, the connector's stats and its metrics (every step's,
    aggregated)."""
    tmp_path.mkdir()
    metrics = OffloadingConnectorStats()
    rng = random.Random(7)
    prompts = [random_tokens(rng, PROMPT_TOKENS) for _ in range(NUM_PROMPTS)]
    with EngineCore(_config(tmp_path, offload, guard)) as engine:
        engine.kv_connector_stats_sink = metrics.aggregate  # type: ignore[assignment]
        _ttfts(engine, prompts, "store")
        while engine.has_pending_work():  # the cascades to the slow tier
            engine.step()
        engine.reset_prefix_cache()
        median = statistics.median(_ttfts(engine, prompts, "hit"))
        return median, dict(engine.connector_stats()), metrics


def test_guard_recomputes_what_a_slow_tier_would_load(tmp_path: Path) -> None:
    baseline, _, _ = _serve(tmp_path / "base", offload=False)
    guarded, stats, metrics = _serve(tmp_path / "guard", offload=True)
    unguarded, off_stats, off_metrics = _serve(tmp_path / "off", offload=True, guard=False)
    prefix = f"load_guard.{SLOW_TIER}."
    # The first hit waited (optimistic start), the others were computed.
    assert stats[prefix + "decisions"] == NUM_PROMPTS
    assert stats[prefix + "skipped_hits"] == NUM_PROMPTS - 1
    assert stats[prefix + "skipped_tokens"] == (NUM_PROMPTS - 1) * PROMPT_TOKENS
    assert stats[prefix + "latency_s"] + stats[prefix + "s_per_block"] * 16 >= DELAY_S / 2
    assert not any(k.startswith("load_guard.") for k in off_stats)
    # The same figures as metrics, under the tier's label.
    label = (f"1:{SLOW_TIER}",)
    assert metrics.get("vllm:kv_offload_load_guard_skipped_hits", label) == NUM_PROMPTS - 1
    assert (
        metrics.get("vllm:kv_offload_load_guard_skipped_tokens", label)
        == stats[prefix + "skipped_tokens"]
    )
    assert metrics.get("vllm:kv_offload_load_guard_load_seconds_per_block", label) > 0
    assert metrics.get("vllm:kv_offload_load_guard_compute_seconds_per_token") > 0
    assert off_metrics.get("vllm:kv_offload_load_guard_skipped_hits", label) is None
    # "No higher than the baseline's", within the noise of a shared machine: far below the
    # slow tier's wait, which every unguarded request pays.
    assert guarded <= 1.5 * baseline + 0.02, (guarded, baseline)
    assert unguarded >= baseline + DELAY_S / 2, (unguarded, baseline)
    assert unguarded > guarded + DELAY_S / 2
