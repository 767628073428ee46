# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""CPU time of this process's threads, by component, for the report's "CPU seconds" lines, and
the calling thread's wait for a core.

``cpu_by_component`` reads every live Python thread's CPU clock
(``time.pthread_getcpuclockid``: any thread may read another's, without stopping it) and groups
the threads by the name their owner gave them (``COMPONENTS``); what the process used on threads
Python does not know (torch's intra-op threads, a native library's) is the process's CPU time
minus theirs. ``ThreadCpuWindow`` takes the difference between two readings: the CPU each
component used over a run's timed window. A thread that ended inside the window is missed (its
clock is gone with it); the tiers' and the engine's threads live as long as the engine.

Unix only (``time.pthread_getcpuclockid``); elsewhere every reading is empty and the report
says nothing of components.

``runqueue_wait_s`` reads the calling thread's time spent runnable but not running (waiting on
a CPU's run queue for a core, ``/proc/thread-self/schedstat``): with the thread's CPU time it
splits a wall-clock window into on a core, waiting for a core, and blocked (asleep: idle, or
waiting for the GIL or a lock). Linux only; None elsewhere.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine thread", ("vllm_engine_core",)),
    ("fs tier threads", ("vllm_fs_tier_",)),
    ("redis tier threads", ("vllm_redis_tier_",)),
    ("tier lookup threads", ("vllm_offloading_lookup_",)),
    ("host copy threads", ("kvo-host-copy",)),
    ("KV event publisher", ("kv-events-publisher",)),
)
"""Each component's name in the report and the thread-name prefixes of its threads (the names
their owners give them: ``async_llm.py``, the tiers' managers, ``host_copy.py``)."""

FRONT_END = "front end and clients"
"""Every other Python thread (the event loop's, which runs the workload's clients)."""
NATIVE = "native threads (torch etc.)"
"""What the process used on threads Python does not know."""


_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def runqueue_wait_s() -> float | None:
    """Seconds the calling thread has waited on a run queue for a core since it started (the
    second field of ``/proc/thread-self/schedstat``, in nanoseconds); None where the kernel
    does not provide it (not Linux, or built without ``CONFIG_SCHED_INFO``)."""
    try:
        fields = _SCHEDSTAT.read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def component_of(thread_name: str) -> str:
    """The component a thread named ``thread_name`` belongs to (``FRONT_END`` if none)."""
    for component, prefixes in COMPONENTS:
        if thread_name.startswith(prefixes):
            return component
    return FRONT_END


def _thread_cpu_s(thread: threading.Thread) -> float | None:
    ident = thread.ident
    if ident is None:
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError):
        return None  # the thread ended meanwhile, or the platform has no per-thread clocks


def read_thread_cpu() -> dict[int, tuple[str, float]]:
    """Every live Python thread's CPU seconds so far, by ``ident``, with its component."""
    readings: dict[int, tuple[str, float]] = {}
    for thread in threading.enumerate():
        cpu = _thread_cpu_s(thread)
        if cpu is not None and thread.ident is not None:
            readings[thread.ident] = (component_of(thread.name), cpu)
    return readings


@dataclass
class ThreadCpuWindow:
    """CPU seconds per component between ``start`` and ``stop`` (any one thread calls both).

    Attributes:
        by_component: after ``stop``: seconds per component (``COMPONENTS``' names,
            ``FRONT_END``, ``NATIVE``), only those that used any; empty where per-thread clocks
            are unavailable.
    """

    by_component: dict[str, float] = field(default_factory=dict)
    _threads: dict[int, tuple[str, float]] = field(default_factory=dict)
    _process: float = 0.0

    def start(self) -> None:
        """Read every clock: the window opens."""
        self._threads = read_thread_cpu()
        self._process = time.process_time()

    def stop(self) -> None:
        """Read every clock again and fill ``by_component`` (threads started inside the window
        count from 0)."""
        process = time.process_time() - self._process
        totals: dict[str, float] = {}
        for ident, (component, cpu) in read_thread_cpu().items():
            before = self._threads.get(ident)
            # A new thread reusing an ended one's ident counts from its own start.
            used = cpu - before[1] if before is not None and before[1] <= cpu else cpu
            totals[component] = totals.get(component, 0.0) + used
        if not totals:
            self.by_component = {}
            return
        totals[NATIVE] = max(process - sum(totals.values()), 0.0)
        self.by_component = {c: round(s, 4) for c, s in totals.items() if s > 0.0005}
