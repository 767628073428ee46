# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``EventFeed`` on real loopback sockets: two publishers, one index, lag and replay figures."""

from __future__ import annotations

from tests.distributed.kv_event_helpers import block_stored
from vllm.distributed.kv_event_publisher import ZmqEventPublisher
from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch
from vllm.entrypoints.router.event_feed import EventFeed
from vllm.entrypoints.router.prefix_index import Place
from vllm.entrypoints.router.router import prompt_block_hashes
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

LOOPBACK = "tcp://127.0.0.1:*"
WAIT_S = 10.0
HASHES = prompt_block_hashes(list(range(64)), get_request_block_hasher(16))


def _stored(medium: str, n: int, locality: str | None = None) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[block_stored(HASHES[:n], medium, locality)])


def test_the_feed_indexes_every_instance_and_recovers_what_it_missed() -> None:
    pubs = [ZmqEventPublisher(i, endpoint=None, also_bind=[(LOOPBACK, LOOPBACK)]) for i in range(2)]
    try:
        # Published before the feed subscribes: only replay brings these.
        pubs[0].publish(_stored("GPU", 2))
        pubs[1].publish(_stored("STORAGE", 3, "REMOTE"))
        for p in pubs:
            assert p.wait_sent(WAIT_S)
        feed = EventFeed([(p.endpoints.pub[0], p.endpoints.replay[0]) for p in pubs])
        try:
            # The subscriptions take effect asynchronously: publish until both streams show
            # up; each first live batch reveals the gap before it.
            sent = [1, 1]
            for _ in range(200):
                for i, p in enumerate(pubs):
                    p.publish(KVEventBatch(ts=0.0, events=[]))
                    sent[i] += 1
                if all(feed.wait_for(i, sent[i], 0.05) for i in range(2)):
                    break
            stats = feed.stats
            assert stats.lost == [0, 0] and all(r >= 1 for r in stats.replayed)
            m0, m1 = feed.match(HASHES, 16)
            assert m0.tokens[Place.GPU] == 32 and m0.tokens[Place.SHARED_STORAGE] == 16
            assert m1.tokens[Place.SHARED_STORAGE] == 48
            assert m0.from_other == 16 and m1.from_other == 0
            assert stats.max_lag_s[0] > 0  # ts=0.0: a lag of the whole epoch
            pubs[0].publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
            assert feed.wait_for(0, sent[0] + 1, WAIT_S)
            assert feed.match(HASHES, 16)[0].tokens == [0, 0, 0, 48]
        finally:
            feed.stop()
            feed.stop()  # idempotent
    finally:
        for p in pubs:
            p.shutdown()


def test_waiting_for_a_stream_replays_a_tail_the_live_stream_never_showed() -> None:
    # The only batch is published before the feed subscribes: no later batch reveals a gap, so
    # only the tail replay that wait_for asks for can bring it.
    pub = ZmqEventPublisher(0, endpoint=None, also_bind=[(LOOPBACK, LOOPBACK)])
    try:
        pub.publish(_stored("CPU", 2))
        assert pub.wait_sent(WAIT_S)
        feed = EventFeed([(pub.endpoints.pub[0], pub.endpoints.replay[0])])
        try:
            assert feed.wait_for(0, 1, WAIT_S)
            stats = feed.stats
            assert stats.batches == [1] and stats.replayed == [1] and stats.lost == [0]
            assert feed.match(HASHES, 16)[0].tokens[Place.CPU] == 32
        finally:
            feed.stop()
    finally:
        pub.shutdown()
