# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``EventFeed``: the instances' published KV events into one ``PrefixIndex``, on a thread.

One ``ZmqEventSubscriber`` per instance (its PUB and replay endpoints), all read by one thread
that sleeps in ``zmq.Poller`` and applies every batch, in each instance's sequence order, to the
index. A batch is credited to the instance whose stream it came from (its index in
``endpoints``), whatever ``data_parallel_rank`` it carries. When an instance's stream lost
batches the replay buffer no longer had, the index forgets what that instance announced (it can
no longer be trusted), and rebuilds from the batches that follow. A caller that knows how many
batches an instance sent (``wait_for``) has the thread replay a stream's tail while it is behind:
a last batch the live stream never showed (published before the subscription took effect)
leaves no gap for a later batch to reveal.

Threading: the feed thread owns the sockets and writes the index; ``match`` (any thread) reads
it under the same lock. ``stats`` is a snapshot.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import zmq

from vllm.distributed.kv_event_subscriber import ReceivedBatch, ZmqEventSubscriber
from vllm.distributed.kv_events import ExternalBlockHash
from vllm.entrypoints.router.prefix_index import PrefixIndex, PrefixMatch
from vllm.logger import init_logger

logger = init_logger(__name__)

TAIL_CATCH_UP_S = 0.5
"""How long ``EventFeed.wait_for`` waits for a stream before asking for a replay of its tail."""


@dataclass
class FeedStats:
    """What the feed received, per instance (lists indexed by instance).

    Attributes:
        batches: batches applied.
        events: events applied.
        replayed: batches recovered through replay.
        replay_requests: replay requests sent.
        lost: batches neither received nor recoverable.
        last_lag_s: wall-clock time between the last batch's ``ts`` and its application.
        max_lag_s: the largest such lag seen.
        lag_sum_s: the lags added up (mean: ``lag_sum_s / batches``).
    """

    batches: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    replayed: list[int] = field(default_factory=list)
    replay_requests: list[int] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)
    last_lag_s: list[float] = field(default_factory=list)
    max_lag_s: list[float] = field(default_factory=list)
    lag_sum_s: list[float] = field(default_factory=list)

    @classmethod
    def zeros(cls, n: int) -> FeedStats:
        return cls(*([0] * n for _ in range(5)), *([0.0] * n for _ in range(3)))  # type: ignore[arg-type]


class EventFeed:
    """Subscribes to every instance and keeps the prefix index (see the module docstring).

    Args:
        endpoints: per instance, its ``(pub, replay)`` addresses to connect to.
        topic: the topic prefix to subscribe to.
    """

    def __init__(self, endpoints: Sequence[tuple[str, str | None]], topic: str = "") -> None:
        self.num_instances = len(endpoints)
        self.index = PrefixIndex(self.num_instances)
        self._lock = threading.Lock()
        self._stats = FeedStats.zeros(self.num_instances)
        self._subs = [ZmqEventSubscriber(pub, replay, topic) for pub, replay in endpoints]
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._applied = threading.Condition(self._lock)
        self._tail_wanted: set[int] = set()  # instances whose tail to replay (under _lock)
        self._thread = threading.Thread(target=self._run, name="kv-events-feed", daemon=True)
        self._thread.start()

    def match(
        self,
        block_hashes: Sequence[ExternalBlockHash],
        hash_block_size: int,
        on_gpu: Sequence[Container[ExternalBlockHash]] | None = None,
    ) -> list[PrefixMatch]:
        """``PrefixIndex.match`` under the feed's lock."""
        with self._lock:
            return self.index.match(block_hashes, hash_block_size, on_gpu)

    @property
    def stats(self) -> FeedStats:
        """A snapshot of the counters."""
        with self._lock:
            s = self._stats
            return FeedStats(*(list(getattr(s, f)) for f in FeedStats.__dataclass_fields__))

    def wait_for(self, instance: int, batches: int, timeout_s: float) -> bool:
        """Block until ``instance``'s stream reached ``batches`` batches (received or lost);
        False on timeout. For a caller that knows how many a publisher sent.

        A batch published before the subscription took effect is not on the live stream, and
        a lost *last* batch leaves no gap for a later one to reveal: while the stream is
        behind, the feed thread is asked every ``TAIL_CATCH_UP_S`` to replay its tail.
        """
        deadline = time.monotonic() + timeout_s

        def reached() -> bool:
            return self._stats.batches[instance] + self._stats.lost[instance] >= batches

        with self._applied:
            while not reached():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if self._applied.wait_for(reached, min(left, TAIL_CATCH_UP_S)):
                    return True
                self._tail_wanted.add(instance)
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"\1")
            return True

    def stop(self) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")
        self._thread.join()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for sub in self._subs:
            poller.register(sub.socket, zmq.POLLIN)
        try:
            while not self._stopping:
                ready = dict(poller.poll())
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                with self._lock:
                    tails, self._tail_wanted = self._tail_wanted, set()
                for i, sub in enumerate(self._subs):
                    if sub.socket in ready:
                        self._apply(i, sub, sub.receive())
                    if i in tails:
                        self._apply(i, sub, sub.catch_up())
        except Exception:
            logger.exception("KV event feed: thread failed; routing goes on without new events")
        finally:
            for sub in self._subs:
                sub.close()

    def _apply(self, i: int, sub: ZmqEventSubscriber, received: list[ReceivedBatch]) -> None:
        lost_before = self._stats.lost[i]
        now = time.time()
        with self._applied:
            s = self._stats
            if sub.counters.lost > lost_before:
                self.index.clear(i)
            for r in received:
                self.index.apply(i, r.batch)
                lag = max(0.0, now - r.batch.ts)
                s.batches[i] += 1
                s.events[i] += len(r.batch.events)
                s.last_lag_s[i] = lag
                s.max_lag_s[i] = max(s.max_lag_s[i], lag)
                s.lag_sum_s[i] += lag
            s.replayed[i] = sub.counters.replayed
            s.replay_requests[i] = sub.counters.replay_requests
            s.lost[i] = sub.counters.lost
            self._applied.notify_all()
