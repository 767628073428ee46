# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's key feed: what every writer of the namespace stores, so that a key nobody
stored answers "absent" in the step that asks.

Without it, a lookup of a key the local view (``local_view.KnownBlocks``) does not hold waits a
step for the server's answer; in a run whose prompts are new, every request waits a step. The feed
makes the local view complete:

* every instance announces the keys of the stores it completed on the namespace's channel
  (``PUBLISH <key prefix>stored "<writer> <hex key> <hex key> ..."``, one message per batch of
  store jobs, from the tier's I/O thread);
* the feed thread subscribes to that channel, then lists the namespace's keys (``SCAN``, which
  also forgets the keys the view held that the server no longer has), and from then on adds every
  key another writer announces; it lists the keys again every ``RELIST_S``. The view is
  *complete* from the end of the first listing while the subscription holds and the view has
  dropped no key for its capacity.

While the view is complete, a key it does not hold answers False at once. It can be wrong in
three ways, and none serves a wrong byte: a key another instance stored a moment ago (its
announcement still on its way) is recomputed; so is, until the next listing, a key stored by a
writer that does not announce (``follow_stores`` false, or a version before the feed: set it
alike on every instance of a namespace); a key the server evicted or expired that the view still
holds is a failed load, recomputed (as before the feed). A lost subscription (a server restart, a
killed client; a silent network cut is noticed by the next listing) makes the view incomplete
(lookups wait for the server again) until the feed has subscribed and listed the keys again,
which it retries every ``RETRY_S``. A namespace with more keys than the view's capacity stays
incomplete.

In a Redis Cluster the channel is the cluster's (a ``PUBLISH`` reaches the subscribers of every
node) and a listing asks every master; while a master does not answer, the listing fails and the
view stays incomplete. Channels are not keys: ``SUBSCRIBE`` and ``PUBLISH`` need the ACL's
channel permission; where the server refuses them (logged once, by ``health.PermissionGates``),
the view is never complete and lookups wait for the server as before.

Threading: the feed thread owns its subscription; it writes the local view (under its lock) and
the completeness flag (a bool the scheduler thread reads without a lock). ``announce`` runs on
the tier's I/O thread; ``sync`` on any thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.redis.client import ErrorKind, RedisClient, cuts_off, error_kind
from vllm.v1.kv_offload.tiering.redis.health import GATE_RETRY_S, CircuitBreaker, PermissionGates
from vllm.v1.kv_offload.tiering.redis.keys import block_name, channel_name, parse_block_name
from vllm.v1.kv_offload.tiering.redis.local_view import KnownBlocks
from vllm.v1.kv_offload.tiering.redis.redaction import Redactor

logger = init_logger(__name__)

RELIST_S = 30.0
"""How often the feed lists the namespace's keys again while it follows them: what a writer that
does not announce its stores (``follow_stores`` false, or an older version) stored is found then,
and what the server evicted or expired is forgotten."""
RETRY_S = 1.0
"""How long the feed waits after a lost subscription or a failed listing before trying again."""
POLL_S = 0.25
"""The longest the feed thread waits for a message before it checks whether to stop."""
SCAN_COUNT = 1000
"""Keys the server walks per ``SCAN`` round trip."""
MAX_ANNOUNCED_KEYS = 4096
"""Keys per announcement at most (about 300 KB of message for 36-byte keys)."""
_SYNC = b"sync:"
"""A message that starts so is a marker of ``sync``, not an announcement."""


