# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``BusyClock``: the fs tier's I/O busy time, overlapping operations counted once."""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.tiering.fs import meters
from vllm.v1.kv_offload.tiering.fs.meters import BusyClock


class FakeTime:
    """``time.monotonic`` under the test's control."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(meters.time, "monotonic", fake.monotonic)
    return fake


def test_overlapping_operations_count_once(clock_time: FakeTime) -> None:
    clock = BusyClock()
    a, b = BusyClock.__enter__, BusyClock.__exit__
    a(clock)  # first operation starts at 100
    clock_time.now = 101.0
    a(clock)  # a second one joins at 101
    clock_time.now = 102.0
    b(clock)  # the first ends at 102: still busy
    assert clock.seconds() == pytest.approx(2.0), "the running stretch is included"
    clock_time.now = 103.0
    b(clock)  # the second ends at 103
    assert clock.seconds() == pytest.approx(3.0)
    clock_time.now = 110.0  # idle time does not count
    with clock:
        clock_time.now = 110.5
    assert clock.seconds() == pytest.approx(3.5)


def test_an_operation_that_raises_still_stops_the_clock(clock_time: FakeTime) -> None:
    clock = BusyClock()
    with pytest.raises(OSError), clock:
        clock_time.now = 104.0
        raise OSError("disk gone")
    clock_time.now = 200.0
    assert clock.seconds() == pytest.approx(4.0)
