# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The load guard in a real engine (the transformer's smallest preset) with a slow tier.

Every hit of the second pass of ``slow_tier.serve_two_passes`` is in ``SlowTier``, whose loads
take ``DELAY_S``, far longer than recomputing the prompt. With the guard the first request waits
(the estimates start optimistic) and the others are computed: the TTFT median is the baseline's.
Without it every request waits.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from tests.v1.kv_connector.unit.offloading_connector.slow_tier import (
    SLOW_TIER,
    serve_three_ways,
)

# Also makes the conftest run this module in both scheduling modes (serve_two_passes builds its
# engines with it too).
from tests.v1.kv_connector.unit.offloading_connector.utils import make_config
from vllm.v1.engine.core import EngineCore

DELAY_S = 0.25
NUM_PROMPTS = 6
PROMPT_TOKENS = 256


def test_guard_recomputes_what_a_slow_tier_would_load(tmp_path: Path) -> None:
    baseline, guarded, unguarded = serve_three_ways(
        tmp_path, num_prompts=NUM_PROMPTS, prompt_tokens=PROMPT_TOKENS, delay_s=DELAY_S
    )
    stats, metrics = guarded.stats, guarded.metrics
    prefix = f"load_guard.{SLOW_TIER}."
    # The first hit waited (optimistic start), the others were computed.
    assert stats[prefix + "decisions"] == NUM_PROMPTS
    assert stats[prefix + "skipped_hits"] == NUM_PROMPTS - 1
    assert stats[prefix + "skipped_tokens"] == (NUM_PROMPTS - 1) * PROMPT_TOKENS
    assert stats[prefix + "latency_s"] + stats[prefix + "s_per_block"] * 16 >= DELAY_S / 2
    assert not any(k.startswith("load_guard.") for k in unguarded.stats)
    # The same figures as metrics, under the tier's label.
    label = (f"1:{SLOW_TIER}",)
    assert metrics.get("vllm:kv_offload_load_guard_skipped_hits", label) == NUM_PROMPTS - 1
    assert (
        metrics.get("vllm:kv_offload_load_guard_skipped_tokens", label)
        == stats[prefix + "skipped_tokens"]
    )
    assert metrics.get("vllm:kv_offload_load_guard_load_seconds_per_block", label) > 0
    assert metrics.get("vllm:kv_offload_load_guard_compute_seconds_per_token") > 0
    assert unguarded.metrics.get("vllm:kv_offload_load_guard_skipped_hits", label) is None
    # "No higher than the baseline's", within the noise of a shared machine: far below the
    # slow tier's wait, which every unguarded request pays.
    base_median = statistics.median(baseline.ttfts_s)
    guarded_median = statistics.median(guarded.ttfts_s)
    unguarded_median = statistics.median(unguarded.ttfts_s)
    assert guarded_median <= 1.5 * base_median + 0.02, (guarded_median, base_median)
    assert unguarded_median >= base_median + DELAY_S / 2, (unguarded_median, base_median)
    assert unguarded_median > guarded_median + DELAY_S / 2


def test_the_hash_stand_in_runs_without_the_guard_unless_asked(tmp_path: Path) -> None:
    """The stand-in's prefill is free: the engine turns the guard off unless the config sets
    ``load_guard`` (then it is what the config says)."""
    for extra, expected in (({}, False), ({"load_guard": True}, True)):
        with EngineCore(make_config(tmp_path, extra=extra)) as engine:
            assert engine.connector is not None
            scheduler = engine.connector.connector_scheduler  # type: ignore[attr-defined]
            assert (scheduler.load_guard is not None) is expected
            stats = engine.connector_stats()
            assert any(k.startswith("load_guard.") for k in stats) is expected
