# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``RouterPromMetrics``: the router's own Prometheus series (``docs/metrics.md``).

Every series carries ``run`` (the report's run label) and ``policy``; per-instance series carry
``instance`` too:

* ``vllm:router_decisions`` (counter, per instance): requests routed there;
* ``vllm:router_chosen_cost`` (histogram): the kv-aware cost of the instance chosen, in prompt
  tokens;
* ``vllm:router_expected_cached_tokens`` (counter, per ``place``): prefix tokens the chosen
  instances were expected to serve from each place;
* ``vllm:router_guard_exclusions`` (counter): candidates the load-balance guard excluded;
* ``vllm:router_event_batches``, ``vllm:router_event_replayed``, ``vllm:router_event_lost``
  (gauges, per instance: cumulative counts of the event feed, set from its counters) and
  ``vllm:router_event_lag_seconds`` (gauge, per instance: the last batch's lag).

Threading: updated on the front end's event loop; ``prometheus_client`` locks each metric for
the scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm.entrypoints.router.event_feed import FeedStats
from vllm.entrypoints.router.policies import Decision
from vllm.entrypoints.router.prefix_index import Place

_COST_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536, float("inf"))


class RouterPromMetrics:
    """The router's series in ``registry`` (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        run_policy = ("run", "policy")
        per_instance = (*run_policy, "instance")
        self.decisions = Counter(
            "vllm:router_decisions",
            "Requests routed to the instance.",
            per_instance,
            registry=registry,
        )
        self.chosen_cost = Histogram(
            "vllm:router_chosen_cost",
            "kv-aware cost of the chosen instance (prompt tokens).",
            run_policy,
            buckets=_COST_BUCKETS,
            registry=registry,
        )
        self.expected_cached = Counter(
            "vllm:router_expected_cached_tokens",
            "Prefix tokens the chosen instances were expected to serve, per place.",
            (*run_policy, "place"),
            registry=registry,
        )
        self.guard_exclusions = Counter(
            "vllm:router_guard_exclusions",
            "Candidates the load-balance guard excluded.",
            run_policy,
            registry=registry,
        )
        self.event_batches = Gauge(
            "vllm:router_event_batches",
            "Event batches applied (cumulative).",
            per_instance,
            registry=registry,
        )
        self.event_replayed = Gauge(
            "vllm:router_event_replayed",
            "Event batches recovered by replay (cumulative).",
            per_instance,
            registry=registry,
        )
        self.event_lost = Gauge(
            "vllm:router_event_lost",
            "Event batches lost beyond the replay buffer (cumulative).",
            per_instance,
            registry=registry,
        )
        self.event_lag = Gauge(
            "vllm:router_event_lag_seconds",
            "Lag of the last event batch applied (its ts to its application).",
            per_instance,
            registry=registry,
        )

    def observe(self, run: str, policy: str, decision: Decision) -> None:
        """One routing decision."""
        self.decisions.labels(run, policy, str(decision.instance)).inc()
        if decision.costs:
            cost = decision.costs[decision.instance]
            if cost is not None:
                self.chosen_cost.labels(run, policy).observe(cost)
            excluded = sum(1 for c in decision.costs if c is None)
            if excluded:
                self.guard_exclusions.labels(run, policy).inc(excluded)
        if decision.match is not None:
            for place in Place:
                n = decision.match.tokens[place]
                if n:
                    self.expected_cached.labels(run, policy, place.name).inc(n)

    def update_feed(self, run: str, policy: str, stats: FeedStats) -> None:
        """Set the feed's per-instance gauges from its counters."""
        for i, n in enumerate(stats.batches):
            labels = (run, policy, str(i))
            self.event_batches.labels(*labels).set(n)
            self.event_replayed.labels(*labels).set(stats.replayed[i])
            self.event_lost.labels(*labels).set(stats.lost[i])
            self.event_lag.labels(*labels).set(stats.last_lag_s[i])
