# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Statistics of the scheduler-side offloading connector.

``OffloadingSchedulerMetrics`` owns what ``OffloadingConnectorScheduler`` counts: jobs and blocks
moved, failures, flushes, deferrals, resets and schedule ends, the per-direction transfer totals
the workers report, and the time of each ``on_schedule_end``; ``as_dict`` is the flat view that
``OffloadingConnectorScheduler.get_stats()`` returns. It only counts: nothing the connector
decides depends on it.

``OffloadingConnectorStats`` is vLLM's ``KVConnectorStats`` of this connector: what one or more
steps measured, in a self-describing, msgspec-serialisable form, as it travels from the workers to
the scheduler and on to the exporter. Its metric names are those of ``metric_catalog``; the
Prometheus side is ``prometheus.OffloadPromMetrics``. The counters above stay plain integer
attributes (one add on the hot path); ``stats_collector`` turns them into per-step increments.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from typing_extensions import ParamSpec, Self, override

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    TransferStats,
    TransferType,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metric_catalog import (
    BY_NAME,
    MetricType,
)

_P = ParamSpec("_P")
_T = TypeVar("_T")

# The counters of ``as_dict``, in the order they are listed there.
_COUNTER_NAMES = (
    "load_jobs",
    "load_blocks",
    "failed_load_jobs",
    "failed_load_blocks",
    "store_jobs",
    "store_blocks",
    "failed_store_jobs",
    "failed_store_blocks",
    "flushed_jobs",
    "deferred_lookups",
    "deferred_lookup_requests",
    "transfer_wait_requests",
    "deferred_stores",
    "stale_completions",
    "cache_resets",
    "lookups_skipped_after_reset",
)


@dataclass(slots=True)
class OffloadingSchedulerMetrics:
    """Cumulative statistics of the scheduler-side connector, since its construction.

    ``reset_cache`` resets none of them. A *block* is one key: one offloaded block of one
    KV-cache group.

    Attributes:
        load_jobs, load_blocks: load jobs created, and the blocks they move.
        failed_load_jobs, failed_load_blocks: load jobs some worker failed, and their blocks.
        store_jobs, store_blocks: store jobs created, and the blocks they move.
        failed_store_jobs, failed_store_blocks: store jobs some worker failed, and their blocks.
        flushed_jobs: jobs the workers were told to finish before a forward pass (counted once
            per step that flushes them).
        deferred_lookups: lookups answered "ask again next step".
        deferred_lookup_requests: requests with at least one such lookup because a tier could
            not answer yet whether it holds a key (each counted once).
        transfer_wait_requests: requests with at least one such lookup because its blocks were
            being moved: promoted from a secondary tier, stored from the GPU or loaded by
            another request (each counted once). Their bytes are on their way: the wait is part
            of loading them, not of finding them.
        deferred_stores: ``prepare_store`` calls that found no room (offered again next step).
        stale_completions: reports of jobs issued before a ``reset_cache`` (ignored).
        cache_resets: ``reset_cache`` calls.
        lookups_skipped_after_reset: lookups answered "no hit" without asking the manager,
            because jobs issued before a reset were still running.
        stored_blocks, loaded_blocks: blocks of the store / load jobs that every worker finished
            successfully.
        schedule_ends: ``manager.on_schedule_end()`` calls (one per step).
        schedule_end_seconds: the duration of each ``on_schedule_end()`` call not yet collected
            (drained by ``stats_collector``; one float per step).
        transfers: per ``(src medium, dst medium)``, the workers' transfer totals, summed over
            ranks (a job run by two ranks counts twice; bytes are the total moved).
    """

    load_jobs: int = 0
    load_blocks: int = 0
    failed_load_jobs: int = 0
    failed_load_blocks: int = 0
    store_jobs: int = 0
    store_blocks: int = 0
    failed_store_jobs: int = 0
    failed_store_blocks: int = 0
    flushed_jobs: int = 0
    deferred_lookups: int = 0
    deferred_lookup_requests: int = 0
    transfer_wait_requests: int = 0
    deferred_stores: int = 0
    stale_completions: int = 0
    cache_resets: int = 0
    lookups_skipped_after_reset: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    schedule_ends: int = 0
    schedule_end_seconds: list[float] = field(default_factory=list)
    transfers: dict[TransferType, TransferStats] = field(default_factory=dict)

    def timed_schedule_end(self, fn: Callable[[], None]) -> None:
        """Call ``manager.on_schedule_end``, timing it (one sample of the step) into
        ``schedule_end_seconds``. The other manager calls are not timed one by one: the engine
        times each connector hook, manager calls included."""
        start = time.perf_counter()
        try:
            fn()
        finally:
            elapsed = time.perf_counter() - start
            if len(self.schedule_end_seconds) < MAX_PENDING_SAMPLES:
                self.schedule_end_seconds.append(elapsed)
            self.schedule_ends += 1

    def record_transfers(self, stats: Mapping[TransferType, TransferStats]) -> None:
        """Add one step's worker-reported transfer totals."""
        for transfer_type, step_stats in stats.items():
            self.transfers[transfer_type] = (
                self.transfers.get(transfer_type, TransferStats()) + step_stats
            )

    def as_dict(
        self, jobs_in_flight: int, manager_stats: Mapping[str, int | float] | None
    ) -> dict[str, int | float]:
        """The flat statistics of ``OffloadingConnectorScheduler.get_stats()``.

        Args:
            jobs_in_flight: the connector's jobs not yet reported by every worker.
            manager_stats: the manager's own statistics, prefixed ``manager.``.

        Returns:
            The counters by attribute name, ``jobs_in_flight``, ``schedule_ends``,
            ``transfer.<SRC>_to_<DST>.{jobs,bytes,seconds}`` per direction,
            then ``manager.<key>`` per manager statistic.
        """
        stats: dict[str, int | float] = {name: getattr(self, name) for name in _COUNTER_NAMES}
        stats["jobs_in_flight"] = jobs_in_flight
        stats["schedule_ends"] = self.schedule_ends
        for (src, dst), t in self.transfers.items():
            prefix = f"transfer.{src}_to_{dst}"
            stats[f"{prefix}.jobs"] = t.num_jobs
            stats[f"{prefix}.bytes"] = t.num_bytes
            stats[f"{prefix}.seconds"] = t.seconds
        if manager_stats:
            for key, value in manager_stats.items():
                stats[f"manager.{key}"] = value
        return stats


