# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the CPU time per component and the wait for a core (cli/thread_cpu.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from vllm.entrypoints.cli.thread_cpu import (
    FRONT_END,
    ThreadCpuWindow,
    component_of,
    runqueue_wait_s,
)


def test_threads_are_grouped_by_their_names() -> None:
    assert component_of("vllm_engine_core") == "engine thread"
    assert component_of("vllm_fs_tier_fs_read_0") == "fs tier threads"
    assert component_of("vllm_redis_tier_redis_io") == "redis tier threads"
    assert component_of("kvo-host-copy_1") == "host copy threads"
    assert component_of("MainThread") == FRONT_END


@pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="no per-thread clocks")
def test_a_window_counts_a_busy_thread_under_its_component() -> None:
    window = ThreadCpuWindow()
    go, done, release = threading.Event(), threading.Event(), threading.Event()

    def spin() -> None:
        go.wait()
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        done.set()
        release.wait()  # alive until the window closed: an ended thread's clock is gone

    thread = threading.Thread(target=spin, name="vllm_fs_tier_test_write_0")
    thread.start()
    window.start()
    go.set()
    done.wait()
    window.stop()
    release.set()
    thread.join()
    assert window.by_component["fs tier threads"] >= 0.05
    assert "engine thread" not in window.by_component


@pytest.mark.skipif(sys.platform != "linux", reason="the wait for a core is read from /proc")
def test_the_wait_for_a_core_is_the_calling_threads_own() -> None:
    """Each thread reads its own figure, which only grows: a thread that never waited for a
    core (it only sleeps) reads at most what the kernel charged to its wake-ups."""
    readings: list[float | None] = []

    def sleeper() -> None:
        readings.append(runqueue_wait_s())
        time.sleep(0.01)
        readings.append(runqueue_wait_s())

    before = runqueue_wait_s()
    assert before is not None and before >= 0
    thread = threading.Thread(target=sleeper)
    thread.start()
    thread.join()
    first, second = readings
    assert first is not None and second is not None and 0 <= first <= second
    after = runqueue_wait_s()
    assert after is not None and after >= before
