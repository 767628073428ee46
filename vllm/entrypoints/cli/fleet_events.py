# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV events and routing of ``vllm-kv-offload run``: each instance's publisher, the front end's
router.

Every engine instance has **one** ``ZmqEventPublisher`` for the whole invocation
(``instance_publisher``), built when the instance starts and shut down when it ends, so its
sequence numbers run on across the baseline and the offloaded runs. It serves the endpoints of
``--kv-events-endpoint`` / ``--kv-events-replay-endpoint`` (vLLM's rules: offset by the
instance's index, bound or connected to as vLLM does) and, when the front end routes by KV
(``--routing kv-aware``), private loopback endpoints on free ports that only the front end
knows: the router needs no ``--kv-events-endpoint``. When the engine of a run ends, the instance
publishes ``AllBlocksCleared`` (its GPU cache and CPU tier are gone with it).

``FleetRouting`` is the front end's side: the ``EventFeed`` over the instances' private
endpoints (kv-aware only) and a fresh ``Router`` per run (``new_router``), so each run's
decisions and counts start from zero while the index carries on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from vllm.distributed.kv_event_publisher import ZmqEventPublisher
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    KVEventBatch,
    KVEventsConfig,
    offset_endpoint_port,
)
from vllm.entrypoints.cli.report.figures import RoutingFigures
from vllm.entrypoints.router.event_feed import EventFeed, FeedStats
from vllm.entrypoints.router.measured_costs import MeasuredCosts
from vllm.entrypoints.router.policies import KVAware, RoutingCosts, make_policy
from vllm.entrypoints.router.router import Router

PRIVATE_ENDPOINT = "tcp://127.0.0.1:*"
"""Where an instance binds the endpoints only the front end's router subscribes to (a free
loopback port each)."""
PUBLISH_DRAIN_S = 10.0
"""How long the end of a run waits for the publisher to send what the run published."""
FEED_CATCH_UP_S = 10.0
"""How long the front end waits, between runs, for the feed to apply every batch an instance
says it sent."""


@dataclass(frozen=True)
class InstanceEndpoints:
    """The private endpoints one instance's publisher bound for the router.

    Attributes:
        pub: the PUB address.
        replay: the ROUTER address.
    """

    pub: str
    replay: str


def instance_publisher(
    events: KVEventsConfig, index: int, for_router: bool
) -> ZmqEventPublisher | None:
    """Instance ``index``'s publisher, or None when nobody consumes its events.

    Args:
        events: the ``kv_events_config`` of the command's options.
        index: the instance's index (its ``data_parallel_rank`` and port offset).
        for_router: also bind private loopback endpoints for the front end's router.

    Raises:
        OSError: an endpoint could not be bound (e.g. its port is in use).
    """
    public = events.enable_kv_cache_events and events.publisher == "zmq"
    if not public and not for_router:
        return None
    try:
        return ZmqEventPublisher.from_config(
            events,
            index,
            also_bind=[(PRIVATE_ENDPOINT, PRIVATE_ENDPOINT)] if for_router else (),
            use_endpoints=public,
        )
    except zmq.ZMQError as e:
        where = offset_endpoint_port(events.endpoint, index) if public else PRIVATE_ENDPOINT
        raise OSError(e.errno, f"KV events of engine {index}: cannot use {where}: {e}") from None


async def announce_engine_end(publisher: ZmqEventPublisher) -> int:
    """Publish ``AllBlocksCleared`` (the run's engine, its GPU cache and CPU tier are gone),
    wait until the publisher sent everything (off the event loop); its batches sent so far."""
    publisher.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
    await asyncio.get_running_loop().run_in_executor(None, publisher.wait_sent, PUBLISH_DRAIN_S)
    return publisher.sent_batches


def private_endpoints(publisher: ZmqEventPublisher) -> InstanceEndpoints:
    """The private endpoints ``instance_publisher(..., for_router=True)`` bound (the last ones)."""
    return InstanceEndpoints(publisher.endpoints.pub[-1], publisher.endpoints.replay[-1])


class FleetRouting:
    """The front end's routing of one invocation (see the module docstring).

    Args:
        policy: the ``--routing`` policy name.
        num_instances: the fleet's instances.
        endpoints: per instance, its private endpoints (kv-aware only; None otherwise).
        hash_block_size: tokens per hashed piece (the engines' ``hash_block_size``).
        costs: kv-aware load costs.
    """

    def __init__(
        self,
        policy: str,
        num_instances: int,
        endpoints: Sequence[InstanceEndpoints] | None,
        hash_block_size: int,
        costs: RoutingCosts | None = None,
    ) -> None:
        self.policy = policy
        self.num_instances = num_instances
        self.hash_block_size = hash_block_size
        self.costs = costs
        self.feed: EventFeed | None = None
        if policy == KVAware.name:
            if endpoints is None or len(endpoints) != num_instances:
                raise ValueError("kv-aware routing needs every instance's event endpoints")
            self.feed = EventFeed([(e.pub, e.replay) for e in endpoints])

    def new_router(self, policy: str | None = None) -> Router:
        """A router for one run (``policy``: another policy over the same feed)."""
        name = policy or self.policy
        match = self.feed.match if self.feed is not None else None
        return Router(
            make_policy(name, self.num_instances, match, self.hash_block_size, self.costs),
            self.hash_block_size,
        )

    def catch_up(self, sent_batches: Sequence[int]) -> bool:
        """Wait until the feed applied every batch each instance says it sent (kv-aware);
        False if some stream did not within ``FEED_CATCH_UP_S``."""
        if self.feed is None:
            return True
        return all(self.feed.wait_for(i, n, FEED_CATCH_UP_S) for i, n in enumerate(sent_batches))

    def feed_stats(self) -> FeedStats | None:
        """The feed's counters (None without a feed)."""
        return None if self.feed is None else self.feed.stats

    def stop(self) -> None:
        """Stop the feed (idempotent)."""
        if self.feed is not None:
            self.feed.stop()


def _costs_json(measured: MeasuredCosts) -> dict[str, Any]:
    costs = measured.costs()
    return {
        "compute_us_per_token": measured.compute_s_per_token * 1e6,
        "load_cost": {place.name: cost for place, cost in costs.load_cost.items()},
    }


def routing_figures(router: Router, routing: FleetRouting) -> RoutingFigures:
    """How ``router`` routed its run (the feed's counters are the invocation's so far)."""
    stats = router.stats
    feed = routing.feed_stats()
    events: dict[str, list[float]] | None = None
    if feed is not None:
        events = {
            "batches": [float(n) for n in feed.batches],
            "replayed": [float(n) for n in feed.replayed],
            "replay_requests": [float(n) for n in feed.replay_requests],
            "lost": [float(n) for n in feed.lost],
            "mean_lag_ms": [
                1000 * lag / n if n else 0.0
                for lag, n in zip(feed.lag_sum_s, feed.batches, strict=True)
            ],
            "max_lag_ms": [1000 * lag for lag in feed.max_lag_s],
        }
    return RoutingFigures(
        policy=stats.policy,
        requests=list(stats.decisions),
        expected_cached_tokens=dict(stats.expected_cached_tokens),
        expected_computed_tokens=stats.expected_computed_tokens,
        guard_exclusions=stats.guard_exclusions,
        measured_costs=[None if m is None else _costs_json(m) for m in stats.measured],
        events=events,
    )
