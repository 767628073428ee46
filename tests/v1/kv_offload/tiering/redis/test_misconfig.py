# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A misconfigured tier against real servers: credentials never printed, wrong or missing
passwords and ACL refusals reported as such (once, not retried at full rate, visible in the
stats), OOM refusals counted as failed blocks, a value of the wrong Redis type treated as a
corrupt value, and a stopped server stalling a job for one ``timeout_s``, not two."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_offload.tiering.redis.conftest import (
    Engine,
    assert_shared,
    collect,
    job,
    limited_server,
    pattern,
    seeded_engine,
)
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext

PASSWORD = "S3cretPw-x9"
REDIS_LOGGERS = ("vllm", "redis")


@pytest.fixture
def locked(tmp_path: Path) -> RedisServer:
    srv = RedisServer(tmp_path / "locked", password=PASSWORD)
    yield srv  # type: ignore[misc]
    srv.stop()


@pytest.fixture
def everything(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record of the library and of redis-py, down to DEBUG (what ``-vv`` shows)."""
    for name in REDIS_LOGGERS:
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def _printed(caplog: pytest.LogCaptureFixture, *more: object) -> str:
    """Everything the tier made visible: log lines (with tracebacks), thread names, reprs."""
    lines = [caplog.text, *(t.name for t in threading.enumerate()), *map(repr, more)]
    lines += [str(m) for m in more]
    return "\n".join(lines)


def _acl_count(server: RedisServer, reason: str) -> int:
    """How many refusals of ``reason`` ("auth", "command") the server's ACL LOG holds."""
    client = server.client()
    try:
        return sum(int(e["count"]) for e in client.acl_log() if e["reason"] == reason)
    finally:
        client.close()


def test_the_password_is_never_printed(
    tmp_path: Path, locked: RedisServer, engines: list[Engine], everything: pytest.LogCaptureFixture
) -> None:
    url = f"redis://:{PASSWORD}@127.0.0.1:{locked.port}"
    engine, _, keys = seeded_engine(tmp_path, url, engines, 4)
    tier = engine.tier
    tier.submit_store(job(1, keys, [0, 1, 2, 3], load=False))
    assert collect(engine, {1}) == {1: True}
    # Killed mid-run: the breaker's lines and the failed jobs' lines name the server.
    locked.kill()
    tier.submit_load(job(2, keys[:2], [4, 5], load=True))
    collect(engine, {2})
    locked.start()
    assert tier.wait_reachable(15.0)
    tier.submit_load(job(3, keys[:1], [6], load=True))
    collect(engine, {3})
    assert PASSWORD not in _printed(everything, tier, tier.config, tier.get_stats())
    assert str(locked.port) in everything.text, "the lines name the server"
    assert "server answers again" in everything.text


def test_a_wrong_password_is_an_authentication_failure_logged_once_and_not_retried_fast(
    tmp_path: Path, locked: RedisServer, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    wrong = "not-the-password"
    engine, _, keys = seeded_engine(
        tmp_path, f"redis://:{wrong}@127.0.0.1:{locked.port}", engines, 4
    )
    tier = engine.tier
    for n in range(4):
        tier.submit_store(job(n, keys[n : n + 1], [n], load=False))
    assert collect(engine, {0, 1, 2, 3}) == dict.fromkeys(range(4), False)
    assert tier.breaker_open
    tripped = _acl_count(locked, "auth")
    time.sleep(2.0)  # what the health thread does meanwhile: the assertion, not a synchronisation
    assert _acl_count(locked, "auth") - tripped <= 1, "AUTH retried at full rate"
    lines = [r.getMessage() for r in caplog.records]
    auth = [line for line in lines if "authentication failed" in line]
    assert len(auth) == 1, lines
    assert "unreachable" not in "\n".join(lines)
    assert wrong not in caplog.text
    counters = tier.get_stats().counters
    assert counters["server_answers"] == 0, "the tier never answered"
    assert counters["auth_failures"] >= 1 and counters["store_failed_blocks"] == 4


def test_a_missing_password_is_an_authentication_failure_too(
    tmp_path: Path, locked: RedisServer, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    engine, _, keys = seeded_engine(tmp_path, locked.url, engines, 2)
    ctx = ReqContext("r")
    assert engine.probe(keys, ctx) == [False, False]
    assert engine.tier.breaker_open
    assert sum("authentication failed" in r.getMessage() for r in caplog.records) == 1
    assert engine.tier.get_stats().counters["server_answers"] == 0


def test_url_env_and_password_file_keep_the_password_off_configs(
    tmp_path: Path,
    locked: RedisServer,
    engines: list[Engine],
    monkeypatch: pytest.MonkeyPatch,
    everything: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("KVO_TEST_REDIS_URL", f"redis://:{PASSWORD}@127.0.0.1:{locked.port}")
    by_env = Engine(tmp_path / "env", None, url_env="KVO_TEST_REDIS_URL")
    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD + "\n")  # one trailing newline is not part of it
    secret.chmod(0o600)
    by_file = Engine(tmp_path / "file", locked.url, password_file=str(secret))
    engines += [by_env, by_file]
    assert_shared(by_env, by_file, 2)
    assert PASSWORD not in _printed(everything, by_env.tier, by_file.tier, by_file.tier.config)
    # Refusals name the key, never the password.
    secret.chmod(0o640)
    with pytest.raises(ValueError, match=r"password_file .* other users") as info:
        Engine(tmp_path / "loose", locked.url, password_file=str(secret))
    secret.chmod(0o600)
    with pytest.raises(ValueError, match="one place") as info2:
        Engine(tmp_path / "both", f"redis://:{PASSWORD}@h:1", password_file=str(secret))
    with pytest.raises(ValueError, match="'KVO_NOT_SET' is unset"):
        Engine(tmp_path / "unset", None, url_env="KVO_NOT_SET")
    monkeypatch.setenv("KVO_BAD_URL", f"http://:{PASSWORD}@h:1")
    with pytest.raises(ValueError, match="url_env") as info3:
        Engine(tmp_path / "bad", None, url_env="KVO_BAD_URL")
    for refusal in (info, info2, info3):
        assert PASSWORD not in str(refusal.value)


def test_a_command_the_acl_refuses_is_reported_once_and_not_retried_per_job(
    tmp_path: Path, locked: RedisServer, engines: list[Engine], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.redis")
    admin = locked.client()
    # A user that may read but not write.
    admin.execute_command(
        "ACL", "SETUSER", "reader", "on", ">reader-pw-1", "~*", "+@read", "+del", "+ping",
        "+info", "+dbsize", "-set",
    )  # fmt: skip
    engine, rows, keys = seeded_engine(
        tmp_path, f"redis://reader:reader-pw-1@127.0.0.1:{locked.port}", engines, 4
    )
    tier = engine.tier
    tier.submit_store(job(1, keys[:1], [0], load=False))
    assert collect(engine, {1}) == {1: False}
    refused = _acl_count(locked, "command")
    assert refused >= 1
    for n in range(2, 5):
        tier.submit_store(job(n, keys[n - 1 : n], [n - 1], load=False))
        assert collect(engine, {n}) == {n: False}
    assert _acl_count(locked, "command") == refused, "SET sent again although refused"
    lines = [r.getMessage() for r in caplog.records]
    assert sum("refuses SET" in line for line in lines) == 1, lines
    assert not tier.breaker_open, "reads still work: the tier is not cut off"
    counters = tier.get_stats().counters
    assert counters["permission_refusals"] >= 1 and counters["store_failed_blocks"] == 4
    # What the user may do still works: a value another client stored loads bit-exact.
    writer = Engine(tmp_path / "w", f"redis://:{PASSWORD}@127.0.0.1:{locked.port}")
    engines.append(writer)
    ctx = ReqContext("w")
    writer.manager.on_new_request(ctx)
    writer.store(keys[:1], ctx)
    rows[7] = 0
    tier.submit_load(job(9, keys[:1], [7], load=True))
    assert collect(engine, {9}) == {9: True}
    assert np.array_equal(rows[7], pattern(keys[0]))
    admin.close()


def test_oom_refusals_count_as_failed_blocks(tmp_path: Path, engines: list[Engine]) -> None:
    with limited_server(tmp_path / "full", "2mb", "noeviction") as server:
        engine, _, keys = seeded_engine(tmp_path, server.url, engines, 8)
        engine.tier.submit_store(job(1, keys[:4], list(range(4)), load=False))
        engine.tier.submit_store(job(2, keys[4:], list(range(4, 8)), load=False))
        results = collect(engine, {1, 2})
        counters = engine.tier.get_stats().counters
        assert counters["oom_refusals"] > 0
        failed_jobs = [j for j, ok in results.items() if not ok]
        assert counters["store_failed_blocks"] == 4 * len(failed_jobs) > 0
        assert counters["server_answers"] > 0, "a full server answers"


def test_a_value_of_the_wrong_type_is_a_corrupt_value_deleted_and_counted(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine, rows, keys = seeded_engine(tmp_path, server.url, engines, 2)
    tier = engine.tier
    tier.submit_store(job(1, keys, [0, 1], load=False))
    assert collect(engine, {1}) == {1: True}
    admin = server.client()
    bad = tier.redis_key(keys[0])
    admin.delete(bad)
    admin.rpush(bad, b"not", b"a", b"block")
    tier.submit_load(job(2, keys, [2, 3], load=True))
    assert collect(engine, {2}) == {2: False}
    assert admin.exists(bad) == 0, "the wrong-type value was deleted"
    assert tier.get_stats().counters["corrupt_removed"] == 1
    tier.submit_load(job(3, keys[1:], [4], load=True))  # its neighbour is fine
    assert collect(engine, {3}) == {3: True}
    assert np.array_equal(rows[4], pattern(keys[1]))
    admin.close()


def test_a_stopped_server_stalls_a_job_for_one_timeout(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    engine, _, keys = seeded_engine(tmp_path, server.url, engines, 2)  # timeout_s = 1
    tier = engine.tier
    tier.submit_store(job(1, keys[:1], [0], load=False))  # a pooled connection now exists
    assert collect(engine, {1}) == {1: True}
    admin = server.client()
    admin.client_pause(4000)
    t0 = time.monotonic()
    tier.submit_store(job(2, keys[1:], [1], load=False))
    assert collect(engine, {2}) == {2: False}
    stalled = time.monotonic() - t0
    admin.client_unpause()
    admin.close()
    # One timeout_s (1 s) and scheduling slack; a retry would make it two.
    assert stalled < 1.7, f"the job waited {stalled:.2f} s"
