# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Moving blocks between primary rows and Redis: pipelined stores and verified loads.

Runs on the tier's I/O thread only. Each job is split into rounds of at most
``min(max_inflight_bytes, MAX_ROUND_BYTES)`` of values, and each round is ONE pipelined round trip
per server (in a cluster, one per master that owns keys of the round, plus one per node that a
redirection during a resharding or failover sends keys to: ``client.Router``).

* Store: one round of ``EXISTS`` for the job's keys (blocks already in Redis are skipped, their
  bytes never sent), then ``SET key value [PX ttl]`` rounds, each command sent as soon as its
  value's header is made (``direct_io.set_streamed``). A value is the block format's header
  followed by the primary row, sent from the row without a copy (``direct_io``).
* Load: ``GET`` rounds whose values are received straight into the job's primary rows (header
  aside, ``direct_io``), then verified (size, then header, key, run and checksum of the payload:
  ``block_format.verify_parts``, and the MAC with a fleet secret); the rows are reserved for
  the job, and the manager frees the rows of a failed job without serving them. A missing value
  (evicted or expired since the lookup) fails the job and is counted as a server miss; an
  invalid one fails the job, is deleted, counted and logged: ``corrupt_removed`` for accidents
  (CRC, size, key, run), ``forged_removed`` for a MAC that does not verify,
  ``unauthenticated_removed`` for a value without the fleet's MAC in the fleet's key space.

A value of another Redis type under a block's key (``WRONGTYPE``) is a corrupt value of that key:
a miss, deleted, counted. A command the server refuses for this user (``NOPERM``) shuts its gate
(``health.PermissionGates``): the jobs that need it fail at once until it is tried again.