def record_worker_transfer(
    stats: OffloadingConnectorStats, transfer_type: TransferType, num_bytes: int, seconds: float
) -> None:
    """Record one successful transfer job a worker finished (once per job, not per block).

    Feeds the per-direction family (``vllm:kv_offload_transfer_*``) and, for the GPU <-> CPU
    directions, upstream's ``store_*`` / ``load_*`` metrics.
    """
    src, dst = transfer_type
    labels = (f"{src}_to_{dst}",)
    stats.increase_counter("vllm:kv_offload_transfer_jobs", 1, labels)
    stats.increase_counter("vllm:kv_offload_transfer_bytes", num_bytes, labels)
    stats.observe_histogram("vllm:kv_offload_transfer_latency_seconds", seconds, labels)
    stats.observe_histogram("vllm:kv_offload_transfer_size_bytes", num_bytes, labels)
    op = "store" if src == "GPU" else "load" if dst == "GPU" else None
    if op is not None:
        stats.increase_counter(f"vllm:kv_offload_{op}_bytes", num_bytes)
        stats.increase_counter(f"vllm:kv_offload_{op}_time", seconds)
        stats.observe_histogram(f"vllm:kv_offload_{op}_size", num_bytes)


MAX_PENDING_SAMPLES = 100_000
"""Most samples a producer keeps for one histogram until they are collected.

The engine collects every step, so this only bounds the memory of a connector whose stats
nobody collects; samples beyond it are dropped."""

_TYPES = "types"
_DATA = "data"
# The types' names as stored in ``data`` (read once: an enum member's ``.value`` is a descriptor
# call, and stats are recorded some 30 times per engine step).
_COUNTER: str = MetricType.COUNTER.value
_GAUGE: str = MetricType.GAUGE.value
_HISTOGRAM: str = MetricType.HISTOGRAM.value


def _label_text(name: str, labels: tuple[str, ...], suffix: str = "") -> str:
    # Prometheus' notation: name_suffix{label="value",...}.
    if not labels:
        return f"{name}{suffix}"
    metric = BY_NAME.get(name)
    if metric is None or len(metric.labelnames) != len(labels):
        return f"{name}{suffix}{{{','.join(labels)}}}"
    pairs = ",".join(f'{k}="{v}"' for k, v in zip(metric.labelnames, labels, strict=True))
    return f"{name}{suffix}{{{pairs}}}"


