# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``OffloadingSpecFactory``: selection by ``spec_name`` and ``spec_module_path``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

from tests.v1.kv_offload.utils import make_run_info
from vllm.v1.kv_offload.base import OffloadingManager, ReqContext, make_offload_key
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec, cpu_worker_handlers
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec, WorkerHandlers
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches

RUN = make_run_info(4096, instance_id="spec-factory")


class PlainCustomSpec(OffloadingSpec):
    """An out-of-tree spec whose constructor does not take enable_events."""

    @override
    def get_manager(self) -> OffloadingManager:
        return CPUOffloadingManager(self.num_primary_blocks)

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        return cpu_worker_handlers(self, kv_caches, rank)


class EventsCustomSpec(PlainCustomSpec):
    def __init__(self, config: OffloadingConfig, run: KVCacheRunInfo, **kwargs: Any) -> None:
        super().__init__(config, run)
        self.kwargs = kwargs


class NotASpec:
    pass


def config(**extra: Any) -> OffloadingConfig:
    return OffloadingConfig.from_extra_config({"cpu_bytes_to_use": 4 * 4096, **extra})


def test_default_is_cpu_spec() -> None:
    spec = OffloadingSpecFactory.create_spec(config(), RUN)
    assert type(spec) is CPUOffloadingSpec
    manager = spec.get_manager()
    assert type(manager) is CPUOffloadingManager
    assert manager.num_blocks == 4


def test_enable_events_reaches_the_manager() -> None:
    spec = OffloadingSpecFactory.create_spec(config(), RUN, enable_events=True)
    assert isinstance(spec, CPUOffloadingSpec) and spec.enable_events
    quiet = OffloadingSpecFactory.create_spec(config(), RUN)
    key = make_offload_key(b"\x01" * 32, 0)
    for s, events in ((spec, 1), (quiet, 0)):
        manager, ctx = s.get_manager(), ReqContext("r")
        manager.on_new_request(ctx)
        output = manager.prepare_store([key], ctx)
        assert output is not None
        manager.complete_store(output.keys_to_store, ctx)
        assert len(list(manager.take_events())) == events  # the stored block, if recorded


def test_tiering_spec_by_name(tmp_path: Path) -> None:
    spec = OffloadingSpecFactory.create_spec(
        config(spec_name="TieringOffloadingSpec", shared_region_dir=str(tmp_path)), RUN
    )
    assert type(spec) is TieringOffloadingSpec
    manager = spec.get_manager()
    try:
        assert isinstance(manager, TieringOffloadingManager)
    finally:
        manager.shutdown()


def test_spec_module_path() -> None:
    spec = OffloadingSpecFactory.create_spec(
        config(spec_name="PlainCustomSpec", spec_module_path=__name__), RUN
    )
    assert type(spec) is PlainCustomSpec


def test_enable_events_only_passed_when_accepted(caplog: pytest.LogCaptureFixture) -> None:
    spec = OffloadingSpecFactory.create_spec(
        config(spec_name="EventsCustomSpec", spec_module_path=__name__), RUN, enable_events=True
    )
    assert isinstance(spec, EventsCustomSpec) and spec.kwargs == {"enable_events": True}
    OffloadingSpecFactory.create_spec(
        config(spec_name="PlainCustomSpec", spec_module_path=__name__), RUN, enable_events=True
    )
    assert "does not take enable_events" in caplog.text


def test_bad_module_specs() -> None:
    with pytest.raises(ValueError, match="has no offloading spec 'Missing'"):
        OffloadingSpecFactory.create_spec(
            config(spec_name="Missing", spec_module_path=__name__), RUN
        )
    with pytest.raises(ValueError, match="not a subclass of OffloadingSpec"):
        OffloadingSpecFactory.create_spec(
            config(spec_name="NotASpec", spec_module_path=__name__), RUN
        )
    with pytest.raises(ModuleNotFoundError):
        OffloadingSpecFactory.create_spec(
            config(spec_name="X", spec_module_path="no_such_module_abc"), RUN
        )


def test_unregistered_name_without_module_path() -> None:
    cfg = config()
    object.__setattr__(cfg, "spec_name", "GhostSpec")  # bypass the config's own check
    with pytest.raises(ValueError, match=r"unknown offloading spec 'GhostSpec'.*CPUOffloadingSpec"):
        OffloadingSpecFactory.get_spec_class(cfg)


def test_register_spec_rejects_duplicates() -> None:
    with pytest.raises(ValueError, match="already registered"):
        OffloadingSpecFactory.register_spec("CPUOffloadingSpec", "x", "Y")
