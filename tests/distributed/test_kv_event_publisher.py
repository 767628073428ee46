# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The ZeroMQ publisher on real loopback sockets, read by a subscriber written here from the wire
description alone (pyzmq and plain msgpack, none of the project's structs):

* live messages are three frames: topic, sequence number (8 bytes big-endian), msgpack payload;
* the payload is ``[ts, events, data_parallel_rank]``, each event a map tagged ``type``;
* replay: a DEALER sends ``[b"", first missing seq (8 bytes)]`` to the ROUTER socket and reads
  ``[b"", seq, payload]`` frames until the end marker ``[b"", (-1 as 8 signed bytes), b""]``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from tests.v1.kv_connector.unit.offloading_connector.utils import (
    EventCollector,
    make_config,
    random_tokens,
)
from vllm.distributed.kv_event_publisher import ZmqEventPublisher, make_event_publisher
from vllm.distributed.kv_events import (
    BlockRemoved,
    KVEventBatch,
    KVEventsConfig,
    NullEventPublisher,
)
from vllm.v1.engine.core import EngineCore

LOOPBACK = "tcp://127.0.0.1:*"
WAIT_S = 10.0
END = (-1).to_bytes(8, "big", signed=True)


class WireSubscriber:
    """A consumer built from the wire description (see the module docstring)."""

    def __init__(self, pub: str, replay: str, drop: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub)
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.connect(replay)
        self.drop = set(drop)
        self.batches: dict[int, Any] = {}
        self.topics: set[bytes] = set()
        self.replayed: list[int] = []

    def read_live(self, timeout_ms: int) -> int:
        """Read live messages until none arrives within ``timeout_ms``; how many were read."""
        n = 0
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert len(seq_bytes) == 8
            seq = int.from_bytes(seq_bytes, "big")
            n += 1
            self.topics.add(topic)
            if seq in self.drop:
                self.drop.discard(seq)  # dropped on purpose: only replay brings it back
                continue
            self.batches[seq] = msgspec.msgpack.decode(payload)
        return n

    def replay_from(self, start: int) -> list[int]:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        seqs: list[int] = []
        while True:
            assert self.dealer.poll(int(WAIT_S * 1000)), "no replay answer"
            empty, seq_bytes, payload = self.dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END:
                assert payload == b""
                return seqs
            seq = int.from_bytes(seq_bytes, "big")
            seqs.append(seq)
            self.batches.setdefault(seq, msgspec.msgpack.decode(payload))
        return seqs

    def missing(self, total: int) -> list[int]:
        return [s for s in range(total) if s not in self.batches]

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


def _publisher(**kwargs: Any) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        data_parallel_rank=kwargs.pop("rank", 0),
        endpoint=None,
        also_bind=[(LOOPBACK, LOOPBACK)],
        **kwargs,
    )


def _wire_events(batches: dict[int, Any]) -> list[dict[str, Any]]:
    return [event for seq in sorted(batches) for event in batches[seq][1]]


def _expected_events(collector: EventCollector) -> list[dict[str, Any]]:
    # The engine's batches as this module's decoder reads them (no project structs).
    return [e for p in collector.payloads for e in msgspec.msgpack.decode(p)[1]]


def _run_engine(tmp_path: Path, sink: Any, seed: int) -> None:
    tmp_path.mkdir()
    config = make_config(tmp_path, cpu_blocks=12)
    with EngineCore(config, event_sink=sink) as engine:
        rng = random.Random(seed)
        engine.generate({f"r{i}": random_tokens(rng, 100) for i in range(3)}, max_tokens=3)


