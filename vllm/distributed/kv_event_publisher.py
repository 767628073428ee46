# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ZmqEventPublisher``: KV event batches on ZeroMQ, framed as vLLM 0.33 frames them.

Wire (``docs/fleet.md``):

* PUB socket, one message per batch, three frames: ``topic`` (UTF-8, may be empty), the
  sequence number as 8 bytes big-endian (0, 1, 2, ... for the publisher's whole life), the
  msgpack payload of the ``KVEventBatch``.
* ROUTER socket (optional) for replay: a subscriber that saw a gap sends, through a DEALER (or
  REQ) socket, ``[b"", first missing seq as 8 bytes big-endian]``; the publisher answers
  ``[b"", seq, payload]`` for every batch still buffered from that number on, then the end
  marker ``[b"", (-1) as 8 signed bytes, b""]``. Each reply's first frame is the empty
  delimiter the request carried (where the live stream has the topic). The buffer keeps the
  last ``buffer_steps`` batches.

Threads: the engine thread calls ``publish``, which appends to a bounded deque and, when the
publisher thread may be asleep, writes one byte to a wake pipe; nothing else. The publisher
thread owns both sockets (created, bound and closed there, since ZeroMQ sockets are not
thread-safe), assigns sequence numbers, encodes, sends, keeps the replay buffer and answers
replay requests; it sleeps in ``zmq.Poller`` on the ROUTER socket and the wake pipe. A send
never blocks: PUB drops for a subscriber whose queue reached ``hwm`` (that subscriber sees a gap
and replays); a full deque (``max_queue_size``, the thread starved) drops the batch before it is
numbered and counts it in ``dropped_batches``.

Besides the configured endpoints, the sockets may bind extra ones (``also_bind``, e.g. the
private loopback endpoints a fleet's router subscribes to): one socket, one sequence, every
subscriber sees the same numbers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq
from typing_extensions import override

from vllm.distributed.kv_events import (
    EventBatch,
    EventPublisher,
    KVEventsConfig,
    NullEventPublisher,
    check_endpoint,
    offset_endpoint_port,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay's end marker."""
SHUTDOWN_TIMEOUT_S = 2.0
"""How long ``shutdown`` waits for the queued batches to be sent (then drops them)."""
LINGER_MS = 500
"""How long closing a socket waits to hand queued messages to connected subscribers."""


def binds(endpoint: str) -> bool:
    """Whether vLLM binds (rather than connects) a PUB socket to ``endpoint``.

    vLLM's rule: "bind stable, connect volatile": an address with a wildcard (``*``), ``::``,
    ``ipc://`` or ``inproc://`` is bound, any other (``tcp://10.0.0.5:5557``) is connected to.
    """
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


@dataclass(frozen=True)
class PublisherEndpoints:
    """The addresses a started publisher serves, wildcard ports resolved.

    Attributes:
        pub: PUB addresses bound (connected-to addresses are not listed).
        replay: ROUTER addresses bound.
    """

    pub: tuple[str, ...]
    replay: tuple[str, ...]


class ZmqEventPublisher(EventPublisher):
    """PUB + ROUTER publisher with a replay buffer (see the module docstring).

    Args:
        data_parallel_rank: stamped on batches without one; offsets the endpoints' ports.
        endpoint: the PUB address (bound or connected to, by ``binds``), or None for none
            (only ``also_bind``).
        replay_endpoint: the ROUTER address (bound), or None.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark.
        max_queue_size: batches queued for the publisher thread before drops.
        topic: the first frame of every live message.
        also_bind: extra ``(pub, replay)`` addresses to bind (not offset; a wildcard port is
            resolved, see ``endpoints``); ``replay`` may be None.

    Raises:
        ValueError: a malformed address.
        zmq.ZMQError: an address could not be bound (e.g. the port is in use); nothing is left
            open.
    """

    def __init__(
        self,
        data_parallel_rank: int = 0,
        endpoint: str | None = "tcp://*:5557",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        also_bind: Sequence[tuple[str, str | None]] = (),
    ) -> None:
        super().__init__(data_parallel_rank)
        for address in (endpoint, replay_endpoint, *(a for pair in also_bind for a in pair)):
            if address is not None:
                check_endpoint(address, "kv events endpoint")
        self._endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._also_bind = tuple(also_bind)
        self._topic = topic.encode("utf-8")
        self._hwm = hwm
        self._max_queue = max_queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # Engine thread -> publisher thread.
        self._queue: deque[EventBatch] = deque()
        self._wake_r, self._wake_w = os.pipe()
        self._wake_pending = False
        self._dropped = 0
        self._thread_busy = False
        self._stopping = False
        self._closed = False
        # Publisher thread only.
        self._next_seq = 0
        self._sent = 0
        self._replays = 0
        # Notified by the publisher thread after each drain (``wait_sent``).
        self._drained = threading.Condition()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._endpoints = PublisherEndpoints((), ())
        self._thread = threading.Thread(
            target=self._run, name=f"kv-events-publisher-{data_parallel_rank}", daemon=True
        )
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            self._close_pipe()
            raise self._start_error

    @classmethod
    def from_config(
        cls,
        config: KVEventsConfig,
        data_parallel_rank: int = 0,
        also_bind: Sequence[tuple[str, str | None]] = (),
        use_endpoints: bool = True,
    ) -> ZmqEventPublisher:
        """A publisher with ``config``'s sizes and topic, and its endpoints unless
        ``use_endpoints`` is False (then only ``also_bind``)."""
        return cls(
            data_parallel_rank,
            endpoint=config.endpoint if use_endpoints else None,
            replay_endpoint=config.replay_endpoint if use_endpoints else None,
            buffer_steps=config.buffer_steps,
            hwm=config.hwm,
            max_queue_size=config.max_queue_size,
            topic=config.topic,
            also_bind=also_bind,
        )

    # -----------------------------------------------------------------------------------------
    # Engine thread
    # -----------------------------------------------------------------------------------------

    @override
    def publish(self, batch: EventBatch) -> None:
        if self._stopping:
            raise RuntimeError("the KV event publisher is shut down")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        if len(self._queue) >= self._max_queue:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning(
                    "KV event publisher %d: queue full (%d batches), %d batches dropped so far",
                    self.data_parallel_rank,
                    self._max_queue,
                    self._dropped,
                )
            return
        self._queue.append(batch)
        if not self._wake_pending:
            self._wake_pending = True
            os.write(self._wake_w, b"\0")

    @property
    @override
    def dropped_batches(self) -> int:
        return self._dropped

    @property
    def endpoints(self) -> PublisherEndpoints:
        """The bound addresses, wildcard ports resolved (fixed once constructed)."""
        return self._endpoints

    @property
    def sent_batches(self) -> int:
        """Batches sent so far (the next sequence number)."""
        return self._sent

    @property
    def replays_served(self) -> int:
        """Replay requests answered so far."""
        return self._replays

    def wait_sent(self, timeout_s: float | None = None) -> bool:
        """Block until every batch published so far was sent (or dropped); False on timeout.

        For callers that hand the stream to a reader at a known point (the fleet run's end,
        ``fleet_events``); the engine never calls it.
        """
        with self._drained:
            return self._drained.wait_for(
                lambda: not self._queue and not self._thread_busy, timeout_s
            )

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        self._thread.join(SHUTDOWN_TIMEOUT_S + LINGER_MS / 1000 + 1.0)
        if self._thread.is_alive():
            logger.warning("KV event publisher %d: thread did not stop", self.data_parallel_rank)
            return  # the thread still reads the pipe; it is a daemon and dies with the process
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -----------------------------------------------------------------------------------------
    # Publisher thread
    # -----------------------------------------------------------------------------------------

    def _bind(
        self, ctx: zmq.Context[zmq.Socket[bytes]]
    ) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]:
        pub = ctx.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.setsockopt(zmq.LINGER, LINGER_MS)
        replay: zmq.Socket[bytes] | None = None
        try:
            bound: list[str] = []
            if self._endpoint is not None:
                if binds(self._endpoint):
                    pub.bind(self._endpoint)
                    bound.append(_last_endpoint(pub))
                else:
                    pub.connect(self._endpoint)
            replay_addresses = [self._replay_endpoint] if self._replay_endpoint else []
            for pub_address, replay_address in self._also_bind:
                pub.bind(pub_address)
                bound.append(_last_endpoint(pub))
                if replay_address is not None:
                    replay_addresses.append(replay_address)
            replay_bound: list[str] = []
            if replay_addresses:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, LINGER_MS)
                for address in replay_addresses:
                    replay.bind(address)
                    replay_bound.append(_last_endpoint(replay))
        except BaseException:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)
            raise
        self._endpoints = PublisherEndpoints(tuple(bound), tuple(replay_bound))
        return pub, replay

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            pub, replay = self._bind(ctx)
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if replay is not None and replay in ready:
                    self._serve_replays(replay)
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                    # Cleared before draining: a batch appended after the drain wakes us again.
                    self._wake_pending = False
                    self._drain(pub, encoder)
                if self._stopping:
                    self._drain(pub, encoder)
                    if replay is not None:
                        self._serve_replays(replay)
                    break
        except Exception:
            logger.exception("KV event publisher %d: thread failed", self.data_parallel_rank)
        finally:
            pub.close(linger=LINGER_MS)
            if replay is not None:
                replay.close(linger=LINGER_MS)

    def _drain(self, pub: zmq.Socket[bytes], encoder: msgspec.msgpack.Encoder) -> None:
        queue = self._queue
        self._thread_busy = True
        while queue:
            batch = queue.popleft()
            seq = self._next_seq
            self._next_seq += 1
            payload = encoder.encode(batch)
            self._buffer.append((seq, payload))
            # zmq.Again: a connected peer's queue is full; it sees the gap and replays.
            with contextlib.suppress(zmq.Again):
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self._sent += 1
        with self._drained:
            self._thread_busy = False
            self._drained.notify_all()

    def _serve_replays(self, replay: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                logger.warning(
                    "KV event publisher %d: ignoring a malformed replay request (%d frames)",
                    self.data_parallel_rank,
                    len(frames),
                )
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big", signed=True)
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            # Counted before the end marker goes out: a client that has its whole answer sees
            # it counted (the tests read the count right after a replay).
            self._replays += 1
            replay.send_multipart((client, b"", END_SEQ, b""))


def _last_endpoint(socket: zmq.Socket[bytes]) -> str:
    value = socket.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(value, bytes)
    return value.decode()


__all__ = ["END_SEQ", "PublisherEndpoints", "ZmqEventPublisher", "binds"]


def make_event_publisher(config: KVEventsConfig, data_parallel_rank: int = 0) -> EventPublisher:
    """The publisher ``config`` names, for instance ``data_parallel_rank`` (vLLM's factory)."""
    if not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher(data_parallel_rank)
    return ZmqEventPublisher.from_config(config, data_parallel_rank)
