# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ZmqEventSubscriber`` against the real publisher on loopback: order, gaps, replay, losses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import zmq

from vllm.distributed.kv_event_publisher import ZmqEventPublisher
from vllm.distributed.kv_event_subscriber import ReceivedBatch, ZmqEventSubscriber
from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

LOOPBACK = "tcp://127.0.0.1:*"
WAIT_S = 10.0


def _batch(i: int) -> KVEventBatch:
    return KVEventBatch(ts=float(i), events=[BlockRemoved([i], "GPU")])


@contextlib.contextmanager
def _publishing(**kwargs: object) -> Iterator[ZmqEventPublisher]:
    """A publisher on loopback (built with ``kwargs``), shut down on exit."""
    publisher = ZmqEventPublisher(endpoint=None, also_bind=[(LOOPBACK, LOOPBACK)], **kwargs)  # type: ignore[arg-type]
    try:
        yield publisher
    finally:
        publisher.shutdown()


def _publish(publisher: ZmqEventPublisher, seqs: range) -> None:
    """Publish the batches ``seqs`` and wait until the publisher has sent them."""
    for i in seqs:
        publisher.publish(_batch(i))
    assert publisher.wait_sent(WAIT_S)


def _subscriber(publisher: ZmqEventPublisher, **kwargs: object) -> ZmqEventSubscriber:
    return ZmqEventSubscriber(
        publisher.endpoints.pub[0],
        publisher.endpoints.replay[0],
        **kwargs,  # type: ignore[arg-type]
    )


def _receive_until(
    publisher: ZmqEventPublisher, sub: ZmqEventSubscriber, first: int
) -> list[ReceivedBatch]:
    """Publish batches ``first, first + 1, ...`` until the subscriber receives one live (ZeroMQ
    subscriptions take effect asynchronously); everything received, in order."""
    got: list[ReceivedBatch] = []
    i = first
    while not any(not r.replayed for r in got):
        assert i < first + 200, "the subscription never took effect"
        publisher.publish(_batch(i))
        i += 1
        got += sub.receive(timeout_ms=50)
    return got


def test_a_late_subscriber_gets_the_missed_batches_by_replay_in_order() -> None:
    with _publishing() as publisher:
        _publish(publisher, range(10))  # before anyone listens: lost to the live stream
        sub = _subscriber(publisher)
        got = _receive_until(publisher, sub, first=10)
        seqs = [r.seq for r in got]
        assert seqs == list(range(len(seqs)))
        assert [r.batch.ts for r in got] == [float(s) for s in seqs]
        assert all(r.replayed for r in got[:10])
        c = sub.counters
        assert c.gaps == 1 and c.replay_requests == 1 and c.lost == 0 and c.replayed >= 10
        assert c.received == len(got) and sub.next_seq == len(got)
        sub.close()


def test_batches_gone_from_the_replay_buffer_are_counted_lost() -> None:
    with _publishing(buffer_steps=3) as publisher:
        _publish(publisher, range(10))
        sub = _subscriber(publisher)
        got = _receive_until(publisher, sub, first=10)
        # The buffer holds at most three batches: the rest before the first live one is lost.
        first_live = next(r.seq for r in got if not r.replayed)
        replayed = [r.seq for r in got if r.replayed]
        assert sub.counters.lost == first_live - len(replayed) >= first_live - 3
        assert [r.seq for r in got] == list(range(sub.counters.lost, got[-1].seq + 1))
        sub.close()


def test_without_a_replay_socket_gaps_are_counted_lost() -> None:
    with _publishing() as publisher:
        _publish(publisher, range(1))
        sub = ZmqEventSubscriber(publisher.endpoints.pub[0], replay_endpoint=None)
        got = _receive_until(publisher, sub, first=1)
        assert sub.counters.lost == got[0].seq and sub.counters.replay_requests == 0
        sub.close()


def test_catch_up_fetches_a_lost_tail() -> None:
    with _publishing() as publisher:
        sub = _subscriber(publisher)
        got = _receive_until(publisher, sub, first=0)
        last = got[-1].seq
        # Sent while the subscriber is not reading, then the stream goes quiet: no later live
        # batch would reveal them, catch_up asks.
        _publish(publisher, range(last + 1, last + 4))
        tail = sub.catch_up()
        assert [r.seq for r in tail] == [last + 1, last + 2, last + 3]
        # The same batches still arrive live: skipped as duplicates, not handed out twice.
        assert sub.receive(timeout_ms=200) == []
        assert sub.counters.duplicates == 3
        sub.close()


def test_malformed_live_messages_are_counted_and_skipped() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = ZmqEventSubscriber(f"tcp://127.0.0.1:{port}", start_seq=None)
        good = b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\x90\xc0"  # [1.0, [], None]
        received: list[ReceivedBatch] = []
        for _ in range(200):
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1"])  # not msgpack
            pub.send_multipart([b"", b"short"])
            pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
            received = sub.receive(timeout_ms=50)
            if received or sub.counters.malformed:
                break
        assert sub.counters.malformed >= 1
        sub.close()
    finally:
        pub.close(linger=0)


@pytest.mark.parametrize("start", [None, 0])
def test_start_seq_none_takes_the_stream_where_it_is(start: int | None) -> None:
    with _publishing() as publisher:
        _publish(publisher, range(5))
        sub = _subscriber(publisher, start_seq=start)
        got = _receive_until(publisher, sub, first=5)
        assert (got[0].seq == 0) is (start == 0)
        assert sub.counters.lost == 0
        sub.close()
