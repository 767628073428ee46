"""Statistics of the scheduler-side offloading connector.

``OffloadingSchedulerMetrics`` owns what ``OffloadingConnectorScheduler`` counts: jobs and blocks
moved, failures, flushes, deferrals, resets and schedule ends, the per-direction transfer totals
the workers report, and the time spent inside manager calls; ``as_dict`` is the flat view that
``OffloadingConnectorScheduler.get_stats()`` returns. It only counts: nothing the connector
decides depends on it.

This module is the home of the connector's metrics: vLLM's ``OffloadingConnectorStats`` (a
``KVConnectorStats``) and the Prometheus metrics belong here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from typing_extensions import ParamSpec

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    TransferStats,
    TransferType,
)

_P = ParamSpec("_P")
_T = TypeVar("_T")

# The counters of ``as_dict``, in the order they are listed there.
_COUNTER_NAMES = (
    "load_jobs",
    "load_blocks",
    "failed_load_jobs",
    "failed_load_blocks",
    "store_jobs",
    "store_blocks",
    "failed_store_jobs",
    "failed_store_blocks",
    "flushed_jobs",
    "deferred_lookups",
    "deferred_stores",
    "stale_completions",
    "cache_resets",
    "lookups_skipped_after_reset",
)


@dataclass(slots=True)
class OffloadingSchedulerMetrics:
    """Cumulative statistics of the scheduler-side connector, since its construction.

    ``reset_cache`` resets none of them. A *block* is one key: one offloaded block of one
    KV-cache group.

    Attributes:
        load_jobs, load_blocks: load jobs created, and the blocks they move.
        failed_load_jobs, failed_load_blocks: load jobs some worker failed, and their blocks.
        store_jobs, store_blocks: store jobs created, and the blocks they move.
        failed_store_jobs, failed_store_blocks: store jobs some worker failed, and their blocks.
        flushed_jobs: jobs the workers were told to finish before a forward pass (counted once
            per step that flushes them).
        deferred_lookups: lookups answered "ask again next step".
        deferred_stores: ``prepare_store`` calls that found no room (offered again next step).
        stale_completions: reports of jobs issued before a ``reset_cache`` (ignored).
        cache_resets: ``reset_cache`` calls.
        lookups_skipped_after_reset: lookups answered "no hit" without asking the manager,
            because jobs issued before a reset were still running.
        schedule_ends: ``manager.on_schedule_end()`` calls (one per step).
        manager_seconds: time spent inside manager calls.
        transfers: per ``(src medium, dst medium)``, the workers' transfer totals, summed over
            ranks (a job run by two ranks counts twice; bytes are the total moved).
    """

    load_jobs: int = 0
    load_blocks: int = 0
    failed_load_jobs: int = 0
    failed_load_blocks: int = 0
    store_jobs: int = 0
    store_blocks: int = 0
    failed_store_jobs: int = 0
    failed_store_blocks: int = 0
    flushed_jobs: int = 0
    deferred_lookups: int = 0
    deferred_stores: int = 0
    stale_completions: int = 0
    cache_resets: int = 0
    lookups_skipped_after_reset: int = 0
    schedule_ends: int = 0
    manager_seconds: float = 0.0
    transfers: dict[TransferType, TransferStats] = field(default_factory=dict)

    def timed(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Call a manager method, adding its duration to ``manager_seconds``."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.manager_seconds += time.perf_counter() - start

    def record_transfers(self, stats: Mapping[TransferType, TransferStats]) -> None:
        """Add one step's worker-reported transfer totals."""
        for transfer_type, step_stats in stats.items():
            self.transfers[transfer_type] = (
                self.transfers.get(transfer_type, TransferStats()) + step_stats
            )

    def as_dict(
        self, jobs_in_flight: int, manager_stats: Mapping[str, int | float] | None
    ) -> dict[str, int | float]:
        """The flat statistics of ``OffloadingConnectorScheduler.get_stats()``.

        Args:
            jobs_in_flight: the connector's jobs not yet reported by every worker.
            manager_stats: the manager's own statistics, prefixed ``manager.``.

        Returns:
            The counters by attribute name, ``jobs_in_flight``, ``schedule_ends``,
            ``manager_seconds``, ``transfer.<SRC>_to_<DST>.{jobs,bytes,seconds}`` per direction,
            then ``manager.<key>`` per manager statistic.
        """
        stats: dict[str, int | float] = {name: getattr(self, name) for name in _COUNTER_NAMES}
        stats["jobs_in_flight"] = jobs_in_flight
        stats["schedule_ends"] = self.schedule_ends
        stats["manager_seconds"] = self.manager_seconds
        for (src, dst), t in self.transfers.items():
            prefix = f"transfer.{src}_to_{dst}"
            stats[f"{prefix}.jobs"] = t.num_jobs
            stats[f"{prefix}.bytes"] = t.num_bytes
            stats[f"{prefix}.seconds"] = t.seconds
        if manager_stats:
            for key, value in manager_stats.items():
                stats[f"manager.{key}"] = value
        return stats