class KeyFeed:
    """Follows the namespace's stored keys into the local view (see the module docstring).

    Ownership: owns its thread and, while subscribed, one connection of ``client``'s pool;
    writes ``known``. ``breaker`` and ``gates`` are the tier's (shared with its other threads):
    while the breaker is open the feed waits for it to close (the health thread probes the
    server), and credentials the server refuses to the feed trip it.
    """

    def __init__(
        self,
        client: RedisClient,
        key_prefix: bytes,
        known: KnownBlocks,
        breaker: CircuitBreaker,
        gates: PermissionGates,
        redactor: Redactor,
        name: str,
        tier_type: str,
    ) -> None:
        """Args:
        client: the tier's standalone or cluster client (thread-safe; the feed takes one
            connection for the subscription, and sends announcements over the pools).
        key_prefix: what every key of the namespace starts with (``keys.key_prefix``).
        known: the tier's local view, which the feed completes.
        name: the tier's printable name (credentials masked), for the log.
        tier_type: names the thread, ``vllm_redis_tier_<tier_type>_feed``.
        """
        self._client = client
        self._prefix = key_prefix
        self._channel = channel_name(key_prefix)
        self._known = known
        self._breaker = breaker
        self._gates = gates
        self._redactor = redactor
        self._name = name
        # Tells this writer's announcements from others' (its own keys are in the view already).
        self._writer = os.urandom(8).hex().encode()
        self._complete = False
        self._capacity_drops_at_listing = 0
        self._stop = threading.Event()
        # Guards the markers and wakes sync(); also notified when completeness changes. Only
        # this instance's own markers are kept (others' are ignored), until their sync() ends.
        self._cond = threading.Condition()
        self._markers_wanted: set[bytes] = set()
        self._markers_seen: set[bytes] = set()
        self._completeness_lost = 0  # times the view stopped being complete (wakes sync())
        self._attempts_incomplete = 0  # subscriptions, listings that failed or fell short
        self._failures_logged = False
        self._overflow_logged = False
        self.announce_failures = 0
        """Announcements that could not be sent (others then recompute those blocks)."""
        self.listings = 0
        """Listings of the namespace's keys that left the view complete."""
        self._thread = threading.Thread(
            target=self._run, name=f"vllm_redis_tier_{tier_type}_feed", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread; False if it is still inside a round trip after ``timeout_s``."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def complete(self) -> bool:
        """Whether a key the local view does not hold is absent from the server (as far as the
        announcements received say). Scheduler thread; no lock (two attribute reads)."""
        return self._complete and self._known.capacity_drops == self._capacity_drops_at_listing

    def wait_first_listing(self, timeout: float) -> bool:
        """Block until the view is complete, or the feed's first attempt fell short (the server
        cut off, channels refused, a master down, a namespace larger than the view), or
        ``timeout``; True if complete. For start-up, so that the first requests find the view
        complete."""
        with self._cond:
            self._cond.wait_for(lambda: self.complete or self._attempts_incomplete > 0, timeout)
            return self.complete

    def announce(self, keys: Sequence[OffloadKey]) -> None:
        """Tell the other writers that the server holds ``keys`` now (I/O thread, after the
        stores succeeded). A failure is counted, never raised: the others then ask the server,
        or recompute those blocks."""
        if self._gates.is_shut("PUBLISH"):
            self.announce_failures += 1
            return
        try:
            for i in range(0, len(keys), MAX_ANNOUNCED_KEYS):
                chunk = keys[i : i + MAX_ANNOUNCED_KEYS]
                message = b" ".join([self._writer, *map(block_name, chunk)])
                self._client.publish(self._channel, message)
        except Exception as e:
            self.announce_failures += 1
            if error_kind(e) is ErrorKind.PERMISSION:
                self._gates.refused("PUBLISH", e)
            elif not cuts_off(e):  # a cut-off is the breaker's to report
                logger.debug(
                    "redis tier %s: announcing stored keys failed: %s",
                    self._name,
                    self._redactor.error(e),
                )
        else:
            self._gates.allowed("PUBLISH")

    def sync(self, timeout: float | None = None) -> bool:
        """Block until the view is complete and holds every key announced before this call.

        A drain, as ``wait_lookups_idle`` is for lookups: it publishes a marker on the channel and
        waits for the feed to receive it (the server delivers a channel's messages in the order
        it executed the ``PUBLISH`` es). False on timeout, or when the marker could not be sent.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            synced = self._sync_once(deadline)
            if synced is not None:
                return synced
            # The view stopped being complete meanwhile (a lost subscription loses the marker
            # too): publish another once it is complete again.

    def _sync_once(self, deadline: float | None) -> bool | None:
        """One marker of ``sync``: True once seen with the view complete, False on timeout or
        a marker not sent, None if the view stopped being complete meanwhile."""

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        with self._cond:
            if not self._cond.wait_for(lambda: self.complete, left()):
                return False
            lost = self._completeness_lost
        marker = _SYNC + os.urandom(8).hex().encode()
        with self._cond:
            self._markers_wanted.add(marker)
        try:
            self._client.publish(self._channel, marker)
        except Exception as e:
            logger.debug(
                "redis tier %s: sync marker not sent: %s", self._name, self._redactor.error(e)
            )
            with self._cond:
                self._markers_wanted.discard(marker)
            return False
        with self._cond:
            self._cond.wait_for(
                lambda: marker in self._markers_seen or self._completeness_lost != lost, left()
            )
            seen = marker in self._markers_seen
            self._markers_wanted.discard(marker)
            self._markers_seen.discard(marker)
            if self._completeness_lost != lost:
                return None
            return seen and self.complete

    # -----------------------------------------------------------------------------------------
    # Feed thread
    # -----------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._breaker.is_open:
                # Not a synchronisation sleep: the wait for the breaker, cut short every POLL_S
                # to see whether to stop.
                self._breaker.closed.wait(POLL_S)
                continue
            pubsub = self._client.pubsub()
            try:
                self._follow(pubsub)
            except Exception as e:
                with self._cond:
                    self._attempts_incomplete += 1
                    self._cond.notify_all()
                self._report(e)
            finally:
                self._set_complete(False)
                # Closing a dead connection may raise: nothing is left to release then.
                with contextlib.suppress(Exception):
                    pubsub.close()
            # Not a synchronisation sleep: the retry timer, cut short by stop().
            self._stop.wait(GATE_RETRY_S if self._gates.is_shut("SUBSCRIBE") else RETRY_S)

    def _follow(self, pubsub: Any) -> None:
        """Subscribe, list the namespace's keys, then apply announcements until stopped or
        the subscription fails (raises)."""
        pubsub.subscribe(self._channel)
        # The listing must start after the subscription holds, so that no store is missed.
        while not self._stop.is_set():
            message = pubsub.get_message(timeout=POLL_S)
            if message is not None and message["type"] == "subscribe":
                break
        self._gates.allowed("SUBSCRIBE")
        # Followed even when a listing leaves the view incomplete: what others store then still
        # answers "present" at once.
        while not self._stop.is_set():
            complete = self._list_keys()
            # What was announced during the listing is in the socket already: apply it first.
            while self._next_message(pubsub, 0.0):
                pass
            with self._cond:
                self._attempts_incomplete += not complete
            self._set_complete(complete)
            next_listing = time.monotonic() + RELIST_S
            while not self._stop.is_set() and time.monotonic() < next_listing:
                self._next_message(pubsub, POLL_S)

    def _next_message(self, pubsub: Any, timeout: float) -> bool:
        """Apply the next message of the subscription, waiting at most ``timeout`` for one;
        False if none came."""
        message = pubsub.get_message(timeout=timeout)
        if message is None:
            return False
        if message["type"] == "message":
            self._apply(message["data"])
        return True

    def _list_keys(self) -> bool:
        """Put every key of the namespace into the view and forget those the server no longer
        holds. False if the namespace holds more keys than the view can keep (logged), or the
        feed is stopping: the view is then incomplete."""
        started = time.monotonic()
        known = self._known
        drops = known.capacity_drops
        prefix = self._prefix
        batch: list[OffloadKey] = []
        listed = 0
        # The namespace and the key id hold no glob character (config checks the namespace).
        # A cluster client's scan_iter walks every master.
        for rkey in self._client.scan_iter(match=prefix + b"*", count=SCAN_COUNT):
            key = parse_block_name(rkey[len(prefix) :])
            if key is None:
                continue  # another namespace under this one's prefix, or not a block
            batch.append(key)
            listed += 1
            if listed > known.capacity:
                self._log_overflow()
                return False
            if len(batch) >= SCAN_COUNT:
                known.add(batch)
                batch = []
            if self._stop.is_set():
                return False
        known.add(batch)
        known.drop_unconfirmed_since(started)
        if known.capacity_drops != drops:
            self._log_overflow()
            return False
        self._capacity_drops_at_listing = known.capacity_drops
        self.listings += 1
        if self._failures_logged:
            logger.info("redis tier %s: following the namespace's stored keys again", self._name)
            self._failures_logged = False
        return True

    def _apply(self, data: bytes) -> None:
        """One message of the channel: another writer's keys, or a marker of ``sync``."""
        if data.startswith(_SYNC):
            with self._cond:
                if data in self._markers_wanted:
                    self._markers_seen.add(data)
                    self._cond.notify_all()
            return
        writer, _, rest = data.partition(b" ")
        if writer == self._writer:
            return  # this instance's own stores: the I/O thread put them in the view
        keys = [key for key in map(parse_block_name, rest.split()) if key is not None]
        known = self._known
        known.add(keys)
        if self._complete and known.capacity_drops != self._capacity_drops_at_listing:
            self._log_overflow()

    def _log_overflow(self) -> None:
        """Say once that the namespace outgrew the view (it stays incomplete)."""
        if self._overflow_logged:
            return
        self._overflow_logged = True
        logger.info(
            "redis tier %s: the namespace holds more than %d blocks, more than the local view "
            "keeps: lookups of blocks this instance does not know wait a step for the server",
            self._name,
            self._known.capacity,
        )

    def _set_complete(self, complete: bool) -> None:
        with self._cond:
            if self._complete and not complete:
                self._completeness_lost += 1
            self._complete = complete
            self._cond.notify_all()

    def _report(self, e: Exception) -> None:
        if error_kind(e) is ErrorKind.PERMISSION:
            self._gates.refused("SUBSCRIBE", e)  # logged once
            return
        if error_kind(e) is ErrorKind.AUTH:
            # Definitive: the breaker logs it and the health thread retries at its own pace.
            self._breaker.trip(e)
            return
        # A lost subscription alone (a killed client) does not cut the tier off: not tripped.
        if not self._failures_logged and not self._breaker.is_open:
            logger.warning(
                "redis tier %s: lost the namespace's stored keys (%s): lookups of blocks this "
                "instance does not know wait a step for the server until they are followed again",
                self._name,
                self._redactor.error(e),
            )
            self._failures_logged = True
