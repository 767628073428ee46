# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Test harness of the offloading connector: engines, workloads, and simple test doubles.

Test doubles here wrap REAL components:

* ``ChaosHandler`` wraps a real transfer handler. As its ``Chaos`` says, it runs each job late
  (after a random number of ``get_finished`` polls, or when ``wait`` asks for it) and can fail
  jobs on purpose (the real transfer is then skipped, so the destination keeps stale bytes).
  Running stores late is what makes a missing flush observable: the store would copy bytes that
  were overwritten meanwhile.
* ``WrappedCPUOffloadingSpec`` / ``WrappedTieringOffloadingSpec`` are the real specs, but their
  ``get_handlers`` passes each rank's real handlers through a ``HandlerWrapper`` (e.g.
  ``chaos_factory``'s). ``with_handlers(config, wrapper)`` selects them the way an out-of-tree
  spec is selected: ``spec_name`` + ``spec_module_path``.
* ``ManagerSpy`` forwards every call to a real manager and logs its name.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import random
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from typing_extensions import override

from vllm.distributed.kv_events import KVEventBatch, KVEventDecoder, KVEventEncoder
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    OffloadingConnectorScheduler,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.spec import OffloadingSpec, WorkerHandlers
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.kv_offload.worker.canonical import CanonicalKVCaches
from vllm.v1.kv_offload.worker.worker import OffloadingHandler, TransferResult, TransferSpec

