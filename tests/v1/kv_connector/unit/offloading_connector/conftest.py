# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Every engine-based test of the connector runs in both scheduling modes.

Tests of modules that build engines through ``utils.make_config`` are parametrized over
``scheduling_mode`` (``sync`` / ``async``); ``make_config`` picks the mode up, so the test body
needs no change. A test that asserts something only one mode guarantees (e.g. the exact step of a
completion) asks for the ``scheduling_mode`` fixture and branches on it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.v1.kv_connector.unit.offloading_connector import utils


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if getattr(metafunc.module, "make_config", None) is utils.make_config:
        metafunc.parametrize("scheduling_mode", ["sync", "async"], indirect=True)


@pytest.fixture(autouse=True)
def scheduling_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """``"sync"`` or ``"async"``: the ``async_scheduling`` that ``make_config`` defaults to."""
    mode: str = getattr(request, "param", "sync")
    previous = utils.ASYNC_SCHEDULING
    utils.ASYNC_SCHEDULING = mode == "async"
    try:
        yield mode
    finally:
        utils.ASYNC_SCHEDULING = previous