def test_wire_subscriber_decodes_every_event_of_two_engine_runs(tmp_path: Path) -> None:
    publisher = _publisher(rank=2, topic="kv@engine-2")
    collector = EventCollector()
    sub = WireSubscriber(publisher.endpoints.pub[0], publisher.endpoints.replay[0], drop={3})

    def sink(batch: KVEventBatch) -> None:
        collector(batch)
        publisher.publish(batch)

    try:
        # Two engines one after another (a report's baseline and offloaded runs): one sequence.
        _run_engine(tmp_path / "a", sink, seed=1)
        _run_engine(tmp_path / "b", sink, seed=2)
        assert publisher.wait_sent(WAIT_S)
        total = publisher.sent_batches
        assert total == len(collector.payloads) > 4 and publisher.dropped_batches == 0
        sub.read_live(timeout_ms=500)
        # What the live stream missed (the drop on purpose, and what was published before the
        # subscription reached the publisher) comes back through replay.
        missing = sub.missing(total)
        assert 3 in missing
        assert sub.replay_from(missing[0]) == list(range(missing[0], total))
        assert sub.missing(total) == []
        assert sub.topics <= {b"kv@engine-2"}
        assert all(sub.batches[s][2] == 2 for s in range(total))  # data_parallel_rank
        assert _wire_events(sub.batches) == _expected_events(collector)
        types = {e["type"] for e in _wire_events(sub.batches)}
        media = {e.get("medium") for e in _wire_events(sub.batches)}
        assert types == {"BlockStored", "BlockRemoved"} and media == {"GPU", "CPU"}
        assert publisher.replays_served == 1
    finally:
        sub.close()
        publisher.shutdown()


def test_replay_keeps_only_the_last_buffer_steps_batches() -> None:
    publisher = _publisher(buffer_steps=4)
    sub = WireSubscriber(publisher.endpoints.pub[0], publisher.endpoints.replay[0])
    try:
        for i in range(10):
            publisher.publish(KVEventBatch(ts=float(i), events=[BlockRemoved([i], "GPU")]))
        assert publisher.wait_sent(WAIT_S)
        assert sub.replay_from(0) == [6, 7, 8, 9]
        assert sub.replay_from(8) == [8, 9]
        assert sub.replay_from(10) == []
        assert sub.batches[9] == [
            9.0,
            [{"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU"}],
            0,
        ]
    finally:
        sub.close()
        publisher.shutdown()


def test_malformed_replay_requests_are_ignored() -> None:
    publisher = _publisher()
    sub = WireSubscriber(publisher.endpoints.pub[0], publisher.endpoints.replay[0])
    try:
        publisher.publish(KVEventBatch(ts=1.0, events=[]))
        assert publisher.wait_sent(WAIT_S)
        sub.dealer.send_multipart([b"", b"\x00\x01"])  # not 8 bytes
        assert sub.replay_from(0) == [0]  # the next request is answered normally
    finally:
        sub.close()
        publisher.shutdown()


def test_every_batch_is_sent_or_counted_dropped() -> None:
    # A queue of one batch: the engine thread never waits, whatever the publisher thread does.
    publisher = _publisher(max_queue_size=1)
    try:
        for i in range(2000):
            publisher.publish(KVEventBatch(ts=float(i), events=[]))
        assert publisher.wait_sent(WAIT_S)
        assert publisher.sent_batches + publisher.dropped_batches == 2000
        assert publisher.sent_batches >= 1
    finally:
        publisher.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(KVEventBatch(ts=0.0, events=[]))
    publisher.shutdown()  # idempotent


def test_a_port_in_use_fails_construction() -> None:
    first = _publisher()
    try:
        taken = first.endpoints.pub[0]
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(endpoint=None, also_bind=[(taken, None)])
    finally:
        first.shutdown()


def test_from_config_binds_wildcards_and_offsets_by_rank() -> None:
    # A wildcard port stays a wildcard under the rank offset; the bound address is reported.
    config = KVEventsConfig(
        enable_kv_cache_events=True, endpoint=LOOPBACK, replay_endpoint=LOOPBACK, topic="t"
    )
    publisher = ZmqEventPublisher.from_config(config, data_parallel_rank=1)
    try:
        (pub,) = publisher.endpoints.pub
        (replay,) = publisher.endpoints.replay
        assert pub.startswith("tcp://127.0.0.1:") and pub != replay
        sub = WireSubscriber(pub, replay)
        publisher.publish(KVEventBatch(ts=2.0, events=[]))
        assert publisher.wait_sent(WAIT_S)
        assert sub.replay_from(0) == [0] and sub.batches[0] == [2.0, [], 1]
        sub.close()
    finally:
        publisher.shutdown()


def test_the_factory_picks_the_publisher_the_config_names() -> None:
    assert isinstance(make_event_publisher(KVEventsConfig()), NullEventPublisher)
    off = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    assert isinstance(make_event_publisher(off), NullEventPublisher)
    on = KVEventsConfig(enable_kv_cache_events=True, endpoint=LOOPBACK)
    publisher = make_event_publisher(on, data_parallel_rank=1)
    try:
        assert isinstance(publisher, ZmqEventPublisher)
    finally:
        publisher.shutdown()
