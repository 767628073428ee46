# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The load guard with a real redis-server behind a slow loopback link (``ThrottledProxy``).

Every hit of the second pass of ``slow_tier.serve_two_passes`` is in the redis tier, whose
values come back at 128 KiB/s (a prompt's 8 values in about half a second) while a lookup's
reply passes in a few ms. With the guard the first request waits (optimistic start) and the
others are computed; without it every request waits for its values. One scheduling mode only
(``test_load_guard_engine.py`` covers both): a real server makes each run slower.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.offloading_connector.slow_tier import serve_three_ways
from tests.v1.kv_connector.unit.offloading_connector.throttled_proxy import ThrottledProxy
from tests.v1.kv_offload.tiering.redis.servers import RedisServer

NUM_PROMPTS = 3
PROMPT_TOKENS = 128


@pytest.fixture
def slow_redis(tmp_path: Path) -> Iterator[str]:
    """The URL of a real redis-server behind a link of 128 KiB/s back to the client."""
    server = RedisServer(tmp_path / "redis")
    proxy = ThrottledProxy(server.port, reply_bytes_per_s=128 * 1024)
    try:
        yield proxy.url
    finally:
        proxy.stop()
        server.stop()


def test_guard_recomputes_what_redis_behind_a_slow_link_would_load(
    tmp_path: Path, slow_redis: str
) -> None:
    tiers = [{"type": "redis", "url": slow_redis, "timeout_s": 10.0}]
    baseline, guarded, unguarded = serve_three_ways(
        tmp_path, num_prompts=NUM_PROMPTS, prompt_tokens=PROMPT_TOKENS, secondary_tiers=tiers
    )
    stats = guarded.stats
    assert stats["load_guard.redis.decisions"] == NUM_PROMPTS
    assert stats["load_guard.redis.skipped_hits"] == NUM_PROMPTS - 1  # the first one loaded
    assert stats["load_guard.redis.skipped_tokens"] == (NUM_PROMPTS - 1) * PROMPT_TOKENS
    base_median = statistics.median(baseline.ttfts_s)
    guarded_median = statistics.median(guarded.ttfts_s)
    unguarded_median = statistics.median(unguarded.ttfts_s)
    # The lookups still cross the link (a step each): a few ms above the baseline at most.
    assert guarded_median <= 1.5 * base_median + 0.05, (guarded_median, base_median)
    assert unguarded_median >= base_median + 0.25, (unguarded_median, base_median)
