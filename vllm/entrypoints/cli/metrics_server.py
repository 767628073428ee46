# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``--metrics-port``: serve the runs' metrics on ``http://127.0.0.1:PORT/metrics`` while they run.

Three parts, by where they run:

- ``EngineMetrics`` (the process that owns the engine): a ``prometheus_client`` registry with
  the offloading connector's metrics (``OffloadPromMetrics``, catalogue in ``metric_catalog``),
  fed from the engine thread. ``attach`` installs the engine's per-step stats sink (the
  connector's ``OffloadingConnectorStats`` of every step) and wraps the front end's step callback
  to bring the engine's token counters up to date; ``flush`` does both once more at the end of a
  run, before the report is taken.
- ``InstanceMetrics`` (a fleet's command process): the latest families each instance's recorder
  sent over its pipe (``fleet_instance.py`` sends them every ``SEND_INTERVAL_S`` and at the end of
  each run), exposed as one collector.
- ``MetricsServer``: the HTTP server exposing a registry (a recorder's, or one holding the
  instances' collector).

Every series carries ``model_name``, ``engine`` (the instance's index; ``0`` with one engine) and
``run`` (``baseline`` or ``offload``), so both runs and every instance of one invocation are told
apart in one scrape. ``final_values`` is the report's ``metrics`` section: per run, each series
summed over the instances (a fleet's figures are sums too).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from typing_extensions import override

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metric_catalog import (
    PRIMARY_TIER_LABEL,
    tier_label,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.offloading_connector import (
    OffloadingConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.prometheus import (
    OffloadPromMetrics,
)
from vllm.entrypoints.cli.checks import METRICS_ADDRESS
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.stats import EngineStats
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

ADDRESS = METRICS_ADDRESS
"""Loopback only: the metrics reveal the workload's shape and are not meant for other hosts."""
LABELNAMES = ("model_name", "engine", "run")
SEND_INTERVAL_S = 1.0
"""How often a fleet instance sends its metrics to the command's process during a run."""

StepCallback = Callable[[EngineCore, list[Any]], None]


def _tier_labels(engine: EngineCore) -> list[tuple[str, str | None]]:
    """``tier`` label and tier type of the CPU tier (no type) and of each secondary tier, in
    lookup order (none without offloading)."""
    if not isinstance(engine.connector, OffloadingConnector):
        return []
    manager = engine.connector.connector_scheduler.manager
    labels: list[tuple[str, str | None]] = [(PRIMARY_TIER_LABEL, None)]
    if isinstance(manager, TieringOffloadingManager):
        labels += [
            (tier_label(i, t.tier_type), t.tier_type) for i, t in enumerate(manager.secondary_tiers)
        ]
    return labels


def _served_by_tier(stats: EngineStats, types: Sequence[str | None]) -> list[int]:
    """Prompt tokens each tier served: the CPU tier's own hits, then each secondary tier's
    promoted tokens by its type; tokens whose tier the manager did not name count as the first
    secondary tier's, so the tiers add up to what the engine placed (as in the report)."""
    if not types:
        return []
    served = [stats.tokens_from_cpu]
    named = 0
    for tier_type in types[1:]:
        n = stats.tokens_from_tier.get(tier_type, 0) if tier_type is not None else 0
        served.append(n)
        named += n
    if len(served) > 1:
        served[1] += stats.tokens_from_secondary - named
    return served


@dataclass(frozen=True)
class _RunSeries:
    """What labels one attached run's series.

    Attributes:
        labelvalues: the values of ``LABELNAMES``.
        tiers: ``tier`` label and tier type of each tier, in lookup order (``_tier_labels``).
    """

    labelvalues: tuple[str, ...]
    tiers: list[tuple[str, str | None]]


class EngineMetrics:
    """The connector's metrics of this process's engines, in a registry of their own.

    Observations come from the engine thread, reads (scrapes, ``families``) from any thread;
    prometheus_client locks each metric, and this recorder's lock keeps one step's observations
    together.

    Args:
        engine_index: the ``engine`` label of every series (a fleet instance's index).
    """

    def __init__(self, engine_index: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.prom = OffloadPromMetrics(self.registry, LABELNAMES)
        self.engine_index = engine_index
        self._lock = threading.Lock()
        self._runs: dict[str, _RunSeries] = {}

    def attach(
        self, engine: EngineCore, run: str, step_callback: StepCallback | None = None
    ) -> StepCallback:
        """Feed ``engine``'s metrics, labelled ``run``; returns the step callback to give the
        front end (it calls ``step_callback`` too)."""
        series = _RunSeries(
            labelvalues=(engine.config.model_name, str(self.engine_index), run),
            tiers=_tier_labels(engine),
        )

        def sink(stats: KVConnectorStats) -> None:
            self._observe(engine, stats, series)

        def callback(engine_: EngineCore, outputs: list[Any]) -> None:
            if engine_.connector is None:  # with a connector, the sink did it already
                self._observe(engine_, None, series)
            if step_callback is not None:
                step_callback(engine_, outputs)

        engine.kv_connector_stats_sink = sink
        self._runs[run] = series
        return callback

    def flush(self, engine: EngineCore, run: str) -> None:
        """Engine thread, after the run's last step: collect what the last step left."""
        stats = engine.connector.get_kv_connector_stats() if engine.connector else None
        self._observe(engine, stats, self._runs[run])

    def families(self) -> list[Metric]:
        """Every metric family now (picklable: a fleet instance sends them to the command)."""
        with self._lock:
            return list(self.registry.collect())

    def _observe(
        self, engine: EngineCore, stats: KVConnectorStats | None, series: _RunSeries
    ) -> None:
        """One step's observations under the lock: the connector's ``stats`` (if the
        offloading connector's), then the engine's token counters."""
        with self._lock:
            if isinstance(stats, OffloadingConnectorStats):
                self.prom.observe(stats, series.labelvalues)
            self._observe_engine(engine, series)

    def _observe_engine(self, engine: EngineCore, series: _RunSeries) -> None:
        """The engine's token accounting, as the report derives it: each tier is looked up for
        the tokens every faster one missed, and serves what it loaded and verified."""
        s = engine.stats
        labelvalues, tiers = series.labelvalues, series.tiers
        total = self.prom.set_counter_total
        total("vllm:prefix_cache_queries", s.prompt_tokens, labelvalues)
        total("vllm:prefix_cache_hits", s.tokens_from_gpu_cache, labelvalues)
        remaining = s.prompt_tokens - s.tokens_from_gpu_cache
        served = _served_by_tier(s, [tier_type for _, tier_type in tiers])
        for (tier, _), n in zip(tiers, served, strict=True):
            total("vllm:kv_offload_tier_lookup_tokens", remaining, labelvalues, (tier,))
            total("vllm:kv_offload_tier_hit_tokens", n, labelvalues, (tier,))
            remaining -= n


class InstanceMetrics(Collector):
    """A fleet's metrics in the command's process: each instance's latest families, as one
    collector (families of one name merged over the instances, whose ``engine`` labels differ).

    ``update`` is called on the event loop's thread, ``collect`` on the server's.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_instance: dict[int, Sequence[Metric]] = {}

    def update(self, index: int, families: Sequence[Metric]) -> None:
        """Instance ``index``'s families now (replacing what it sent before)."""
        with self._lock:
            self._by_instance[index] = families

    @override
    def collect(self) -> Iterable[Metric]:
        with self._lock:
            parts = [self._by_instance[i] for i in sorted(self._by_instance)]
        merged: dict[str, Metric] = {}
        for families in parts:
            for family in families:
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples.extend(family.samples)
        return list(merged.values())

    def registry(self) -> CollectorRegistry:
        """A registry holding only this collector, for a ``MetricsServer``."""
        registry = CollectorRegistry()
        registry.register(self)
        return registry


class MetricsServer:
    """The ``/metrics`` server of ``registry`` on ``127.0.0.1:port`` (0: any free port).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, port: int) -> None:
        self.registry = registry
        self._server, self._thread = start_http_server(port, ADDRESS, registry=registry)
        self._closed = False

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """Where to scrape."""
        return f"http://{ADDRESS}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def final_values(registry: CollectorRegistry, run: str) -> dict[str, float]:
    """Every series of ``run`` now, as ``name{label="value",...}`` -> value: counters (with
    Prometheus' ``_total``), gauges, and histograms' ``_count`` and ``_sum``; a series of several
    instances is their sum."""
    out: dict[str, float] = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.labels.get("run") != run or sample.name.endswith(("_created", "_bucket")):
                continue
            own = {k: v for k, v in sample.labels.items() if k not in LABELNAMES}
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(own.items()))
            key = f"{sample.name}{{{labels}}}" if labels else sample.name
            out[key] = out.get(key, 0.0) + sample.value
    return dict(sorted(out.items()))
