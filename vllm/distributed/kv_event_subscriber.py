# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ZmqEventSubscriber``: one publisher's KV event batches, in order, gaps replayed.

It speaks the wire of ``vllm.distributed.kv_event_publisher`` (vLLM 0.33's): a SUB socket for
the live stream ``(topic, seq, payload)`` and a DEALER socket for replay requests. Batches come
out of ``receive`` strictly in sequence order, each once:

* a live batch numbered past the next expected one means batches were lost (ZeroMQ drops for a
  slow subscriber, or the subscriber joined late): the subscriber asks the replay socket for
  everything from the first missing number, hands out what comes back in order, then the live
  batch;
* what the replay buffer no longer holds is counted in ``lost`` (the consumer's view of that
  publisher is then incomplete; a router should distrust it, see ``docs/fleet.md``);
* batches already handed out (a replay overlapping the live stream) are skipped.

Because ZeroMQ connects asynchronously, a subscriber started before its publisher's first batch
may still miss the first ones: ``start_seq=0`` (the default) replays from 0 when the first batch
seen is numbered higher. ``catch_up`` asks for anything past the last batch seen (a lost *last*
batch is otherwise invisible until the next one arrives).

Threading: not thread-safe; one thread owns the subscriber (its sockets). ``socket`` is the SUB
socket, for a caller's ``zmq.Poller`` over several publishers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import zmq

from vllm.distributed.kv_event_publisher import END_SEQ
from vllm.distributed.kv_events import KVEventBatch, KVEventDecoder
from vllm.logger import init_logger

logger = init_logger(__name__)

REPLAY_TIMEOUT_S = 2.0
"""How long a replay request waits for each reply frame before giving up."""


@dataclass(frozen=True)
class ReceivedBatch:
    """One batch as received.

    Attributes:
        seq: its sequence number.
        batch: the decoded batch.
        replayed: it came from the replay socket (it had been lost on the live stream).
    """

    seq: int
    batch: KVEventBatch
    replayed: bool


@dataclass
class SubscriberCounters:
    """What a subscriber saw (cumulative).

    Attributes:
        received: batches handed out.
        replayed: of those, batches recovered through replay.
        replay_requests: replay requests sent.
        gaps: gaps seen on the live stream.
        lost: batches neither received nor recoverable (gone from the replay buffer, or no
            replay socket).
        duplicates: batches skipped because they were handed out already.
        malformed: messages dropped because they did not decode.
    """

    received: int = 0
    replayed: int = 0
    replay_requests: int = 0
    gaps: int = 0
    lost: int = 0
    duplicates: int = 0
    malformed: int = 0


class ZmqEventSubscriber:
    """Subscribes to one publisher (see the module docstring).

    Args:
        endpoint: the publisher's PUB address to connect to (e.g. ``tcp://127.0.0.1:5557``).
        replay_endpoint: its ROUTER address, or None (gaps are then only counted).
        topic: the topic prefix to subscribe to ("" for every message).
        start_seq: the first sequence number wanted (replayed if the first batch seen is
            later), or None to start wherever the stream is.
        context: the ZeroMQ context (default: the process's shared one).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        start_seq: int | None = 0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self._decoder = KVEventDecoder()
        self._next: int | None = start_seq
        self.counters = SubscriberCounters()

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The SUB socket (readable when a live batch is waiting)."""
        return self._sub

    @property
    def next_seq(self) -> int | None:
        """The sequence number expected next (None before the first batch without start)."""
        return self._next

    def receive(self, timeout_ms: int = 0) -> list[ReceivedBatch]:
        """Every batch available now, in order, gaps replayed first.

        Args:
            timeout_ms: how long to wait for the first live message (0: do not wait).
        """
        out: list[ReceivedBatch] = []
        if timeout_ms and not self._sub.poll(timeout_ms):
            return out
        while True:
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 3 or len(frames[1]) != 8:
                self.counters.malformed += 1
                continue
            seq = int.from_bytes(frames[1], "big")
            if self._next is not None and seq > self._next:
                self.counters.gaps += 1
                self._replay_into(out, self._next, until=seq)
            self._accept(out, seq, frames[2], replayed=False)

    def catch_up(self) -> list[ReceivedBatch]:
        """Ask the replay socket for anything past the last batch seen (a lost tail)."""
        out: list[ReceivedBatch] = []
        if self._next is not None and self._replay is not None:
            self._replay_into(out, self._next, until=None)
        return out

    def close(self) -> None:
        """Close the sockets (idempotent)."""
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _accept(self, out: list[ReceivedBatch], seq: int, payload: bytes, replayed: bool) -> None:
        if self._next is not None and seq < self._next:
            self.counters.duplicates += 1
            return
        try:
            batch = self._decoder.decode(payload)
        except (ValueError, TypeError):  # msgspec's DecodeError / ValidationError
            self.counters.malformed += 1
            logger.warning("KV event subscriber %s: batch %d does not decode", self.endpoint, seq)
            batch = None
        self._next = seq + 1
        if batch is None:
            return
        out.append(ReceivedBatch(seq, batch, replayed))
        self.counters.received += 1
        if replayed:
            self.counters.replayed += 1

    def _replay_into(self, out: list[ReceivedBatch], start: int, until: int | None) -> None:
        """Replay from ``start``; batches ``< until`` that do not come back are counted lost."""
        replay = self._replay
        got_to = start
        if replay is not None:
            self.counters.replay_requests += 1
            replay.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
            while True:
                if not replay.poll(int(REPLAY_TIMEOUT_S * 1000)):
                    logger.warning(
                        "KV event subscriber %s: no replay answer within %.1f s",
                        self.endpoint,
                        REPLAY_TIMEOUT_S,
                    )
                    # A late answer would be read as the next request's: start afresh.
                    self._reset_replay()
                    break
                frames = replay.recv_multipart()
                if len(frames) != 3:
                    self.counters.malformed += 1
                    continue
                _, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    break
                seq = int.from_bytes(seq_bytes, "big")
                if until is not None and seq >= until:
                    continue  # the live stream hands it out
                if seq > got_to:
                    self._count_lost(got_to, seq)
                    self._next = seq
                self._accept(out, seq, payload, replayed=True)
                got_to = max(got_to, seq + 1)
        if until is not None and got_to < until:
            self._count_lost(got_to, until)
            self._next = until

    def _count_lost(self, start: int, end: int) -> None:
        self.counters.lost += end - start
        logger.warning(
            "KV event subscriber %s: batches %d..%d are lost (not in the replay buffer)",
            self.endpoint,
            start,
            end - 1,
        )

    def _reset_replay(self) -> None:
        assert self._replay is not None and self.replay_endpoint is not None
        with contextlib.suppress(zmq.ZMQError):
            self._replay.close(linger=0)
        self._replay = self._ctx.socket(zmq.DEALER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.connect(self.replay_endpoint)


__all__ = ["ReceivedBatch", "SubscriberCounters", "ZmqEventSubscriber"]