# 2 layers x (K, V) x 2 heads x 16 x fp16 = 256 bytes per token: a 16-token block is one page.
GEOMETRY: dict[str, Any] = dict(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16")


ASYNC_SCHEDULING = False
"""``make_config``'s default ``async_scheduling``; ``conftest.py`` sets it per test."""


def make_config(
    tmp_path: Path,
    *,
    cpu_blocks: int | None = 64,
    fs: bool = False,
    extra: dict[str, Any] | None = None,
    **overrides: Any,
) -> EngineConfig:
    """A small engine config; ``cpu_blocks=None`` runs without offloading.

    The scheduling mode is ``ASYNC_SCHEDULING`` unless ``async_scheduling`` is overridden.

    ``cpu_blocks`` sizes the CPU tier in rows (one offloaded block each, 4 KiB per worker).
    """
    settings: dict[str, Any] = dict(
        GEOMETRY,
        gpu_block_sizes=(16,),
        num_gpu_blocks=64,
        max_num_seqs=4,
        async_scheduling=ASYNC_SCHEDULING,
    )
    settings.update(overrides)
    if cpu_blocks is not None:
        cfg: dict[str, Any] = {"shared_region_dir": str(tmp_path)}
        if fs:
            cfg["spec_name"] = "TieringOffloadingSpec"
            cfg["secondary_tiers"] = [
                {
                    "type": "fs",
                    "root_dir": str(tmp_path / "fs"),
                    "n_read_threads": 2,
                    "n_write_threads": 2,
                }
            ]
        cfg.update(extra or {})
        cfg["cpu_bytes_to_use"] = cpu_blocks * row_bytes(EngineConfig(**settings), cfg)
        settings["kv_connector_extra_config"] = cfg
    return EngineConfig(**settings)


def row_bytes(config: EngineConfig, extra: dict[str, Any]) -> int:
    """Bytes of one CPU-tier row (every worker's slice of an offloaded block) for ``config``."""
    kv_bytes = sum(config.num_layers * config.gpu_page_bytes(g) for g in range(config.num_groups))
    offloaded = extra.get("block_size") or math.lcm(*config.gpu_block_sizes)
    factor = offloaded // min(config.gpu_block_sizes)
    raw = kv_bytes * factor * config.tensor_parallel_size
    return -(-raw // mmap.PAGESIZE) * mmap.PAGESIZE


# ---------------------------------------------------------------------------------------------
# Transfer handler wrapper
# ---------------------------------------------------------------------------------------------


@dataclass
class TransferLog:
    """What the chaos handlers of every rank saw, in order: ``(event, rank, direction, job_id)``.

    Events: ``"submit"`` (accepted from the connector), ``"run"`` (handed to the real handler),
    ``"fail"`` (failed on purpose), ``"wait"`` (a ``wait`` asked for the job).
    """

    entries: list[tuple[str, int, str, int]] = field(default_factory=list)

    def jobs(self, event: str, direction: str | None = None) -> list[int]:
        return [j for e, _, d, j in self.entries if e == event and direction in (None, d)]


@dataclass
class _Pending:
    job_id: int
    spec: TransferSpec
    release_poll: int
    fail: bool


@dataclass(frozen=True)
class Chaos:
    """How a ``ChaosHandler`` misbehaves (the default: not at all)."""

    max_delay_polls: int = 0
    """Each job runs after a random number of ``get_finished`` polls, at most this many (or
    ``min_delay_polls``, if that is more)."""
    failure_rate: float = 0.0
    """The probability that a job fails (its real transfer skipped)."""
    fail_job: Callable[[int], bool] | None = None
    """Whether job ``job_id`` fails, whatever ``failure_rate`` draws."""
    min_delay_polls: int = 0
    """Each job runs after at least this many polls."""


class ChaosHandler(OffloadingHandler):
    """Runs a real handler's jobs late, and fails some of them (see the module docstring)."""

    def __init__(
        self,
        inner: OffloadingHandler,
        rng: random.Random,
        rank: int,
        chaos: Chaos = Chaos(),
        log: TransferLog | None = None,
    ) -> None:
        self.inner = inner
        self.rng = rng
        self.rank = rank
        self.min_delay_polls = chaos.min_delay_polls
        self.max_delay_polls = max(chaos.max_delay_polls, chaos.min_delay_polls)
        self.failure_rate = chaos.failure_rate
        self.fail_job = chaos.fail_job
        self.log = log if log is not None else TransferLog()
        transfer_type = getattr(inner, "transfer_type", ("?", "?"))
        self.transfer_type = transfer_type
        self.direction = f"{transfer_type[0]}_to_{transfer_type[1]}"
        self._queue: deque[_Pending] = deque()
        self._failed: list[TransferResult] = []
        self._poll = 0

    def _record(self, event: str, job_id: int) -> None:
        self.log.entries.append((event, self.rank, self.direction, job_id))

    @override
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        fail = self.rng.random() < self.failure_rate or (
            self.fail_job is not None and self.fail_job(job_id)
        )
        delay = self.rng.randint(self.min_delay_polls, self.max_delay_polls)
        self._queue.append(_Pending(job_id, spec, self._poll + delay, fail))
        self._record("submit", job_id)
        return True

    def _release(self, pending: _Pending) -> None:
        if pending.fail:
            self._record("fail", pending.job_id)
            self._failed.append(
                TransferResult(pending.job_id, success=False, transfer_type=self.transfer_type)
            )
            return
        self._record("run", pending.job_id)
        assert self.inner.transfer_async(pending.job_id, pending.spec)

    @override
    def get_finished(self) -> list[TransferResult]:
        self._poll += 1
        while self._queue and self._queue[0].release_poll <= self._poll:
            self._release(self._queue.popleft())
        results, self._failed = self._failed, []
        return results + self.inner.get_finished()

    @override
    def wait(self, job_ids: Collection[int]) -> None:
        ids = set(job_ids)
        for job_id in ids:
            if any(p.job_id == job_id for p in self._queue):
                self._record("wait", job_id)
        # Jobs of one direction run in submission order: release up to the last one asked for.
        while any(p.job_id in ids for p in self._queue):
            self._release(self._queue.popleft())
        self.inner.wait(ids)

    @override
    def shutdown(self) -> None:
        self._queue.clear()
        self.inner.shutdown()


HandlerWrapper = Callable[[WorkerHandlers, int], WorkerHandlers]
"""``(a rank's real handlers, rank) -> the handlers to register``; may wrap the registrations'
handlers, must keep ``close`` (which releases what the real handlers were built on)."""

# The wrapper of each engine, by ``EngineConfig.instance_id`` (which the spec sees as
# ``run.instance_id``): a spec named in the config is built by the engine, so this is how the
# test's wrapper reaches it. Entries live as long as the test process (a few small closures).
_WRAPPERS: dict[str, HandlerWrapper] = {}

_WRAPPED_SPECS = {
    "CPUOffloadingSpec": "WrappedCPUOffloadingSpec",
    "TieringOffloadingSpec": "WrappedTieringOffloadingSpec",
}


def _wrapped_handlers(spec: OffloadingSpec, real: WorkerHandlers, rank: int) -> WorkerHandlers:
    wrap = _WRAPPERS[spec.run.instance_id]
    try:
        return wrap(real, rank)
    except BaseException:
        for _, _, handler in real.registrations:
            handler.shutdown()
        real.close()
        raise


class WrappedCPUOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` whose real handlers go through the engine's ``HandlerWrapper``."""

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        return _wrapped_handlers(self, super().get_handlers(kv_caches, rank), rank)


class WrappedTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose real handlers go through the engine's ``HandlerWrapper``."""

    @override
    def get_handlers(self, kv_caches: CanonicalKVCaches, rank: int) -> WorkerHandlers:
        return _wrapped_handlers(self, super().get_handlers(kv_caches, rank), rank)


def with_handlers(config: EngineConfig, wrapper: HandlerWrapper) -> EngineConfig:
    """``config``, with its spec replaced by the ``Wrapped*`` test spec of the same kind, so that
    every rank's real handlers go through ``wrapper`` (the engine builds the spec from the config
    as it would an out-of-tree one: ``spec_name`` + ``spec_module_path``)."""
    extra = dict(config.kv_connector_extra_config or {})
    assert extra, "with_handlers needs a config with offloading"
    extra["spec_name"] = _WRAPPED_SPECS[extra.get("spec_name", "CPUOffloadingSpec")]
    extra["spec_module_path"] = __name__
    _WRAPPERS[config.instance_id] = wrapper
    return dataclasses.replace(config, kv_connector_extra_config=extra)


def chaos_factory(
    chaos: Chaos = Chaos(), seed: int = 0, log: TransferLog | None = None
) -> HandlerWrapper:
    """A handler wrapper putting each rank's real handlers behind ``ChaosHandler`` s doing
    ``chaos``, each rank's drawing from its own generator of ``seed`` (inject it with
    ``with_handlers``)."""

    def wrap(real: WorkerHandlers, rank: int) -> WorkerHandlers:
        rng = random.Random(seed * 1000 + rank)
        real.registrations = [
            (src, dst, ChaosHandler(h, rng, rank, chaos, log)) for src, dst, h in real.registrations
        ]
        return real

    return wrap


# ---------------------------------------------------------------------------------------------
# Manager spy and connector taps
# ---------------------------------------------------------------------------------------------


class ManagerSpy:
    """Forwards every attribute to a real manager; logs the name of each method called."""

    def __init__(self, manager: Any, log: list[str]) -> None:
        self._manager = manager
        self._log = log

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._manager, name)
        if not callable(attr) or name.startswith("_"):
            return attr
        log = self._log

        def call(*args: Any, **kwargs: Any) -> Any:
            log.append(name)
            result = attr(*args, **kwargs)
            if name == "take_events":
                result = list(result)
            return result

        return call


def spy_on_manager(engine: EngineCore) -> list[str]:
    """Wrap the engine's real manager in a ``ManagerSpy`` and bracket the connector calls.

    Returns the log: manager method names, with ``"<name"``/``"name>"`` around each
    ``build_connector_meta`` and ``take_events`` call of the connector.
    """
    assert engine.connector is not None
    sched = engine.connector.connector_scheduler
    log: list[str] = []
    sched.manager = ManagerSpy(sched.manager, log)  # type: ignore[assignment]
    for method in ("build_connector_meta", "take_events"):
        original = getattr(sched, method)

        def bracketed(*args: Any, _original: Any = original, _name: str = method) -> Any:
            log.append(f"<{_name}")
            try:
                result = _original(*args)
                return list(result) if _name == "take_events" else result
            finally:
                log.append(f"{_name}>")

        setattr(sched, method, bracketed)
    return log


def capture_metadata(engine: EngineCore) -> list[OffloadingConnectorMetadata]:
    """Record the metadata of every ``build_connector_meta`` call, in order."""
    assert engine.connector is not None
    sched: OffloadingConnectorScheduler = engine.connector.connector_scheduler
    captured: list[OffloadingConnectorMetadata] = []
    original = sched.build_connector_meta

    def tap(scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        meta = original(scheduler_output)
        captured.append(meta)
        return meta

    sched.build_connector_meta = tap  # type: ignore[method-assign]
    return captured


def mark_forward(engine: EngineCore, log: TransferLog) -> None:
    """Log ``("forward", rank, "", step)`` when each rank's forward pass starts: its model
    runner's ``execute``, which the worker calls between ``start_load_kv`` and ``wait_for_save``.

    ``step`` counts scheduled steps (``engine.stats.steps``, which a step increments after its
    forward passes), so it indexes ``capture_metadata``'s list in both scheduling modes: a
    ``step()`` call that only applies the step in flight schedules nothing.
    """
    for worker in engine.workers:
        runner = worker.runner
        original = runner.execute

        def execute(seqs: Any, _orig: Any = original, _rank: int = worker.rank) -> Any:
            log.entries.append(("forward", _rank, "", engine.stats.steps))
            return _orig(seqs)

        runner.execute = execute  # type: ignore[method-assign]


class EventCollector:
    """An event sink keeping the batches as encoded on the wire; ``batches()`` decodes them."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self._encoder = KVEventEncoder()

    def __call__(self, batch: KVEventBatch) -> None:
        self.payloads.append(self._encoder.encode(batch))

    def batches(self) -> list[KVEventBatch]:
        decoder = KVEventDecoder()
        return [decoder.decode(p) for p in self.payloads]


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


def random_tokens(rng: random.Random, n: int, vocab: int = 32000) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def run_multi_turn(
    engine: EngineCore,
    *,
    seed: int = 0,
    num_sessions: int = 6,
    turns: int = 3,
    first_prompt: int = 60,
    user_tokens: int = 24,
    max_tokens: int = 6,
    between_turns: Callable[[EngineCore, int], None] | None = None,
) -> dict[str, list[int]]:
    """Multi-turn chat: each turn's prompt is the whole history plus a new user message.

    All sessions of a turn are submitted together; returns the outputs by request id.
    """
    rng = random.Random(seed)
    history = {s: random_tokens(rng, first_prompt + 7 * s) for s in range(num_sessions)}
    outputs: dict[str, list[int]] = {}
    for turn in range(turns):
        prompts = {f"s{s}-t{turn}": list(history[s]) for s in history}
        out = engine.generate(prompts, max_tokens)
        for s in history:
            history[s] += out[f"s{s}-t{turn}"] + random_tokens(rng, user_tokens)
        outputs.update(out)
        if between_turns is not None:
            between_turns(engine, turn)
    return outputs


def baseline(
    tmp_path: Path, workload: Callable[[EngineCore], dict[str, list[int]]], **kw: Any
) -> dict[str, list[int]]:
    """The workload's outputs without offloading (same geometry)."""
    with EngineCore(make_config(tmp_path, cpu_blocks=None, **kw)) as engine:
        return workload(engine)


def keys_in_cpu(engine: EngineCore) -> set[bytes]:
    """The offload keys resident in the CPU tier (any state)."""
    assert engine.connector is not None
    manager = engine.connector.connector_scheduler.manager
    primary = getattr(manager, "primary_tier", manager)
    return {key for key, _ in primary.policy.items()}


def cpu_ref_counts(engine: EngineCore) -> dict[bytes, int]:
    """The CPU tier's ref_cnt of each resident block."""
    assert engine.connector is not None
    manager = engine.connector.connector_scheduler.manager
    primary = getattr(manager, "primary_tier", manager)
    return {key: block.ref_cnt for key, block in primary.policy.items()}


def iter_events(collector: EventCollector) -> Iterable[Any]:
    for batch in collector.batches():
        yield from batch.events
