# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``--metrics-port``: serve the runs' metrics on ``http://127.0.0.1:PORT/metrics`` while they run.

``MetricsExporter`` owns a ``prometheus_client`` registry with the offloading connector's
metrics (``OffloadPromMetrics``, catalogue in ``metric_catalog``) and the HTTP server that
exposes it. Every series carries ``model_name``, ``engine`` and ``run`` (``baseline`` or
``offload``), so both runs of one invocation are told apart in one scrape.

Feeding happens on the engine thread: ``attach`` installs the engine's per-step stats sink
(the connector's ``OffloadingConnectorStats`` of every step) and wraps the front end's step
callback to bring the engine's token counters up to date; ``flush`` does both once more at the
end of a run, before the report is taken. ``final_values`` is the report's ``metrics`` section.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

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
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager

ADDRESS = "127.0.0.1"
"""Loopback only: the metrics reveal the workload's shape and are not meant for other hosts."""
LABELNAMES = ("model_name", "engine", "run")

StepCallback = Callable[[EngineCore, list[Any]], None]


def _tier_labels(engine: EngineCore) -> list[str]:
    """``tier`` labels of the CPU tier and each secondary tier (none without offloading)."""
    if not isinstance(engine.connector, OffloadingConnector):
        return []
    manager = engine.connector.connector_scheduler.manager
    labels = [PRIMARY_TIER_LABEL]
    if isinstance(manager, TieringOffloadingManager):
        labels += [tier_label(i, t.tier_type) for i, t in enumerate(manager.secondary_tiers)]
    return labels


class MetricsExporter:
    """A registry and its ``/metrics`` server on ``127.0.0.1:port`` (0: any free port).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, port: int) -> None:
        self.registry = CollectorRegistry()
        self.prom = OffloadPromMetrics(self.registry, LABELNAMES)
        self._server, self._thread = start_http_server(port, ADDRESS, registry=self.registry)
        # Observations come from the engine thread, scrapes from the server's; prometheus_client
        # locks each metric, this lock keeps one step's observations together.
        self._lock = threading.Lock()
        self._flushers: dict[str, Callable[[EngineCore], None]] = {}
        self._closed = False

    @property
    def port(self) -> int:
        """The port the server listens on."""
        return int(self._server.server_port)

    @property
    def url(self) -> str:
        """Where to scrape."""
        return f"http://{ADDRESS}:{self.port}/metrics"

    def attach(
        self, engine: EngineCore, run: str, step_callback: StepCallback | None = None
    ) -> StepCallback:
        """Feed ``engine``'s metrics, labelled ``run``; returns the step callback to give the
        front end (it calls ``step_callback`` too)."""
        labelvalues = (engine.config.model_name, "0", run)
        tiers = _tier_labels(engine)

        def sink(stats: KVConnectorStats) -> None:
            with self._lock:
                if isinstance(stats, OffloadingConnectorStats):
                    self.prom.observe(stats, labelvalues)
                self._observe_engine(engine, labelvalues, tiers)

        def callback(engine_: EngineCore, outputs: list[Any]) -> None:
            if engine_.connector is None:  # with a connector, the sink did it already
                with self._lock:
                    self._observe_engine(engine_, labelvalues, tiers)
            if step_callback is not None:
                step_callback(engine_, outputs)

        engine.kv_connector_stats_sink = sink
        self._flushers[run] = lambda e: self._flush(e, labelvalues, tiers)
        return callback

    def flush(self, engine: EngineCore, run: str) -> None:
        """Engine thread, after the run's last step: collect what the last step left."""
        self._flushers[run](engine)

    def _flush(self, engine: EngineCore, labelvalues: tuple[str, ...], tiers: list[str]) -> None:
        stats = engine.connector.get_kv_connector_stats() if engine.connector else None
        with self._lock:
            if isinstance(stats, OffloadingConnectorStats):
                self.prom.observe(stats, labelvalues)
            self._observe_engine(engine, labelvalues, tiers)

    def _observe_engine(
        self, engine: EngineCore, labelvalues: tuple[str, ...], tiers: list[str]
    ) -> None:
        """The engine's token accounting, as the report derives it: each tier is looked up for
        the tokens every faster one missed, and serves what it loaded and verified."""
        s = engine.stats
        total = self.prom.set_counter_total
        total("vllm:prefix_cache_queries", s.prompt_tokens, labelvalues)
        total("vllm:prefix_cache_hits", s.tokens_from_gpu_cache, labelvalues)
        remaining = s.prompt_tokens - s.tokens_from_gpu_cache
        served = [s.tokens_from_cpu, s.tokens_from_secondary]
        for i, tier in enumerate(tiers[:2]):
            total("vllm:kv_offload_tier_lookup_tokens", remaining, labelvalues, (tier,))
            total("vllm:kv_offload_tier_hit_tokens", served[i], labelvalues, (tier,))
            remaining -= served[i]

    def final_values(self, run: str) -> dict[str, float]:
        """Every series of ``run`` now, as ``name{label="value",...}`` -> value: counters (with
        Prometheus' ``_total``), gauges, and histograms' ``_count`` and ``_sum``."""
        out: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.labels.get("run") != run or sample.name.endswith(("_created", "_bucket")):
                    continue
                own = {k: v for k, v in sample.labels.items() if k not in LABELNAMES}
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(own.items()))
                out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return dict(sorted(out.items()))

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
