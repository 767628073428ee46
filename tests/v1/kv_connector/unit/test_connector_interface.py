# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine knows a connector only through ``KVConnectorBase_V1`` and ``KVConnectorFactory``.

An out-of-tree connector (defined here) plugs in as in upstream vLLM, by ``kv_connector`` and
``kv_connector_module_path``, with only the abstract hooks implemented; the engine modules import
nothing of the offloading connector.
"""

from __future__ import annotations

import ast
import random
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import override

import vllm.v1.engine
from tests.v1.kv_connector.unit.offloading_connector.utils import random_tokens
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
)
from vllm.v1.core.sched.output import GroupBlockIds, SchedulerOutput
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import Request


class _Meta(KVConnectorMetadata):
    def __init__(self, step: int) -> None:
        self.step = step


# Every instance's calls, by role and rank, in order: (hook, detail).
CALLS: dict[tuple[str, int], list[tuple[str, Any]]] = {}


class RecordingConnector(KVConnectorBase_V1):
    """An out-of-tree connector: implements only the abstract hooks, loads nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = CALLS.setdefault((self.role.name, self._rank), [])
        self.steps = 0

    @override
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self.calls.append(("lookup", request.request_id))
        return 0, False

    @override
    def update_state_after_alloc(
        self, request: Request, blocks: GroupBlockIds, num_external_tokens: int
    ) -> None:
        self.calls.append(("alloc", (request.request_id, num_external_tokens)))

    @override
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self.steps += 1
        self.calls.append(("meta", self.steps))
        return _Meta(self.steps)

    @override
    def start_load_kv(self, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        self.calls.append(("load", meta.step))

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        raise AssertionError("the engine loads no layer at a time")

    @override
    def save_kv_layer(
        self, layer_name: str, kv_layer: Any = None, attn_metadata: Any = None, **kwargs: Any
    ) -> None:
        raise AssertionError("the engine saves no layer at a time")

    @override
    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, _Meta)
        self.calls.append(("save", meta.step))


class NotAConnector:
    pass


def _config(tmp_path: Path, **overrides: Any) -> EngineConfig:
    fields: dict[str, Any] = dict(
        num_gpu_blocks=64, instance_id=f"oot-{tmp_path.name}", freeze_gc_heap=False
    )
    fields.update(overrides)
    return EngineConfig(**fields)


def test_an_out_of_tree_connector_plugs_in_by_name_and_module(tmp_path: Path) -> None:
    CALLS.clear()
    prompts = {f"r{i}": random_tokens(random.Random(i), 40) for i in range(3)}
    with EngineCore(_config(tmp_path)) as plain:
        expected = plain.generate(prompts, max_tokens=3)
    config = _config(
        tmp_path,
        tensor_parallel_size=2,
        kv_connector="RecordingConnector",
        kv_connector_module_path=__name__,
        kv_connector_extra_config={},
    )
    with EngineCore(config) as engine:
        assert isinstance(engine.connector, RecordingConnector)
        assert engine.connector.role is KVConnectorRole.SCHEDULER
        assert engine.generate(prompts, max_tokens=3) == expected
        assert engine.connector_stats() == {} and engine.tier_stats() == []
    scheduler = CALLS[("SCHEDULER", 0)]
    assert [d for h, d in scheduler if h == "lookup"] == ["r0", "r1", "r2"]
    assert [d for h, d in scheduler if h == "alloc"] == [("r0", 0), ("r1", 0), ("r2", 0)]
    steps = [d for h, d in scheduler if h == "meta"]
    for rank in (0, 1):
        # Each rank loads before and saves after the forward pass of every step, with that
        # step's metadata bound.
        worker = CALLS[("WORKER", rank)]
        assert worker == [(hook, step) for step in steps for hook in ("load", "save")]


def test_the_factory_refuses_what_is_no_connector() -> None:
    with pytest.raises(ValueError, match=r"unknown KV connector 'Nope'.*OffloadingConnector"):
        KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="Nope"))
    with pytest.raises(ValueError, match="has no KV connector 'Nope'"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="Nope", kv_connector_module_path=__name__)
        )
    with pytest.raises(ValueError, match="NotAConnector is not a subclass of KVConnectorBase_V1"):
        KVConnectorFactory.get_connector_class(
            KVTransferConfig(kv_connector="NotAConnector", kv_connector_module_path=__name__)
        )
    with pytest.raises(ValueError, match="'OffloadingConnector' is already registered"):
        KVConnectorFactory.register_connector("OffloadingConnector", __name__, "x")


def test_the_engine_imports_only_the_connector_interface() -> None:
    """No module of the engine imports the offloading connector (only ``v1.base``, ``v1.metrics``
    and the factory)."""
    offenders = []
    for path in Path(vllm.v1.engine.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            offenders += [
                f"{path.name}: {n}" for n in names if n.startswith("vllm.distributed.kv_transfer")
            ]
    allowed = {
        "vllm.distributed.kv_transfer.kv_connector.factory",
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
    }
    assert [o for o in offenders if o.split(": ")[1] not in allowed] == []
