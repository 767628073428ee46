# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tier reports: ``SecondaryTierManager.get_stats`` / ``wait_until_ready`` and the spec, connector
and engine accessors over them (``get_tier_stats``, ``wait_for_tiers_ready``, ``tier_stats``)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tests.v1.kv_connector.unit.offloading_connector.utils import make_config, random_tokens
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.base import TierStats
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager


def _tiers(engine: EngineCore) -> tuple[Any, ...]:
    assert engine.connector is not None
    manager = engine.connector.connector_scheduler.manager
    assert isinstance(manager, TieringOffloadingManager)
    return manager.secondary_tiers


def test_fs_and_example_tiers_behind_the_accessors(tmp_path: Path) -> None:
    """The fs tier reports its index and counters; the example tier keeps the defaults (no
    report, nothing to wait for) and is left out of ``tier_stats``."""
    config = make_config(
        tmp_path,
        fs=True,
        extra={
            "secondary_tiers": [
                {"type": "example"},
                {"type": "fs", "root_dir": str(tmp_path / "fs")},
            ]
        },
    )
    with EngineCore(config) as engine:
        example, fs = _tiers(engine)
        assert isinstance(fs, FileSystemSecondaryTier)
        assert example.get_stats() is None and example.wait_until_ready(0) is True
        assert engine.wait_for_tiers_ready(30)
        (empty,) = engine.tier_stats()
        assert empty == TierStats("fs", 0, 0, fs.block_file_size, empty.counters)
        assert empty.counters.get("blocks_written", 0) == 0

        engine.generate({"a": random_tokens(random.Random(1), 100)}, max_tokens=2)
        engine.run_until_done()  # every cascade to the fs tier finished
        (report,) = engine.tier_stats()
        assert report.tier_type == "fs"
        assert report.num_blocks == report.counters["blocks_written"] == 6
        assert report.used_bytes == 6 * report.block_bytes
        assert report.block_bytes == fs.block_file_size
        assert report == fs.get_stats()
        assert isinstance(engine.connector, OffloadingConnector)
        assert engine.connector.get_tier_stats() == engine.connector.spec.get_tier_stats()
        assert engine.connector.get_tier_stats() == [report]


def test_no_secondary_tier_means_no_report(tmp_path: Path) -> None:
    for config in (make_config(tmp_path), make_config(tmp_path, cpu_blocks=None)):
        with EngineCore(config) as engine:
            assert engine.tier_stats() == []
            assert engine.wait_for_tiers_ready(0) is True
