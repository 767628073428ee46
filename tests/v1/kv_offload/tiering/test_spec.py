# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``TieringOffloadingSpec``: building the primary and tiers, and undoing on failure."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typing_extensions import override

from tests.v1.kv_offload import utils
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.shared_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

# Records (tier name, event) for the tracking tiers below (tests run sequentially).
EVENTS: list[tuple[str, str]] = []


class TrackingTier(ExampleSecondaryTierManager):
    def __init__(self, *args: Any, name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = name
        EVENTS.append((name, "created"))

    @override
    def shutdown(self) -> None:
        EVENTS.append((self.name, "shutdown"))
        super().shutdown()


class FailingTier(ExampleSecondaryTierManager):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        raise OSError("tier cannot start")


TRACKING = f"{__name__}:TrackingTier"
FAILING = f"{__name__}:FailingTier"
CTX = ReqContext(req_id="r")


def make_tiering_spec(
    tmp_path: Path, tiers: Iterable[dict[str, Any]], num_blocks: int = 4, world_size: int = 1
) -> TieringOffloadingSpec:
    return utils.make_tiering_spec(
        tmp_path,
        num_blocks,
        gpu_kv_bytes_per_block=256,
        secondary_tiers=tiers,
        enable_events=True,
        tensor_parallel_size=world_size,
        instance_id="spec-test",
    )


def region_files(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path))


def test_builds_primary_and_tiers_in_order(tmp_path: Path) -> None:
    EVENTS.clear()
    spec = make_tiering_spec(
        tmp_path,
        [{"type": TRACKING, "name": "a"}, {"type": "example"}, {"type": TRACKING, "name": "b"}],
    )
    manager = spec.get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager)
        assert spec.get_manager() is manager  # cached
        assert [type(t) for t in manager.secondary_tiers] == [
            TrackingTier,
            ExampleSecondaryTierManager,
            TrackingTier,
        ]
        assert EVENTS == [("a", "created"), ("b", "created")]
        assert manager.primary_tier.num_blocks == spec.num_primary_blocks == 4
        view = manager.primary_tier.get_kv_memoryview()
        assert view.shape == (4, spec.row_bytes)
        # The scheduler-side region is named after the instance id, in shared_region_dir.
        assert region_files(tmp_path) == [
            os.path.basename(SharedOffloadRegion.region_path("spec-test"))
        ]
    finally:
        manager.shutdown()
    assert EVENTS[2:] == [("a", "shutdown"), ("b", "shutdown")]
    assert region_files(tmp_path) == []


def test_row_geometry_spans_every_worker(tmp_path: Path) -> None:
    spec = make_tiering_spec(tmp_path, [], num_blocks=3, world_size=2)
    assert spec.row_bytes == SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT  # 2 x 256 bytes, padded
    manager = spec.get_manager()
    try:
        assert manager.primary_tier.get_kv_memoryview().shape == (3, spec.row_bytes)
    finally:
        manager.shutdown()


def test_tier_start_failure_undoes_everything(tmp_path: Path) -> None:
    EVENTS.clear()
    spec = make_tiering_spec(
        tmp_path,
        [{"type": TRACKING, "name": "a"}, {"type": TRACKING, "name": "b"}, {"type": FAILING}],
    )
    with pytest.raises(OSError, match="tier cannot start"):
        spec.get_manager()
    # Created tiers are shut down in reverse order, then the primary (its region file is gone).
    assert EVENTS == [("a", "created"), ("b", "created"), ("b", "shutdown"), ("a", "shutdown")]
    assert region_files(tmp_path) == []
    # Nothing was cached: a fixed config can be retried in the same directory.
    with pytest.raises(OSError):
        spec.get_manager()


def test_bad_tier_config_undoes_everything(tmp_path: Path) -> None:
    EVENTS.clear()
    spec = make_tiering_spec(tmp_path, [{"type": TRACKING, "name": "a"}, {"type": "nope"}])
    with pytest.raises(ValueError, match="unknown secondary tier type 'nope'"):
        spec.get_manager()
    assert EVENTS == [("a", "created"), ("a", "shutdown")]
    assert region_files(tmp_path) == []


def test_end_to_end_cascade_and_promotion(tmp_path: Path) -> None:
    spec = make_tiering_spec(tmp_path, [{"type": "example"}])
    manager = spec.get_manager()
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    try:
        key = make_offload_key(b"block", 0)
        output = manager.prepare_store([key], CTX)
        assert output is not None and isinstance(output.store_spec, CPULoadStoreSpec)
        rows[output.store_spec.block_ids[0]] = 42
        manager.complete_store([key], CTX)
        events = list(manager.take_events())
        # Events enabled: the primary's, then the tier's (it stores synchronously).
        assert [(e.medium, e.removed) for e in events] == [("CPU", False), ("EXAMPLE", False)]
        manager.reset_cache()  # the tier keeps the block
        rows[:] = 0
        assert manager.lookup(key, CTX) is None
        manager.on_schedule_end()
        manager.on_schedule_end()
        assert manager.lookup(key, CTX) is True
        spec_out = manager.prepare_load([key], CTX)
        assert isinstance(spec_out, CPULoadStoreSpec)
        assert (rows[spec_out.block_ids[0]] == 42).all()
        manager.complete_load([key], CTX)
    finally:
        del rows
        manager.shutdown()


def test_is_selected_by_spec_name(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = make_tiering_spec(tmp_path, [])
    assert OffloadingSpecFactory.get_spec_class(spec.config) is TieringOffloadingSpec
    assert isinstance(spec, TieringOffloadingSpec)
    assert not isinstance(spec.get_manager(), SecondaryTierManager)
    spec.get_manager().shutdown()


class PlainTier(ExampleSecondaryTierManager):
    """A tier whose constructor has no ``enable_events`` keyword."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)


def test_enable_events_reaches_tiers_that_take_it(tmp_path: Path) -> None:
    spec = make_tiering_spec(
        tmp_path,
        [
            {"type": "example"},
            {"type": "example", "enable_events": False},
            {"type": f"{__name__}:PlainTier"},
        ],
    )
    manager = spec.get_manager()
    try:
        keys = [make_offload_key(b"ev", 0)]
        assert manager.prepare_store(keys, CTX) is not None
        manager.complete_store(keys, CTX)
        manager.on_schedule_end()
        manager.on_schedule_end()
        media = [(event.medium, event.removed) for event in manager.take_events()]
        # The primary and the first tier record; the tier configured off and the tier that
        # takes no such keyword do not.
        assert media == [("CPU", False), ("EXAMPLE", False)]
    finally:
        manager.shutdown()
