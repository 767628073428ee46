# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``RedisSecondaryTier``: a secondary tier on a Redis (or Valkey) server or Redis Cluster.

Registered as tier type ``"redis"``. One key per block, ``kvo:<namespace>:<hex of the key>``, whose
value is the shared block format (``tiering.block_format``: a 4 KiB header binding the value to
its key and run, with a CRC-32C of the payload, then the primary row). Several engine instances
pointed at the same server and namespace share their blocks: what one stored, the others find.

With a fleet secret (``integrity_key_env`` / ``integrity_key_file``) every value also carries a
MAC (``block_format.IntegrityKey``) and keys are ``kvo@<key id>:<namespace>:<hex of the key>``:
instances with the same secret share blocks, and a fleet that changes its secret starts on a key
space of its own, where it never reads the old values (they age out by the server's eviction
policy or ``ttl_s``). A value there that does not authenticate is never served: it is deleted and
counted (``forged_removed``: a MAC that does not verify; ``unauthenticated_removed``: a value
written without the key, or with another, which no instance of the fleet writes there).

Capacity belongs to the server (``maxmemory`` and its eviction policy, see docs/redis_tier.md):
the tier never evicts; a block the server evicted is a miss.

Threads:
    * the scheduler thread calls the ``SecondaryTierManager`` methods; they only queue work and
      never touch the network;
    * the lookup thread (``AsyncLookupManager``) resolves each step's lookups with one pipelined
      round trip of ``EXISTS``;
    * the I/O thread runs jobs one at a time, loads before stores (``transfer.BlockTransfer``),
      and announces the blocks it stored (``key_feed``);
    * the feed thread follows what the other writers of the namespace store (``key_feed``), so
      that a lookup of a block nobody stored answers False in the step that asks;
    * the health thread probes an unreachable server and refreshes the server figures.

Guarantees:
    * Never a wrong byte: every loaded value is verified (size, header, key, run, checksum) after
      it is received into its reserved row and before the job reports success; a job that fails
      leaves its rows to the manager, which frees them without serving them.
    * Never blocks the scheduler: while the server is cut off (circuit breaker open:
      unreachable, or refusing the credentials) lookups answer False at once and jobs fail at
      once; otherwise each round trip is bounded by ``timeout_s``; ``shutdown()`` waits at most
      a few ``timeout_s``.
    * Never prints a credential (``redaction``); misconfigurations (a wrong password, an ACL
      refusal) are reported as such, once (``health``).
