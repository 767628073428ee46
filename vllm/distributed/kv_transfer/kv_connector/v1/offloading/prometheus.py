# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``OffloadPromMetrics``: the catalogue's metrics as ``prometheus_client`` objects.

vLLM's ``OffloadPromMetrics`` observes each step's ``KVConnectorStats`` into Prometheus
counters, gauges and histograms; this is the same for this project's catalogue
(``metric_catalog.CATALOG``): one metric object per catalogue entry on a caller-owned
``CollectorRegistry``, labelled with the caller's labels (e.g. ``model_name``, ``engine``) and
then the metric's own. Exposition (``/metrics``) is ``prometheus_client``'s.

Counters take increments (``observe``), or a cumulative total through ``set_counter_total``
(for sources that only keep totals, like the engine's token accounting).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metric_catalog import (
    CATALOG,
    MetricDef,
    MetricType,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)

_Metric = Counter | Gauge | Histogram


class OffloadPromMetrics:
    """The catalogue's Prometheus metrics on ``registry``.

    Args:
        registry: where the metrics are registered (one instance per registry).
        labelnames: the caller's labels, in front of each metric's own.
        catalog: the metrics to create (default: all of them).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        labelnames: Sequence[str],
        catalog: Iterable[MetricDef] = CATALOG,
    ) -> None:
        self.labelnames = tuple(labelnames)
        self._defs: dict[str, MetricDef] = {}
        self._metrics: dict[str, _Metric] = {}
        # (name, label values) -> the total a counter was last set to (set_counter_total).
        self._totals: dict[tuple[str, tuple[str, ...]], float] = {}
        # (name, label values) -> the labelled child: ``labels()`` validates and locks on every
        # call, which would dominate a step's observation cost.
        self._children: dict[tuple[str, tuple[str, ...], tuple[str, ...]], Any] = {}
        for m in catalog:
            labels = [*self.labelnames, *m.labelnames]
            metric: _Metric
            if m.type is MetricType.COUNTER:
                metric = Counter(m.name, m.documentation, labels, registry=registry)
            elif m.type is MetricType.GAUGE:
                metric = Gauge(m.name, m.documentation, labels, registry=registry)
            else:
                metric = Histogram(
                    m.name, m.documentation, labels, registry=registry, buckets=m.buckets
                )
            self._defs[m.name] = m
            self._metrics[m.name] = metric

    def observe(self, stats: OffloadingConnectorStats, labelvalues: Sequence[str]) -> int:
        """Apply one step's stats: counters grow by their increments, gauges take their level,
        histograms get each observation.

        Returns:
            How many recorded names the catalogue does not know (they are skipped).
        """
        # Straight over ``data`` (no enum conversion, no intermediate lists): the CLI observes
        # every step on the engine thread.
        unknown = 0
        lv = tuple(labelvalues)
        types: dict[str, str] = stats.data["types"]
        children = self._children
        for name, slot in stats.data["data"].items():
            kind = types[name]
            metric = self._metrics.get(name)
            if metric is None or self._defs[name].type != kind:
                unknown += 1
                continue
            for labels, value in slot.items():
                key = (name, lv, labels)
                child: Any = children.get(key)
                if child is None:
                    child = children[key] = metric.labels(*lv, *labels)
                if kind == "counter":
                    if value > 0:
                        child.inc(value)
                elif kind == "gauge":
                    child.set(value)
                else:
                    for v in value:
                        child.observe(v)
        return unknown

    def set_counter_total(
        self, name: str, total: float, labelvalues: Sequence[str], labels: tuple[str, ...] = ()
    ) -> None:
        """Bring counter ``name`` up to the cumulative ``total`` (never down)."""
        key = (name, (*labelvalues, *labels))
        delta = total - self._totals.get(key, 0)
        if delta > 0:
            self._totals[key] = total
            counter: Any = self._metrics[name]
            counter.labels(*labelvalues, *labels).inc(delta)
