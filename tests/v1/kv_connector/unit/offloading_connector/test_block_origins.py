# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Served tokens attributed to the tier they were promoted from, and to who stored the block.

Two engines over one fs root play two instances sharing a tier: what the first computed and
stored, the second (a fresh CPU tier) gets promoted from the fs tier. The second engine's stats
say which tier served those tokens, that every such block went through the bit-exact check,
and, with ``record_block_origins``, that it had not stored them itself (the fleet's
cross-instance reuse is built on this).
"""

from __future__ import annotations

import random
from pathlib import Path

from tests.v1.kv_connector.unit.offloading_connector.utils import make_config
from vllm.v1.engine.core import EngineCore


def test_promoted_tokens_are_attributed_to_their_tier_and_origin(tmp_path: Path) -> None:
    prompt = [random.Random(3).randrange(1, 1000) for _ in range(160)]  # 10 blocks
    config = make_config(tmp_path, cpu_blocks=20, fs=True, record_block_origins=True)
    with EngineCore(config) as first:
        expected = first.generate({"first": prompt}, 3)["first"]  # until its cascades finish
        assert first.connector is not None
        stored_by_first = set(first.connector.connector_scheduler.stored_keys or ())
        assert len(stored_by_first) >= 9
        assert first.stats.served_not_stored_here == {}

    config = make_config(tmp_path, cpu_blocks=20, fs=True, record_block_origins=True)
    with EngineCore(config) as second:
        assert second.wait_for_tiers_ready(30)  # the fs tier found the first engine's files
        assert second.generate({"second": prompt}, 3)["second"] == expected
        stats = second.stats
        assert stats.tokens_from_secondary > 0
        assert stats.tokens_from_tier == {"fs": stats.tokens_from_secondary}
        assert stats.blocks_verified_by_tier["fs"] > 0
        assert stats.verification_failures == 0
        served = stats.served_not_stored_here
        assert served is not None
        assert sum(served.values()) == stats.tokens_from_secondary
        assert {tier for tier, _ in served} == {"fs"}
        assert {key for _, key in served} <= stored_by_first


def test_without_record_block_origins_nothing_is_tracked(tmp_path: Path) -> None:
    prompt = [random.Random(4).randrange(1, 1000) for _ in range(64)]
    with EngineCore(make_config(tmp_path, cpu_blocks=20, fs=True)) as engine:
        engine.generate({"r": prompt}, 3)
        assert engine.connector is not None
        assert engine.connector.connector_scheduler.stored_keys is None
        assert engine.stats.served_not_stored_here is None