"""

from __future__ import annotations

import threading
import traceback
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import (
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    TierStats,
    drain_events,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobMetadata, JobResult
from vllm.v1.kv_offload.tiering.block_format import HEADER_SIZE
from vllm.v1.kv_offload.tiering.redis.client import Router, cuts_off
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.health import (
    CircuitBreaker,
    HealthThread,
    PermissionGates,
)
from vllm.v1.kv_offload.tiering.redis.key_feed import KeyFeed
from vllm.v1.kv_offload.tiering.redis.keys import key_prefix
from vllm.v1.kv_offload.tiering.redis.local_view import KnownBlocks
from vllm.v1.kv_offload.tiering.redis.transfer import BlockTransfer, Counters, Outcome
from vllm.v1.kv_offload.tiering.run_identity import RunIdentity
from vllm.v1.kv_offload.tiering.tier_plumbing import (
    AsyncLookupTier,
    check_job_rows,
    primary_view_rows,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import OffloadingSpec

logger = init_logger(__name__)

STORE_BATCH_BYTES = 64 << 20
"""Most bytes of queued store jobs the I/O thread takes as one batch (``store_many``)."""


REDIS_MEDIUM = "STORAGE"
"""``OffloadingEvent.medium`` of the redis tier (vLLM's name for a secondary store)."""
REDIS_LOCALITY = "REMOTE"
"""``OffloadingEvent.locality`` of the redis tier: every instance sharing the server loads it."""


class _RedisLookups(AsyncLookupManager):
    """Answers a whole step's lookups with one pipelined round trip of ``EXISTS``.

    ``EXISTS k1 k2 ...`` would only count, and ``MGET`` would carry the values; pipelined
    single-key ``EXISTS`` answers per key (the cluster client groups them per master).
    """

    def __init__(self, tier: RedisSecondaryTier) -> None:
        self._tier = tier
        super().__init__(tier.tier_type)

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self.step_lookup([(keys, req_context)])[0]

    @override
    def step_lookup(self, groups: list[tuple[list[OffloadKey], ReqContext]]) -> list[list[bool]]:
        return self._tier._probe(groups)


class RedisSecondaryTier(AsyncLookupTier):
    """A secondary tier that keeps each block as one Redis value.

    Ownership: the tier borrows the primary view until ``shutdown()``; its I/O thread reads a row
    only while a store job naming it is in flight (the manager pins the row) and writes a row only
    while a load job naming it is in flight (the manager keeps the row unreadable). Keys under the
    namespace are shared with every instance using it; the tier deletes only values it found
    invalid.

    Tier kwargs (the ``secondary_tiers`` entry of type ``"redis"``; see ``RedisTierConfig``):
        url: ``redis://``, ``rediss://`` or ``unix://``; this or ``url_env`` is required.
        url_env: the name of an environment variable holding the URL (keeps it out of configs
            and command lines).
        password_file: a file (readable by its owner only) holding the password, for a URL
            without one.
        cluster: use Redis Cluster (default false).
        namespace: key namespace (default: the run's identity, ``<model>_<digest>``).
        ttl_s: expiry of stored blocks (default none).
        timeout_s: connect and command timeout (default 2).
        max_inflight_bytes: bytes per round trip and of queued stores (default 256 MiB).
        integrity_key_env, integrity_key_file: where the fleet secret is (an environment
            variable's name, or a file readable by its owner only); default: no MAC.
        follow_stores: announce stores and follow the namespace's (default true; see
            ``RedisTierConfig`` and ``key_feed``).
        enable_events: record ``OffloadingEvent`` s (medium ``"STORAGE"``, locality
            ``"REMOTE"``: every instance sharing the server can load them) for blocks this
            tier stored; removals are not seen (the server evicts and expires keys by itself).

    Raises (construction):
        ValueError: an unknown or invalid config key, a primary view of the wrong shape, or
            ``max_inflight_bytes`` below one value.
        redis.exceptions.RedisError: ``cluster`` and the cluster cannot be reached.
    """

    _STOP_TIMEOUT_FACTOR = 3
    """``shutdown()`` waits for each thread at most this many ``timeout_s`` (a round trip in
    flight is bounded by the socket timeout: a connect, then a read)."""

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str | None = None,
        url_env: str | None = None,
        password_file: str | None = None,
        cluster: bool = False,
        namespace: str | None = None,
        ttl_s: float | None = None,
        timeout_s: float = 2.0,
        max_inflight_bytes: int | str = 256 << 20,
        integrity_key_env: str | None = None,
        integrity_key_file: str | None = None,
        follow_stores: bool = True,
        enable_events: bool = False,
        **tier_kwargs: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, **tier_kwargs)
        if not isinstance(enable_events, bool):
            raise ValueError(f"redis tier: enable_events must be a bool, got {enable_events!r}")
        # Scheduler thread only: events since the last take_events (None: not recorded).
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._config = config = RedisTierConfig.from_kwargs(
            url=url,
            url_env=url_env,
            password_file=password_file,
            cluster=cluster,
            namespace=namespace,
            ttl_s=ttl_s,
            timeout_s=timeout_s,
            max_inflight_bytes=max_inflight_bytes,
            integrity_key_env=integrity_key_env,
            integrity_key_file=integrity_key_file,
            follow_stores=follow_stores,
        )
        view = primary_kv_view
        self._num_rows, self._row_bytes = primary_view_rows(view, "redis")
        self.value_bytes = HEADER_SIZE + self._row_bytes
        if config.max_inflight_bytes < self.value_bytes:
            raise ValueError(
                f"redis tier: max_inflight_bytes={config.max_inflight_bytes} is smaller than one "
                f"value ({self.value_bytes} bytes: a 4 KiB header and one row)"
            )
        # The run's identity, the one the fs tier names its directory with: equal fields,
        # equal namespace.
        identity = RunIdentity.from_spec(offloading_spec, self._row_bytes)
        self.run_digest = identity.digest
        self.namespace = config.namespace or identity.name
        # The tier's printable name, in every log line: credentials masked.
        self._name = f"{tier_type}@{config.redactor.url}"
        self._router = Router(config, self._name)
        self._counters = Counters()
        self._breaker = CircuitBreaker(self._name, config.redactor)
        self._gates = PermissionGates(self._name, config.redactor)
        self._flat: memoryview = view.cast("B")
        prefix = key_prefix(self.namespace, config.integrity)
        self.transfer = BlockTransfer(
            self._router,
            self._flat,
            config,
            row_bytes=self._row_bytes,
            run_digest=self.run_digest,
            key_prefix=prefix,
            breaker=self._breaker,
            gates=self._gates,
            counters=self._counters,
            name=self._name,
        )
        # Server figures for get_stats (keys, used memory, maxmemory or 0), replaced whole by
        # the health thread.
        self._server_figures = (0, 0, 0)
        # Scheduler thread only: jobs submitted and not yet reported.
        self._jobs: dict[int, JobMetadata] = {}
        self._closed = False
        # Scheduler <-> I/O thread, under _cond: queued jobs, results, store bytes queued.
        self._cond = threading.Condition()
        self._loads: deque[JobMetadata] = deque()
        self._stores: deque[JobMetadata] = deque()
        self._results: list[tuple[JobMetadata, Outcome]] = []
        self._store_bytes_queued = 0
        self._running = 0
        self._stopping = False
        self._io_thread = threading.Thread(
            target=self._io_loop, name=f"vllm_redis_tier_{tier_type}_io", daemon=True
        )
        self._lookups = _RedisLookups(self)
        # Blocks known to be on the server (local_view): their lookups answer at once.
        self._known = KnownBlocks(config.ttl_s)
        self._answered_locally = 0
        self._answered_absent = 0
        # What the other writers store, so that the local view knows what is absent too.
        self._feed: KeyFeed | None = None
        if config.follow_stores:
            self._feed = KeyFeed(
                self._router.client,
                prefix,
                self._known,
                self._breaker,
                self._gates,
                config.redactor,
                self._name,
                tier_type,
            )
        self._health = HealthThread(
            tier_type,
            self._breaker,
            ping=self._router.ping,
            refresh_stats=self._refresh_stats,
            probe_masters=self._router.probe_down_masters,
        )
        self._io_thread.start()
        self._health.start()
        if self._feed is not None:
            self._feed.start()
            # Start-up only: the first requests then find the view complete (a fresh namespace
            # is one round trip). Bounded, and cut short when the feed cannot list the keys.
            self._feed.wait_first_listing(config.timeout_s)
        if self._feed is None:
            following = "stores not followed (follow_stores false)"
        elif self._feed.complete:
            following = f"following the namespace's stores ({len(self._known):,} blocks listed)"
        else:
            following = "the namespace's stores not followed yet (lookups ask the server)"
        logger.info(
            "redis tier: %s%s, namespace %s, %d-byte values, ttl %s, timeout %.3g s, "
            "max_inflight_bytes %d, %s; %s",
            config.redactor.url,
            " (cluster)" if config.cluster else "",
            self.namespace,
            self.value_bytes,
            "none" if config.ttl_s is None else f"{config.ttl_s:g} s",
            config.timeout_s,
            config.max_inflight_bytes,
            "blocks not authenticated (CRC only)"
            if config.integrity is None
            else f"blocks authenticated (HMAC-SHA256, key id {config.integrity.key_id.hex()})",
            following,
        )

    # -----------------------------------------------------------------------------------------
    # Introspection (operators, reports)
    # -----------------------------------------------------------------------------------------

    @property
    def config(self) -> RedisTierConfig:
        """The validated configuration."""
        return self._config

    @property
    def integrity_key_id(self) -> bytes | None:
        """The key id of the fleet secret blocks are authenticated with; None without one."""
        return None if self._config.integrity is None else self._config.integrity.key_id

    @property
    def breaker_open(self) -> bool:
        """Whether the server is considered cut off now (unreachable, or refusing the
        credentials)."""
        return self._breaker.is_open

    @property
    def follows_stores(self) -> bool:
        """Whether a lookup of a block this instance does not know answers False at once: the
        tier follows every writer's stores (``key_feed``) and has listed the namespace's keys."""
        return self._feed is not None and self._feed.complete

    def sync_view(self, timeout: float | None = None) -> bool:
        """Block until the tier follows the namespace's stores (``follows_stores``) and its view
        holds every block another instance announced before this call; False on timeout, or
        when the tier cannot follow them (``follow_stores`` false, channels refused, a cluster
        master down)."""
        return self._feed is not None and self._feed.sync(timeout)

    def wait_reachable(self, timeout: float | None = None) -> bool:
        """Block until the circuit breaker is closed (the server answers again, with accepted
        credentials): the wait for what ``breaker_open`` reports; False on timeout."""
        return self._breaker.closed.wait(timeout)

    def redis_key(self, key: OffloadKey) -> bytes:
        """The Redis key that holds block ``key``: what an operator passes to ``redis-cli``
        (``TTL``, ``DEL``, ``CLUSTER KEYSLOT``) to inspect or drop one block."""
        return self.transfer.redis_key(key)

    def stats(self) -> dict[str, int]:
        """Cumulative counters (``transfer.COUNTER_NAMES``, the lookup counters of
        ``AsyncLookupManager.counters`` and the tier's own)."""
        counters = self._counters.snapshot() | self.lookup_counters()
        counters["breaker_trips"] = self._breaker.trips
        counters["auth_failures"] = self._breaker.auth_failures
        counters["permission_refusals"] = self._gates.refusals
        counters["lookups_answered_locally"] = self._answered_locally
        counters["lookups_answered_absent"] = self._answered_absent
        feed = self._feed
        counters["announce_failures"] = 0 if feed is None else feed.announce_failures
        counters["key_listings"] = 0 if feed is None else feed.listings
        return counters

    @override
    def get_stats(self) -> TierStats:
        """Keys, used memory and ``maxmemory`` (None if unlimited) of the server, refreshed every
        few seconds in the background (on a dedicated server the keys are the blocks), one
        value's size, and ``stats()``."""
        num_keys, used_memory, maxmemory = self._server_figures
        return TierStats(
            tier_type=self.tier_type,
            num_blocks=num_keys,
            used_bytes=used_memory,
            block_bytes=self.value_bytes,
            counters=self.stats(),
            capacity_bytes=maxmemory or None,
        )

    def __repr__(self) -> str:
        return f"RedisSecondaryTier({self._config.redactor.url!r}, namespace={self.namespace!r})"

    # -----------------------------------------------------------------------------------------
    # SecondaryTierManager (scheduler thread)
    # -----------------------------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """False at once while the server is cut off; True at once for a block this instance
        knows the server holds (``local_view``); False at once for any other while the tier
        follows the namespace's stores (``key_feed``); otherwise None until this step's batched
        probe answered (a later step), then True/False."""
        if self._breaker.is_open:
            return False
        if self._known.holds(key):
            self._answered_locally += 1  # scheduler thread only
            return True
        feed = self._feed
        if feed is not None and feed.complete:
            self._answered_absent += 1
            return False
        return self._lookups.lookup(key, req_context)

    @override
    def submit_store(self, job: JobMetadata) -> None:
        """Queue the job; fail it at once if the server is unreachable or more than
        ``max_inflight_bytes`` of stores are already queued (back-pressure)."""
        nbytes = len(job.keys) * self.value_bytes
        self._add_job(job)
        with self._cond:
            over = self._store_bytes_queued + nbytes > self._config.max_inflight_bytes
            if self._breaker.is_open or (over and self._store_bytes_queued > 0):
                self._results.append((job, Outcome(False)))
                self._counters.add(stores_dropped=len(job.keys))
                return
            self._store_bytes_queued += nbytes
            self._stores.append(job)
            self._cond.notify()

    @override
    def submit_load(self, job: JobMetadata) -> None:
        """Queue the job (before any queued store); fail it at once while unreachable."""
        self._add_job(job)
        with self._cond:
            if self._breaker.is_open:
                self._results.append((job, Outcome(False, list(job.keys))))
                return
            self._loads.append(job)
            self._cond.notify()

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call; a failed load's keys become lookup misses."""
        with self._cond:
            done, self._results = self._results, []
        results: list[JobResult] = []
        for job, outcome in done:
            submitted = self._jobs.pop(job.job_id, None)
            assert submitted is job, f"redis tier: job {job.job_id} unknown"
            if not outcome.success:
                if job.is_promotion:
                    # Stop requests from retrying blocks the server could not deliver.
                    self._lookups.mark_miss(outcome.failed_keys or job.keys)
                    self._counters.add(load_failed_blocks=len(job.keys))
                else:
                    self._counters.add(store_failed_blocks=len(job.keys))
            elif self._events is not None and not job.is_promotion:
                self._events.append(
                    OffloadingEvent(list(job.keys), REDIS_MEDIUM, False, REDIS_LOCALITY)
                )
            results.append(JobResult(job.job_id, outcome.success))
        return results

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks stored since the last call, one event per store job, in completion order."""
        return drain_events(self._events)

    @override
    def drain_jobs(self) -> None:
        """Block until every queued job finished (each bounded by the command timeouts)."""
        with self._cond:
            self._cond.wait_for(lambda: not (self._loads or self._stores or self._running))

    @override
    def has_pending_work(self) -> bool:
        with self._cond:
            return bool(self._loads or self._stores or self._running)

    @override
    def shutdown(self) -> None:
        """Stop the threads, fail queued jobs, release the primary view and close the
        connections. Idempotent; never waits on the server beyond a few ``timeout_s``.

        A job already running finishes (it holds primary rows and its commands are bounded by
        the socket timeout); queued ones are reported as failed.
        """
        if self._closed:
            return
        self._closed = True
        limit = self._STOP_TIMEOUT_FACTOR * self._config.timeout_s
        self._lookups.shutdown(limit)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._io_thread.join()
        self._health.stop(limit)
        if self._feed is not None:
            self._feed.stop(limit)
        self._flat.release()
        self._router.close()

    # -----------------------------------------------------------------------------------------
    # Internals
    # -----------------------------------------------------------------------------------------

    def _add_job(self, job: JobMetadata) -> None:
        assert job.job_id not in self._jobs, f"redis tier: job {job.job_id} submitted twice"
        if self._closed:
            raise RuntimeError("redis tier: submit after shutdown")
        check_job_rows(job, self._num_rows, "redis")
        self._jobs[job.job_id] = job

    def _io_loop(self) -> None:
        """I/O thread: run queued jobs, loads first; queued stores run together (one batch, up
        to ``STORE_BATCH_BYTES``) and the blocks they stored are announced (``key_feed``) before
        the jobs are reported; on shutdown fail what is still queued."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._loads or self._stores or self._stopping)
                if self._stopping:
                    for job in (*self._loads, *self._stores):
                        self._results.append((job, Outcome(False, list(job.keys))))
                    self._loads.clear()
                    self._stores.clear()
                    self._cond.notify_all()
                    return
                if self._loads:
                    batch = [self._loads.popleft()]
                else:
                    batch = [self._stores.popleft()]
                    nbytes = len(batch[0].keys) * self.value_bytes
                    while self._stores:
                        more = len(self._stores[0].keys) * self.value_bytes
                        if nbytes + more > STORE_BATCH_BYTES:
                            break
                        nbytes += more
                        batch.append(self._stores.popleft())
                self._running += len(batch)
            outcomes = self._run_jobs(batch)
            for job, outcome in zip(batch, outcomes, strict=True):
                if outcome.success:
                    self._known.add(job.keys)
                else:
                    self._known.drop(outcome.failed_keys or job.keys)
            if self._feed is not None and not batch[0].is_promotion:
                # Before the results: a store reported finished is one the others can know of.
                stored = [
                    key
                    for job, outcome in zip(batch, outcomes, strict=True)
                    if outcome.success
                    for key in job.keys
                ]
                if stored:
                    self._feed.announce(stored)
            with self._cond:
                self._running -= len(batch)
                for job, outcome in zip(batch, outcomes, strict=True):
                    if not job.is_promotion:
                        self._store_bytes_queued -= len(job.keys) * self.value_bytes
                    self._results.append((job, outcome))
                self._cond.notify_all()

    def _run_jobs(self, batch: list[JobMetadata]) -> list[Outcome]:
        """One load job, or a batch of store jobs."""
        if self._breaker.is_open:
            for job in batch:
                if not job.is_promotion:
                    self._counters.add(stores_dropped=len(job.keys))
            return [Outcome(False, list(job.keys)) for job in batch]
        try:
            if batch[0].is_promotion:
                (job,) = batch
                return [self.transfer.load(list(job.keys), job.block_ids.tolist())]
            return self.transfer.store_many([(list(j.keys), j.block_ids.tolist()) for j in batch])
        except Exception as e:
            # A bug, not a server error (those are handled in transfer): logged whole, redacted.
            logger.error(
                "redis tier %s: jobs %s failed: %s",
                self._name,
                [job.job_id for job in batch],
                self._config.redactor.error(e),
            )
            logger.debug("%s", self._config.redactor.text("".join(traceback.format_exception(e))))
            return [Outcome(False, list(job.keys)) for job in batch]

    def _probe(self, groups: list[tuple[list[OffloadKey], ReqContext]]) -> list[list[bool]]:
        """Lookup thread: presence of every key of the step, in one pipelined round trip."""
        misses = [[False] * len(keys) for keys, _ in groups]
        if self._breaker.is_open:
            return misses
        flat = [key for keys, _ in groups for key in keys]
        try:
            present = self.transfer.presence(flat)
        except Exception as e:
            if not cuts_off(e):  # the breaker has logged a cut-off
                logger.warning(
                    "redis tier %s: lookup failed: %s", self._name, self._config.redactor.error(e)
                )
            return misses
        self._known.add(k for k, there in zip(flat, present, strict=True) if there)
        self._known.drop(k for k, there in zip(flat, present, strict=True) if not there)
        it = iter(present)
        answers = [[next(it) for _ in keys] for keys, _ in groups]
        self._counters.add(lookups=len(present), lookup_hits=sum(present))
        return answers

    def _refresh_stats(self) -> None:
        """Health thread: the server's key count and memory, for ``get_stats``; raises only
        when the server (every master) is cut off."""
        try:
            self._server_figures = self._router.server_figures()
        except Exception as e:
            if cuts_off(e):
                raise
