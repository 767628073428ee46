# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The worker side of the offloading connector, with a recording handler per direction."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from typing_extensions import override

from tests.v1.kv_connector.unit.offloading_connector.utils import make_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
    TransferSpec,
    TransferStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.worker import canonical_kv_caches
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.mediums import CPULoadStoreSpec, GPULoadStoreSpec
from vllm.v1.kv_offload.spec import WorkerHandlers
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult


class RecordingHandler(OffloadingHandler):
    """Accepts every job, completes it when ``complete`` is called (or on ``wait``)."""

    def __init__(self, name: str, calls: list[tuple[str, object]]) -> None:
        self.name = name
        self.calls = calls
        self.pending: list[int] = []
        self.done: list[TransferResult] = []
        self.fail: set[int] = set()

    @override
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        self.calls.append((f"{self.name}.submit", job_id))
        self.pending.append(job_id)
        return True

    def complete(self) -> None:
        for job_id in self.pending:
            ok = job_id not in self.fail
            self.done.append(
                TransferResult(
                    job_id, ok, 4096 if ok else None, 0.001 if ok else None, _TYPES[self.name]
                )
            )
        self.pending = []

    @override
    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    @override
    def wait(self, job_ids: Collection[int]) -> None:
        self.calls.append((f"{self.name}.wait", sorted(job_ids)))
        self.complete()


_TYPES = {"store": ("GPU", "CPU"), "load": ("CPU", "GPU")}


class RecordingSpec(CPUOffloadingSpec):
    """The CPU spec, but its worker side serves the jobs with the two given handlers."""

    def __init__(
        self, base: CPUOffloadingSpec, store: RecordingHandler, load: RecordingHandler
    ) -> None:
        super().__init__(base.config, base.run)
        self.store = store
        self.load = load

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        return WorkerHandlers(
            [
                (GPULoadStoreSpec, CPULoadStoreSpec, self.store),
                (CPULoadStoreSpec, GPULoadStoreSpec, self.load),
            ]
        )


Harness = tuple[
    OffloadingConnectorWorker, RecordingHandler, RecordingHandler, list[tuple[str, object]]
]


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    calls: list[tuple[str, object]] = []
    store = RecordingHandler("store", calls)
    load = RecordingHandler("load", calls)

    with EngineCore(make_config(tmp_path)) as engine:
        assert isinstance(engine.connector, OffloadingConnector)
        assert isinstance(engine.connector.spec, CPUOffloadingSpec)
        worker = OffloadingConnectorWorker(RecordingSpec(engine.connector.spec, store, load), 0)
        worker.register_kv_caches(canonical_kv_caches(engine.workers[0].kv_caches))
        yield worker, store, load, calls
        worker.shutdown()


def _store(req: str, gpu: list[int], cpu: list[int]) -> TransferJob:
    return TransferJob(
        req, TransferSpec(GPULoadStoreSpec(gpu, [len(gpu)], [0]), CPULoadStoreSpec(cpu))
    )


def _load(req: str, cpu: list[int], gpu: list[int]) -> TransferJob:
    return TransferJob(
        req, TransferSpec(CPULoadStoreSpec(cpu), GPULoadStoreSpec(gpu, [len(gpu)], [0]))
    )


def test_stores_are_deferred_to_the_next_step_and_go_before_loads(harness: Harness) -> None:
    worker, _, _, calls = harness
    step1 = OffloadingConnectorMetadata(store_jobs={1: _store("a", [3], [0])})
    worker.handle_preemptions(step1)
    worker.start_load_kv(step1)
    worker.wait_for_save(step1)
    assert calls == []  # nothing submitted during the step that created the store
    step2 = OffloadingConnectorMetadata(load_jobs={2: _load("b", [0], [5])})
    worker.handle_preemptions(step2)
    worker.start_load_kv(step2)
    assert calls == [("store.submit", 1), ("load.submit", 2)]


def test_handle_preemptions_submits_then_waits(harness: Harness) -> None:
    worker, _, _, calls = harness
    step1 = OffloadingConnectorMetadata(store_jobs={1: _store("a", [3], [0])})
    worker.wait_for_save(step1)
    # Step 2 flushes job 1 (deferred) and job 4 (created this very step).
    step2 = OffloadingConnectorMetadata(
        store_jobs={4: _store("c", [6], [1]), 5: _store("d", [7], [2])}, jobs_to_flush={1, 4}
    )
    worker.handle_preemptions(step2)
    assert calls == [("store.submit", 1), ("store.submit", 4), ("store.wait", [1, 4])]
    worker.start_load_kv(step2)
    worker.wait_for_save(step2)
    assert calls[-1] == ("store.wait", [1, 4])  # job 5 stays deferred, 4 is not resubmitted
    worker.start_load_kv(OffloadingConnectorMetadata())
    assert calls[-1] == ("store.submit", 5)


def test_get_finished_reports_loads_by_request_and_failures(harness: Harness) -> None:
    worker, _, load, _ = harness
    assert worker.build_connector_worker_meta() is None
    meta = OffloadingConnectorMetadata(
        load_jobs={7: _load("a", [0, 1], [4, 5]), 8: _load("b", [2], [6])}
    )
    worker.start_load_kv(meta)
    load.fail.add(8)
    load.complete()
    sending, recving = worker.get_finished(set())
    assert sending == set() and recving == {"a", "b"}
    assert worker.get_block_ids_with_load_errors() == {0: {6}}
    assert worker.get_block_ids_with_load_errors() == {}  # drained
    report = worker.build_connector_worker_meta()
    assert report is not None
    assert report.completed_jobs == {7: 1} and report.failed_jobs == {8: 1}
    assert report.transfer_stats == {("CPU", "GPU"): TransferStats(2, 4096, 0.001)}
    assert worker.build_connector_worker_meta() is None


def test_worker_metadata_aggregates_by_summing() -> None:
    a = OffloadingWorkerMetadata()
    a.mark_finished(1, True)
    a.mark_finished(2, False)
    a.record_transfer(("GPU", "CPU"), 100, 0.5)
    b = OffloadingWorkerMetadata()
    b.mark_finished(1, True)
    b.mark_finished(2, True)
    b.record_transfer(("GPU", "CPU"), 50, 0.25)
    total = a.aggregate(b)
    assert total.completed_jobs == {1: 2, 2: 1} and total.failed_jobs == {2: 1}
    assert total.transfer_stats[("GPU", "CPU")] == TransferStats(2, 150, 0.75)
    assert a.completed_jobs == {1: 1}  # inputs untouched
    with pytest.raises(AssertionError, match="reported twice"):
        a.mark_finished(1, True)
