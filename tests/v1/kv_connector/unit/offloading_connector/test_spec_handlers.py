# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The connector's worker half gets its handlers from the spec and names no offload medium.

* The connector package imports neither the CPU tier nor the tiering package, directly or not.
* An out-of-tree spec selected with ``spec_name`` + ``spec_module_path`` builds every rank's
  handlers (``get_handlers``), which then serve the engine's transfers, and gets them released.
* Handlers that cannot all be registered are shut down and released at once.
"""

from __future__ import annotations

import ast
import random
from collections.abc import Collection
from pathlib import Path

import pytest
from typing_extensions import override

import vllm.distributed.kv_transfer.kv_connector.v1.offloading as connector_pkg
from tests.subprocesses import run_python
from tests.v1.kv_connector.unit.offloading_connector.utils import make_config, random_tokens
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.worker import canonical_kv_caches
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import cpu_worker_handlers
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo, OffloadingSpec, WorkerHandlers
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult, TransferSpec

CONCRETE_MEDIA = ("vllm.v1.kv_offload.cpu", "vllm.v1.kv_offload.tiering")


def _is_concrete(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in CONCRETE_MEDIA)


# ---------------------------------------------------------------------------------------------
# No concrete medium below the connector
# ---------------------------------------------------------------------------------------------


def test_connector_sources_import_no_concrete_medium() -> None:
    """Every import statement of the package, including ones inside functions."""
    offenders = []
    for path in sorted(Path(connector_pkg.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if _is_concrete(n)]
    assert not offenders


def test_importing_the_connector_loads_no_concrete_medium() -> None:
    """Transitively: a fresh interpreter importing every module of the package."""
    code = f"""
import importlib, pkgutil, sys
import {connector_pkg.__name__} as pkg
for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
    importlib.import_module(info.name)
print("\\n".join(sorted(sys.modules)))
"""
    proc = run_python("-c", code)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.split()
    assert f"{connector_pkg.__name__}.worker" in out  # the check saw the package
    assert [m for m in out if _is_concrete(m)] == []


# ---------------------------------------------------------------------------------------------
# An out-of-tree spec builds the engine's handlers
# ---------------------------------------------------------------------------------------------


class CountingHandler(OffloadingHandler):
    """Forwards to a real handler; counts the jobs it accepted."""

    def __init__(self, inner: OffloadingHandler) -> None:
        self.inner = inner
        self.jobs = 0
        self.shutdowns = 0

    @override
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        accepted = self.inner.transfer_async(job_id, spec)
        self.jobs += accepted
        return accepted

    @override
    def get_finished(self) -> list[TransferResult]:
        return self.inner.get_finished()

    @override
    def wait(self, job_ids: Collection[int]) -> None:
        self.inner.wait(job_ids)

    @override
    def shutdown(self) -> None:
        self.shutdowns += 1
        self.inner.shutdown()


class CountingSpec(OffloadingSpec):
    """A third-party spec: the CPU tier's manager and handlers, each handler behind a counter.

    Records the ranks it built handlers for, the handlers by ``(rank, direction)``, and the ranks
    whose ``close`` was called, in order.
    """

    def __init__(
        self, config: OffloadingConfig, run: KVCacheRunInfo, *, enable_events: bool = False
    ) -> None:
        super().__init__(config, run)
        self.enable_events = enable_events
        self._manager: CPUOffloadingManager | None = None
        self.built: list[int] = []
        self.handlers: dict[tuple[int, str], CountingHandler] = {}
        self.closed: list[int] = []

    @override
    def get_manager(self) -> CPUOffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                self.num_primary_blocks, enable_events=self.enable_events
            )
        return self._manager

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        self.built.append(rank)
        real = cpu_worker_handlers(self, kv_caches, rank)
        registrations = []
        for src, dst, handler in real.registrations:
            counting = CountingHandler(handler)
            self.handlers[(rank, f"{src.medium()}_to_{dst.medium()}")] = counting
            registrations.append((src, dst, counting))

        def close() -> None:
            self.closed.append(rank)
            real.close()

        return WorkerHandlers(registrations, close)


def test_engine_uses_an_out_of_tree_specs_handlers(tmp_path: Path) -> None:
    extra = {"spec_name": "CountingSpec", "spec_module_path": __name__}
    config = make_config(tmp_path, tensor_parallel_size=2, extra=extra)
    prompt = random_tokens(random.Random(1), 100)
    with EngineCore(config) as engine:
        # Every connector instance builds its own spec, as in upstream vLLM: the scheduler
        # side's builds the manager, each rank's its handlers.
        assert isinstance(engine.connector, OffloadingConnector)
        assert isinstance(engine.connector.spec, CountingSpec)
        assert engine.connector.spec.built == []
        specs = []
        for worker in engine.workers:
            assert isinstance(worker.connector, OffloadingConnector)
            specs.append(worker.connector.spec)
        assert all(isinstance(s, CountingSpec) for s in specs)
        assert [s.built for s in specs] == [[0], [1]]
        expected = engine.generate({"a": prompt}, max_tokens=2)["a"]
        engine.kv_cache_manager.reset_prefix_cache()  # GPU only: the CPU tier keeps the blocks
        assert engine.generate({"b": prompt}, max_tokens=2)["b"] == expected
        assert engine.stats.tokens_from_cpu == 96 and engine.stats.blocks_loaded_verified == 6
        assert engine.stats.verification_failures == 0
        for rank, spec in enumerate(specs):
            assert spec.handlers[(rank, "GPU_to_CPU")].jobs >= 1
            assert spec.handlers[(rank, "CPU_to_GPU")].jobs == 1
            assert spec.closed == []
    assert [s.closed for s in specs] == [[0], [1]]
    # The connector shut each handler down before close() released the region.
    assert all(h.shutdowns >= 1 for s in specs for h in s.handlers.values())


# ---------------------------------------------------------------------------------------------
# Registration failures
# ---------------------------------------------------------------------------------------------


class IdleHandler(OffloadingHandler):
    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name

    @override
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        raise AssertionError("no job expected")

    @override
    def get_finished(self) -> list[TransferResult]:
        return []

    @override
    def wait(self, job_ids: Collection[int]) -> None:
        pass

    @override
    def shutdown(self) -> None:
        self.log.append(f"shutdown {self.name}")


class ConflictingSpec(CountingSpec):
    """Registers two handlers for the same direction."""

    log: list[str]

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        self.log = []
        return WorkerHandlers(
            [
                (GPULoadStoreSpec, CPULoadStoreSpec, IdleHandler(self.log, "first")),
                (GPULoadStoreSpec, CPULoadStoreSpec, IdleHandler(self.log, "second")),
            ],
            close=lambda: self.log.append("close"),
        )


def test_handlers_that_cannot_all_be_registered_are_released(tmp_path: Path) -> None:
    with EngineCore(make_config(tmp_path)) as engine:
        assert isinstance(engine.connector, OffloadingConnector)
        spec = ConflictingSpec(engine.connector.spec.config, engine.connector.spec.run)
        worker = OffloadingConnectorWorker(spec, 0)
        caches = canonical_kv_caches(engine.workers[0].kv_caches)
        with pytest.raises(ValueError, match="already registered"):
            worker.register_kv_caches(caches)
        assert spec.log == ["shutdown first", "shutdown second", "close"]
        worker.shutdown()  # nothing left to release
        assert spec.log == ["shutdown first", "shutdown second", "close"]
