# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""An instance's publisher and the front end's routing (``cli/fleet_events.py``), on loopback."""

from __future__ import annotations

import pytest
import zmq

from vllm.distributed.kv_events import BlockStored, KVEventBatch, KVEventsConfig
from vllm.entrypoints.cli.fleet_events import (
    FleetRouting,
    instance_publisher,
    private_endpoints,
)
from vllm.entrypoints.router.router import prompt_block_hashes
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

PROMPT = list(range(64))


def _stored(n: int) -> KVEventBatch:
    hashes = prompt_block_hashes(PROMPT, get_request_block_hasher(16))[:n]
    event = BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    return KVEventBatch(ts=0.0, events=[event])


def test_no_publisher_without_a_consumer() -> None:
    assert instance_publisher(KVEventsConfig(), 0, for_router=False) is None
    off = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert instance_publisher(off, 0, for_router=False) is None


def test_public_endpoints_are_offset_by_the_instance_index() -> None:
    # A host address (no wildcard): vLLM's rule connects the PUB socket to a subscriber that
    # binds; instance 1 goes to the configured port + 1.
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port - 1}")
    publisher = instance_publisher(events, 1, for_router=True)
    assert publisher is not None
    try:
        private = private_endpoints(publisher)
        assert private.pub.startswith("tcp://127.0.0.1:") and private.replay != private.pub
        for _ in range(200):  # until the connection is up
            publisher.publish(KVEventBatch(ts=1.0, events=[]))
            if sub.poll(50):
                break
        _, _, payload = sub.recv_multipart()
        assert payload  # the stream reaches the subscriber at the offset port
    finally:
        publisher.shutdown()
        sub.close(linger=0)


def test_kv_aware_routing_follows_the_instances_events() -> None:
    pubs = [instance_publisher(KVEventsConfig(), i, for_router=True) for i in range(2)]
    assert all(p is not None for p in pubs)
    routing = FleetRouting("kv-aware", 2, [private_endpoints(p) for p in pubs], 16)  # type: ignore[arg-type]
    try:
        pubs[1].publish(_stored(4))  # type: ignore[union-attr]
        for p in pubs:
            assert p.wait_sent(10.0)  # type: ignore[union-attr]
        assert routing.catch_up([p.sent_batches for p in pubs])  # type: ignore[union-attr]
        router = routing.new_router()
        decision = router.route("r0", "s0", [*PROMPT, 1, 2, 3])
        assert decision.instance == 1 and decision.expected_computed == 3
        # Another policy over the same feed, counts from zero.
        rr = routing.new_router("round-robin")
        assert rr.route("r1", "s1", PROMPT).instance == 0 and rr.stats.decisions == [1, 0]
        stats = routing.feed_stats()
        assert stats is not None and stats.batches[1] == 1 and stats.lost == [0, 0]
    finally:
        routing.stop()
        for p in pubs:
            p.shutdown()  # type: ignore[union-attr]


def test_kv_aware_needs_every_instances_endpoints() -> None:
    with pytest.raises(ValueError, match="endpoints"):
        FleetRouting("kv-aware", 2, None, 16)
    routing = FleetRouting("session", 2, None, 16)
    assert routing.catch_up([5, 5]) and routing.feed_stats() is None
    routing.stop()
