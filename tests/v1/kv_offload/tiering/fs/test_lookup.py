# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Lookups answered in the step that asks whenever the fs tier can know (issue #26 item 1).

A key the index holds, and, while the instance is the only writer of its run directory, a key
the index lacks, answer at once; only a key the index cannot decide (another writer, a start-up
scan still running) goes to the background probe. The tier counts the requests and keys a lookup
deferred (``get_stats().counters``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemSecondaryTier
from vllm.v1.kv_offload.tiering.fs.scan import RankDirWalker

from .conftest import (
    Primary,
    TierFactory,
    first_lookups,
    key_of,
    load,
    make_spec,
    register_dead_writer,
    resolve_lookups,
    store,
)

FAST: dict[str, Any] = {"reconcile_interval_s": 0.02}
"""Reconcile rounds every 20 ms: the tests that wait for rounds stay quick."""


def _deferred(tier: Any) -> tuple[int, int, int]:
    c = tier.get_stats().counters
    return c["lookup_requests"], c["lookup_deferred_requests"], c["lookup_deferred_keys"]


def test_a_sole_writer_answers_every_lookup_at_once(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier()
    assert tier.sole_writer
    stored, absent = key_of(1), key_of(2)
    assert store(tier, primary, [stored], [0])
    assert first_lookups(tier, [stored, absent]) == [True, False]
    assert first_lookups(tier, [absent, stored], ReqContext("other")) == [False, True]
    assert _deferred(tier) == (2, 0, 0)
    # Warm restart: what the start-up scan found answers at once too.
    tier.shutdown()
    again = make_tier()
    assert again.sole_writer
    assert first_lookups(again, [stored, absent]) == [True, False]
    assert _deferred(again) == (1, 0, 0)


def test_with_another_writer_only_keys_the_index_lacks_are_deferred(
    make_tier: TierFactory, primary: Primary
) -> None:
    b = make_tier()
    # a sees b registered when its start-up scan begins; its reconcile then idles, so only the
    # probe can tell it what b writes.
    a = make_tier(reconcile_interval_s=3600)
    assert not a.sole_writer
    mine, theirs, nobodys = key_of(1), key_of(2), key_of(3)
    assert store(a, primary, [mine], [0])
    assert store(b, primary, [theirs], [1])
    req = ReqContext("r")
    assert [a.lookup(k, req) for k in (mine, theirs, nobodys)] == [True, None, None]
    a.on_schedule_end()
    assert a.wait_lookups_idle(10)
    assert [a.lookup(k, req) for k in (mine, theirs, nobodys)] == [True, True, False]
    a.on_request_finished(req)
    assert _deferred(a) == (1, 1, 2)
    # The probe found b's file: the index holds it now, the next request gets it at once.
    assert first_lookups(a, [theirs]) == [True]
    assert load(a, primary, [theirs], [5]) and primary.holds(5, theirs)
    assert _deferred(a) == (2, 1, 2)


def test_a_writer_that_starts_or_leaves_is_noticed(
    make_tier: TierFactory, primary: Primary
) -> None:
    a = make_tier(**FAST)
    assert a.sole_writer
    b = make_tier(**FAST)
    assert not b.sole_writer
    assert a.wait_reconciled(10), "a's next round lists the writers"
    assert not a.sole_writer
    key = key_of(1)
    assert store(b, primary, [key], [0])
    assert first_lookups(a, [key]) == [None]
    assert resolve_lookups(a, [key]) == [True]
    b.shutdown()
    # One complete pass after the last other writer left, and a is the only writer again.
    assert a.wait_reconciled(10) and a.wait_reconciled(10)
    assert a.sole_writer
    assert first_lookups(a, [key, key_of(2)]) == [True, False]


def test_a_crashed_writer_is_found_gone_and_its_files_reconciled(
    make_tier: TierFactory, primary: Primary
) -> None:
    tier = make_tier(**FAST)
    writers = Path(tier.rank_dir, "writers")
    (own,) = writers.iterdir()
    dead = register_dead_writer(tier)  # what a kill -9 leaves behind
    key = key_of(1)
    assert store(tier, primary, [key], [0])
    # The dead writer's file is removed at the next listing, and one pass reconciles what it
    # may have left (temporary files, claimed slots) before the tier trusts its index again.
    assert tier.wait_reconciled(10) and tier.wait_reconciled(10)
    assert list(writers.iterdir()) == [own] and not dead.exists()
    assert tier.sole_writer
    assert first_lookups(tier, [key, key_of(2)]) == [True, False]


def test_lookups_while_the_start_up_scan_runs_are_deferred(
    make_tier: TierFactory, primary: Primary, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_tier()
    on_disk = key_of(1)
    assert store(first, primary, [on_disk], [0])
    first.shutdown()
    started, release = threading.Event(), threading.Event()
    real_scan = RankDirWalker.scan

    def held_scan(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert release.wait(30)
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(RankDirWalker, "scan", held_scan)
    tier = FileSystemSecondaryTier(
        make_spec(), primary.view, "fs", root_dir=first.config.root_dir, min_free_bytes=0,
        n_read_threads=1, n_write_threads=1, **FAST,
    )  # fmt: skip
    try:
        assert started.wait(10)
        assert not tier.sole_writer, "the index is not complete before the scan ended"
        written = key_of(2)
        assert store(tier, primary, [written], [1])
        assert first_lookups(tier, [written, on_disk, key_of(3)]) == [True, None, None]
        assert resolve_lookups(tier, [on_disk, key_of(3)]) == [True, False]
        release.set()
        assert tier.wait_until_ready(10)
        assert tier.wait_reconciled(10) and tier.sole_writer
        assert first_lookups(tier, [on_disk, key_of(3)]) == [True, False]
    finally:
        release.set()
        tier.shutdown()
