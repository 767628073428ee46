# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""An instance's publisher and the front end's routing (``cli/fleet_events.py``), on loopback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.distributed.kv_event_helpers import block_stored
from tests.entrypoints.cli.workload_args import workload_args
from vllm.distributed.kv_events import KVEventBatch, KVEventsConfig
from vllm.entrypoints.cli.fleet_events import (
    FleetRouting,
    instance_publisher,
    private_endpoints,
)
from vllm.entrypoints.cli.main import main
from vllm.entrypoints.router.router import prompt_block_hashes
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

PROMPT = list(range(64))
TINY_RUN = workload_args(clients=2, sessions=4, think_time=0.001, timeout=300)


def _stored(n: int) -> KVEventBatch:
    hashes = prompt_block_hashes(PROMPT, get_request_block_hasher(16))[:n]
    return KVEventBatch(ts=0.0, events=[block_stored(hashes)])


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


def _free_port() -> int:
    sock = zmq.Context.instance().socket(zmq.PUB)
    try:
        return sock.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
    finally:
        sock.close(linger=0)


def test_run_publishes_every_event_of_both_runs_on_one_sequence(tmp_path: Path) -> None:
    # The command connects its PUB socket to this subscriber (a host address: vLLM's rule);
    # what the live stream missed (before the subscription took effect) comes back by replay
    # while the runs go on.
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
    replay_port = _free_port()
    got: dict[int, list[object]] = {}
    stop = threading.Event()

    def read() -> None:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        expected = 0
        while not stop.is_set():
            if not sub.poll(50):
                continue
            _, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > expected:
                dealer.send_multipart([b"", expected.to_bytes(8, "big")])
                while True:
                    _, rseq, rpayload = dealer.recv_multipart()
                    if rseq == (-1).to_bytes(8, "big", signed=True):
                        break
                    got.setdefault(int.from_bytes(rseq, "big"), msgspec.msgpack.decode(rpayload))
            got[seq] = msgspec.msgpack.decode(payload)
            expected = max(expected, seq + 1)
        dealer.close(linger=0)

    reader = threading.Thread(target=read)
    reader.start()
    out = tmp_path / "report.json"
    try:
        code = main(
            [
                *TINY_RUN,
                "--no-progress",
                "--no-fs",
                "--kv-events-endpoint",
                f"tcp://127.0.0.1:{port}",
                "--kv-events-replay-endpoint",
                f"tcp://127.0.0.1:{replay_port}",
                "--json",
                str(out),
            ]
        )
    finally:
        stop.set()
        reader.join()
        sub.close(linger=0)
    assert code == 0
    doc = json.loads(out.read_text())
    sent = doc["kv_events"]["batches_sent"]
    assert doc["kv_events"]["batches_dropped"] == 0
    assert sorted(got) == list(range(sent))  # every batch of both runs, one sequence
    events = [e for seq in sorted(got) for e in got[seq][1]]  # type: ignore[index]
    assert all(got[s][2] == 0 for s in got)  # type: ignore[index]
    clears = [i for i, e in enumerate(events) if e["type"] == "AllBlocksCleared"]
    assert len(clears) == 2 and clears[-1] == len(events) - 1  # one per engine, at its end
    media = {e.get("medium") for e in events[: clears[0]]}
    assert media == {"GPU"}  # the baseline has no offload tiers
    assert {e.get("medium") for e in events[clears[0] + 1 :]} >= {"GPU", "CPU"}