@dataclass
class OffloadingConnectorStats(KVConnectorStats):
    """The offloading connector's ``KVConnectorStats``: counters, gauges and histograms.

    ``data`` is self-describing, so the receiver needs no metric definitions to combine it::

        {"types": {name: "counter" | "gauge" | "histogram"},
         "data":  {name: {label_values: value}}}

    ``label_values`` is a tuple of strings (``()`` for an unlabelled metric), in the order of the
    metric's ``labelnames`` in ``metric_catalog``; a value is an increment (counter), a level
    (gauge) or a list of observations (histogram). msgspec's msgpack round-trips it unchanged.

    Combining (``aggregate``): counters add, gauges keep the other's (later) value, histograms
    concatenate. A name must keep its type: combining two types is a programming error
    (``AssertionError``).
    """

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    @override
    def reset(self) -> None:
        self.data = {_TYPES: {}, _DATA: {}}

    def _slot(self, name: str, kind: str) -> dict[tuple[str, ...], Any]:
        types: dict[str, str] = self.data[_TYPES]
        known = types.get(name)
        if known is None:
            types[name] = kind
            slot: dict[tuple[str, ...], Any] = {}
            self.data[_DATA][name] = slot
            return slot
        assert known == kind, f"metric {name} is a {known}, not a {kind}"
        return self.data[_DATA][name]

    def increase_counter(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Add ``value`` (>= 0) to counter ``name``."""
        slot = self._slot(name, _COUNTER)
        slot[labels] = slot.get(labels, 0) + value

    def set_gauge(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Set gauge ``name`` to ``value``."""
        self._slot(name, _GAUGE)[labels] = value

    def observe_histogram(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        """Add one observation to histogram ``name``."""
        self._slot(name, _HISTOGRAM).setdefault(labels, []).append(value)

    def observe_many(self, name: str, values: list[float], labels: tuple[str, ...] = ()) -> None:
        """Add several observations to histogram ``name``."""
        if values:
            self._slot(name, _HISTOGRAM).setdefault(labels, []).extend(values)

    def get(self, name: str, labels: tuple[str, ...] = ()) -> Any:
        """The value of ``name`` for ``labels`` (None if never recorded)."""
        slot = self.data[_DATA].get(name)
        return None if slot is None else slot.get(labels)

    def labelled(self, name: str) -> dict[tuple[str, ...], Any]:
        """The value of ``name`` for each of its label tuples (empty if never recorded)."""
        return dict(self.data[_DATA].get(name, {}))

    def types(self) -> dict[str, MetricType]:
        """Each recorded metric's type."""
        return {name: MetricType(t) for name, t in self.data[_TYPES].items()}

    def items(self) -> list[tuple[str, MetricType, tuple[str, ...], Any]]:
        """Every recorded value as ``(name, type, label_values, value)``."""
        out = []
        for name, kind in self.types().items():
            for labels, value in self.data[_DATA][name].items():
                out.append((name, kind, tuple(labels), value))
        return out

    @override
    def aggregate(self, other: Self) -> Self:
        # Straight over ``data`` (one slot lookup per metric, not per value): the scheduler
        # folds the workers' stats into its own every step.
        other_types: dict[str, str] = other.data[_TYPES]
        for name, values in other.data[_DATA].items():
            kind = other_types[name]
            slot = self._slot(name, kind)
            if kind == _COUNTER:
                for labels, value in values.items():
                    labels = tuple(labels)
                    slot[labels] = slot.get(labels, 0) + value
            elif kind == _GAUGE:
                for labels, value in values.items():
                    slot[tuple(labels)] = value
            else:
                for labels, value in values.items():
                    slot.setdefault(tuple(labels), []).extend(value)
        return self

    @override
    def reduce(self) -> dict[str, int | float]:
        """Counters and gauges by ``name{labels}``; histograms as ``..._count`` / ``..._sum``."""
        out: dict[str, int | float] = {}
        for name, kind, labels, value in self.items():
            if kind is MetricType.HISTOGRAM:
                out[_label_text(name, labels, "_count")] = len(value)
                out[_label_text(name, labels, "_sum")] = sum(value)
            else:
                out[_label_text(name, labels)] = value
        return out

    @override
    def is_empty(self) -> bool:
        return not self.data[_DATA]