A job succeeds or fails as a whole. Nothing is retried here: a failed load is recomputed by the
connector, a failed store only means the block is absent from Redis.
"""

from __future__ import annotations

import logging
import threading
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import redis.exceptions as rexc

from vllm.logger import init_logger
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.block_format import (
    HEADER_SIZE,
    BlockFileCorrupt,
    BlockForged,
    BlockNotAuthenticated,
    encode_block_header,
    verify_parts,
)
from vllm.v1.kv_offload.tiering.redis.client import (
    BlockValue,
    ErrorKind,
    Router,
    cuts_off,
    error_kind,
)
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.health import CircuitBreaker, PermissionGates
from vllm.v1.kv_offload.tiering.redis.keys import block_name

logger = init_logger(__name__)

MAX_ROUND_BYTES = 32 << 20
"""Most value bytes in one pipelined round trip (also bounded by ``max_inflight_bytes``): the
server holds a pipeline's replies in its output buffer until they are read, unbounded for normal
clients, so a round is kept small; 16 values of 2 MiB already reach full speed."""

COUNTER_NAMES = (
    "blocks_written",
    "blocks_skipped",
    "bytes_written",
    "blocks_loaded",
    "bytes_loaded",
    "server_misses",
    "corrupt_removed",
    "forged_removed",
    "unauthenticated_removed",
    "store_failures",
    "load_failures",
    "store_failed_blocks",
    "load_failed_blocks",
    "stores_dropped",
    "oom_refusals",
    "server_answers",
    "breaker_trips",
    "auth_failures",
    "permission_refusals",
    "lookups",
    "lookup_hits",
)
"""The tier's cumulative counters (``get_stats().counters``); see docs/redis_tier.md. Those the fs
tier also keeps have its names (``blocks_written``, ``blocks_loaded``, ...), which the metrics
(``metrics.report_tier_stats``) and the run report read."""


class Counters:
    """Thread-safe cumulative counters (I/O and lookup threads add, the scheduler reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


@dataclass(slots=True)
class Outcome:
    """What a job did: ``failed_keys`` are keys a load could not deliver (for ``mark_miss``)."""

    success: bool
    failed_keys: list[OffloadKey] = field(default_factory=list)


class BlockTransfer:
    """Stores and loads whole jobs. Owned by the tier; used by its I/O thread only.

    Ownership: ``flat`` is the primary region as one flat byte view, borrowed from the tier; a
    job touches only rows ``[b * row_bytes, (b + 1) * row_bytes)`` of its own block ids, which the
    tiering manager keeps pinned (store) or reserved (load) until the job is reported.

    Args:
        router: sends the rounds.
        flat: the primary rows.
        config: the tier's configuration: the fleet key blocks are authenticated with (if any),
            the TTL of stored blocks, ``max_inflight_bytes`` (bounds a round, with
            ``MAX_ROUND_BYTES``) and the redactor of log messages.
        row_bytes: payload bytes of a value (one primary row).
        run_digest: stamped into every header, checked on every load.
        key_prefix: what every Redis key of the tier starts with (``keys.key_prefix``).
        breaker, gates, counters: the tier's; tripped, shut and counted here.
        name: the tier's printable name, in log lines.
    """

    def __init__(
        self,
        router: Router,
        flat: memoryview,
        config: RedisTierConfig,
        *,
        row_bytes: int,
        run_digest: bytes,
        key_prefix: bytes,
        breaker: CircuitBreaker,
        gates: PermissionGates,
        counters: Counters,
        name: str,
    ) -> None:
        self._router = router
        self._gates = gates
        self._redactor = config.redactor
        self._integrity = config.integrity
        self._flat = flat
        self._row_bytes = row_bytes
        self._run_digest = run_digest
        self._prefix = key_prefix
        # PX takes whole milliseconds; a TTL below one still expires the block.
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._value_bytes = HEADER_SIZE + row_bytes
        max_round_bytes = min(config.max_inflight_bytes, MAX_ROUND_BYTES)
        self._per_round = max(1, max_round_bytes // self._value_bytes)
        self._breaker = breaker
        self._counters = counters
        self._name = name
        self._logged_kinds: set[str] = set()

    def redis_key(self, key: OffloadKey) -> bytes:
        """The Redis key of block ``key``: ``<prefix><hex of the key>`` (``keys.block_name``)."""
        return self._prefix + block_name(key)

    # -----------------------------------------------------------------------------------------
    # Store
    # -----------------------------------------------------------------------------------------

    def store(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> Outcome:
        """Write the blocks Redis does not hold yet; success if every block is there afterwards."""
        return self.store_many([(keys, block_ids)])[0]

    def store_many(
        self, jobs: Sequence[tuple[Sequence[OffloadKey], Sequence[int]]]
    ) -> list[Outcome]:
        """Store several jobs together: one ``EXISTS`` round trip for all their keys, then
        ``SET`` rounds that may span jobs. Each job still succeeds or fails on its own keys.

        Why together: under load every round trip waits for the server to be scheduled, and
        stores queue up exactly then; one presence check per batch instead of per job keeps
        small-block stores close to the raw pipeline's speed.
        """
        blocks: dict[OffloadKey, int] = {}  # a key may repeat within and across jobs
        for keys, block_ids in jobs:
            for key, block_id in zip(keys, block_ids, strict=True):
                blocks.setdefault(key, block_id)
        failed: set[OffloadKey] = set()
        try:
            if self._gates.is_shut("SET"):
                raise _GateShut("SET")
            present = self.presence(list(blocks))
            todo = [
                (k, b) for (k, b), there in zip(blocks.items(), present, strict=True) if not there
            ]
            self._counters.add(blocks_skipped=len(blocks) - len(todo))
            rounds = list(self._rounds(todo))
            for n, chunk in enumerate(rounds):
                try:
                    failed.update(self._set_round(chunk))
                except Exception:
                    # The server went away: nothing after this round is attempted.
                    failed.update(k for later in rounds[n:] for k, _ in later)
                    raise
        except Exception as e:
            self._failed("store", len(blocks), e)
            failed = set(blocks)
        outcomes = [Outcome(not any(key in failed for key in keys)) for keys, _ in jobs]
        self._counters.add(store_failures=sum(not o.success for o in outcomes))
        return outcomes

    def presence(self, keys: list[OffloadKey]) -> list[bool]:
        """Which of ``keys`` the server holds, in one pipelined round trip of ``EXISTS`` (a
        cluster: one per master). Also called by the tier's lookup thread (everything it uses
        is thread-safe).

        A failed ``EXISTS`` (its master is down, the slot moved, the command is refused) is
        "absent"; all are absent while ``EXISTS`` is refused. Raises when the server (every
        master) is cut off, after opening the breaker.
        """
        if self._gates.is_shut("EXISTS"):
            return [False] * len(keys)
        rkeys = [self.redis_key(key) for key in keys]
        try:
            replies = self._router.execute(rkeys, lambda pipe, i: pipe.exists(rkeys[i]))
            self._answered("EXISTS", replies)
        except Exception as e:
            if cuts_off(e):
                self._breaker.trip(e)
            raise
        return [not isinstance(r, Exception) and bool(r) for r in replies]

    def _set_round(self, chunk: list[tuple[OffloadKey, int]]) -> list[OffloadKey]:
        """One pipelined round of SETs; returns the keys whose SET failed (OOM, READONLY, a dead
        master); raises when the whole server is cut off. Each value's header (a checksum
        pass over its row) is made just before the value is sent, so the server stores one value
        while the next is checksummed."""
        rb = self._row_bytes
        rkeys = [self.redis_key(key) for key, _ in chunk]

        def value(i: int) -> BlockValue:
            key, block_id = chunk[i]
            row = self._flat[block_id * rb : (block_id + 1) * rb]
            header = encode_block_header(key, self._run_digest, row, integrity=self._integrity)
            return BlockValue(header, row)

        replies = self._router.set_streamed(rkeys, value, px=self._ttl_ms)
        errors = [r for r in replies if isinstance(r, Exception)]
        stored = len(replies) - len(errors)
        self._counters.add(blocks_written=stored, bytes_written=stored * self._value_bytes)
        self._answered("SET", replies)
        if not errors:
            return []
        self._counters.add(oom_refusals=sum(error_kind(e) is ErrorKind.OOM for e in errors))
        # A dead master's keys fail without a line each (the router logged its state change).
        refusal = next((e for e in errors if not cuts_off(e)), None)
        if refusal is not None:
            self._failed("store", len(errors), refusal)
        return [key for (key, _), r in zip(chunk, replies, strict=True) if isinstance(r, Exception)]

    # -----------------------------------------------------------------------------------------
    # Load
    # -----------------------------------------------------------------------------------------

    def load(self, keys: Sequence[OffloadKey], block_ids: Sequence[int]) -> Outcome:
        """Fill the job's rows from Redis; success only if every value arrived and verified."""
        failed: list[OffloadKey] = []
        pairs = list(zip(keys, block_ids, strict=True))
        try:
            if self._gates.is_shut("GET"):
                raise _GateShut("GET")
            for chunk in self._rounds(pairs):
                failed.extend(self._get_round(chunk))
                if failed:
                    break  # the job fails as a whole: skip the rest of its bytes
        except Exception as e:
            self._failed("load", len(pairs), e)
            self._counters.add(load_failures=1)
            return Outcome(False, [k for k, _ in pairs])
        if failed:
            self._counters.add(load_failures=1)
            return Outcome(False, failed)
        return Outcome(True)

    def _get_round(self, chunk: list[tuple[OffloadKey, int]]) -> list[OffloadKey]:
        """One pipelined round of GETs straight into the chunk's rows; returns the keys that
        failed (missing or invalid). A row is written as its value arrives and verified after,
        like the fs tier's reads: the rows are reserved for this job, and a job that fails leaves
        them to the manager, which frees them without serving them."""
        rb = self._row_bytes
        rkeys = [self.redis_key(key) for key, _ in chunk]
        headers = memoryview(bytearray(HEADER_SIZE * len(chunk)))
        dests = [
            (headers[n * HEADER_SIZE : (n + 1) * HEADER_SIZE], self._flat[b * rb : (b + 1) * rb])
            for n, (_, b) in enumerate(chunk)
        ]
        replies = self._router.get_into(rkeys, dests)
        self._answered("GET", replies)
        failed: list[OffloadKey] = []
        invalid: dict[str, list[bytes]] = {}  # counter name -> Redis keys to delete
        loaded = 0
        for (key, _), reply, (header, row) in zip(chunk, replies, dests, strict=True):
            if reply is None:
                # Evicted or expired between the lookup and now: normal under allkeys-lru.
                self._counters.add(server_misses=1)
                failed.append(key)
                continue
            if isinstance(reply, Exception) and error_kind(reply) is not ErrorKind.WRONGTYPE:
                # The key's command failed (its master is down, the GET was refused, a second
                # redirection): the job fails; a dead master was logged by the router, a
                # refusal by its gate.
                if not cuts_off(reply):
                    self._failed("load", 1, reply)
                failed.append(key)
                continue
            try:
                if isinstance(reply, Exception):  # WRONGTYPE: not a string value, not a block
                    raise BlockFileCorrupt(str(reply))
                if reply is not True:
                    raise BlockFileCorrupt(f"{reply} bytes, expected {self._value_bytes}")
                verify_parts(
                    header, row, key=key, run_digest=self._run_digest, integrity=self._integrity
                )
            except (BlockFileCorrupt, BlockNotAuthenticated) as e:
                if isinstance(e, BlockForged):
                    counter, what = "forged_removed", "failed authentication"
                elif isinstance(e, BlockNotAuthenticated):
                    # In the fleet's own key space (``keys.key_prefix``), where no instance
                    # writes anything but values under its key: garbage or an attack.
                    counter, what = "unauthenticated_removed", "is not authenticated"
                else:
                    counter, what = "corrupt_removed", "is invalid"
                rkey = self.redis_key(key)
                logger.warning(
                    "redis tier %s: value of %s %s (%s); deleted, the load fails",
                    self._name,
                    rkey.decode(),
                    what,
                    e.reason,
                )
                invalid.setdefault(counter, []).append(rkey)
                failed.append(key)
                continue
            loaded += 1
        self._counters.add(blocks_loaded=loaded, bytes_loaded=loaded * rb)
        for counter, invalid_keys in invalid.items():
            if self._delete(invalid_keys):
                self._counters.add(**{counter: len(invalid_keys)})
        return failed

    def _delete(self, redis_keys: list[bytes]) -> bool:
        """Delete invalid values so that no lookup finds them again (best effort); whether the
        round trip succeeded."""
        try:
            self._router.execute(redis_keys, lambda pipe, i: pipe.delete(redis_keys[i]))
        except Exception as e:
            self._failed("delete of invalid values", len(redis_keys), e)
            return False
        return True

    # -----------------------------------------------------------------------------------------
    # Helpers
    # -----------------------------------------------------------------------------------------

    def _rounds(
        self, items: list[tuple[OffloadKey, int]]
    ) -> Iterator[list[tuple[OffloadKey, int]]]:
        n = self._per_round
        for start in range(0, len(items), n):
            yield items[start : start + n]

    def _answered(self, command: str, replies: Sequence[object]) -> None:
        """Account for one round trip of ``command``: raise when the whole server (every master)
        is cut off, so the breaker opens (a cluster whose other masters answered only fails, or
        misses, the keys of the dead one); count the answer; shut or open the command's gate on
        a permission refusal or a success."""
        exc = self._router.all_down(replies)
        if exc is not None:
            raise exc
        self._counters.add(server_answers=1)
        refusal = next(
            (
                r
                for r in replies
                if isinstance(r, Exception) and error_kind(r) is ErrorKind.PERMISSION
            ),
            None,
        )
        if refusal is not None:
            self._gates.refused(command, refusal)
        elif any(not isinstance(r, Exception) for r in replies):
            self._gates.allowed(command)

    def _failed(self, what: str, num_blocks: int, exc: BaseException) -> None:
        kind = error_kind(exc)
        if cuts_off(exc):
            # The breaker logs the state change once; no line per failed job.
            self._breaker.trip(exc)
            return
        if isinstance(exc, _GateShut) or kind is ErrorKind.PERMISSION:
            return  # the gate logged the refusal once
        if isinstance(exc, rexc.RedisError):
            # Refusals (OOM at maxmemory, READONLY, a redirection not followed) can repeat for
            # every job for a while: the first of each kind is a warning, the rest debug. The
            # kind is the error class, or the error code for a plain ResponseError (redis-py
            # strips the code of the errors it has a class for: a MOVED message starts with
            # its slot, which would make every slot a kind of its own).
            name = type(exc).__name__
            if type(exc) is rexc.ResponseError:
                name = str(exc).split(" ", 1)[0]
            level = logging.DEBUG if name in self._logged_kinds else logging.WARNING
            self._logged_kinds.add(name)
            logger.log(
                level,
                "redis tier %s: %s of %d block(s) failed: %s",
                self._name,
                what,
                num_blocks,
                self._redactor.error(exc),
            )
        else:
            logger.error(
                "redis tier %s: %s of %d block(s) failed: %s",
                self._name,
                what,
                num_blocks,
                self._redactor.error(exc),
            )
            logger.debug("%s", self._redactor.text("".join(traceback.format_exception(exc))))


class _GateShut(Exception):
    """A job needs a command whose gate is shut (``health.PermissionGates``): it fails at once."""
