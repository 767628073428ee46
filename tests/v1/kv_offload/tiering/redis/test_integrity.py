# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Keyed integrity on a real server: a fleet with one secret shares blocks; a value made without
the secret is never served, whatever its CRCs say; a fleet that changes its secret misses the old
values without deleting them or calling them forged."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from tests.v1.kv_offload.tiering.key_files import SECRET, key_file
from tests.v1.kv_offload.tiering.redis.conftest import (
    Engine,
    assert_shared,
    key_of,
    pattern,
    written_for,
)
from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.tiering.block_format import (
    HEADER_SIZE,
    KEY_ID_BYTES,
    IntegrityKey,
    encode_block_header,
)


def _writer_and_reader(
    tmp_path: Path, server: RedisServer, engines: list[Engine], reader_secret: bytes = SECRET
) -> tuple[Engine, Engine]:
    writer = Engine(tmp_path / "w", server.url, integrity_key_file=key_file(tmp_path))
    reader = Engine(
        tmp_path / "r",
        server.url,
        integrity_key_file=key_file(tmp_path, reader_secret, "reader.key"),
    )
    engines += [writer, reader]
    return writer, reader


def test_one_secret_one_fleet_blocks_shared_bit_exact(
    tmp_path: Path,
    server: RedisServer,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.kv_offload.tiering.redis")
    writer, reader = _writer_and_reader(tmp_path, server, engines)
    key_id = IntegrityKey(SECRET).key_id
    assert writer.tier.integrity_key_id == reader.tier.integrity_key_id == key_id
    keys = assert_shared(writer, reader, 4)
    rkey = writer.tier.redis_key(keys[0])
    assert rkey.startswith(b"kvo@" + key_id.hex().encode() + b":" + writer.tier.namespace.encode())
    assert f"key id {key_id.hex()}" in caplog.text and "blocks authenticated" in caplog.text
    assert SECRET.decode("latin-1") not in caplog.text


def _forge(tier_value: bytes, payload: np.ndarray, key: bytes, run_digest: bytes) -> bytes:
    """What a writer without the secret can make: a header right in every field (its CRCs
    recomputed) and the fleet's key id, which is public, but a MAC made with another key."""
    row = memoryview(payload.tobytes())
    header = bytearray(
        encode_block_header(key, run_digest, row, integrity=IntegrityKey(b"an attacker's key"))
    )
    at = header.index(IntegrityKey(b"an attacker's key").key_id)
    header[at : at + KEY_ID_BYTES] = tier_value[at : at + KEY_ID_BYTES]  # the fleet's key id
    return bytes(header) + row.tobytes()


def test_a_value_correct_in_every_field_but_its_mac_is_never_served(
    tmp_path: Path,
    server: RedisServer,
    engines: list[Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    writer, reader = _writer_and_reader(tmp_path, server, engines)
    bad, fine = key_of(1), key_of(2)
    ctx = ReqContext("w")
    writer.manager.on_new_request(ctx)
    writer.store([bad, fine], ctx)
    client = server.client()
    rkey = writer.tier.redis_key(bad)
    value = client.get(rkey)
    assert isinstance(value, bytes)
    poison = np.full_like(pattern(bad), 0x41)  # what the attacker wants engines to use
    client.set(rkey, _forge(value, poison, bad, writer.tier.run_digest))

    req = ReqContext("r")
    reader.manager.on_new_request(req)
    assert reader.promote([bad], req) == [False]
    assert client.exists(rkey) == 0, "the forged value was deleted"
    counters = reader.tier.get_stats().counters
    assert counters["forged_removed"] == 1 and counters["corrupt_removed"] == 0
    assert counters["blocks_loaded"] == 0
    assert sum("failed authentication" in r.getMessage() for r in caplog.records) == 1
    assert reader.manager.primary_tier.lookup(bad, req) is not True
    # The authentic block next to it is still served.
    assert reader.promote([fine], req) == [True]
    reader.assert_cpu_holds([fine], req)
    client.close()


def test_a_value_written_without_the_key_is_refused(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    plain = Engine(tmp_path / "p", server.url)  # no secret: the same run, the plain key space
    # Not following stores: it asks the server for every key it does not know, so the value
    # planted below (never announced) is found and loaded.
    keyed = Engine(
        tmp_path / "k", server.url, integrity_key_file=key_file(tmp_path), follow_stores=False
    )
    engines += [plain, keyed]
    key = key_of(7)
    ctx = ReqContext("p")
    plain.manager.on_new_request(ctx)
    plain.store([key], ctx)
    client = server.client()
    value = client.get(plain.tier.redis_key(key))
    assert isinstance(value, bytes) and len(value) == HEADER_SIZE + len(pattern(key))
    # The keyed fleet never looks in the plain key space ...
    req = ReqContext("k")
    keyed.manager.on_new_request(req)
    assert keyed.probe([key], req) == [False]
    keyed.manager.on_request_finished(req)
    # ... and a plain value planted in its own is refused (and, there, deleted).
    client.set(keyed.tier.redis_key(key), value)
    again = ReqContext("k2")
    keyed.manager.on_new_request(again)
    assert keyed.promote([key], again) == [False]
    counters = keyed.tier.get_stats().counters
    assert counters["unauthenticated_removed"] == 1 and counters["forged_removed"] == 0
    assert client.exists(keyed.tier.redis_key(key)) == 0
    assert client.exists(plain.tier.redis_key(key)) == 1, "the plain fleet's value is untouched"
    client.close()


def test_a_fleet_that_changes_its_secret_misses_old_values_without_deleting_them(
    tmp_path: Path, server: RedisServer, engines: list[Engine]
) -> None:
    writer, reader = _writer_and_reader(
        tmp_path, server, engines, reader_secret=b"next year's fleet secret"
    )
    keys, req = written_for(writer, reader, 3)
    assert reader.probe(keys, req) == [False] * 3
    counters = reader.tier.get_stats().counters
    assert counters["forged_removed"] == 0 and counters["unauthenticated_removed"] == 0
    client = server.client()
    assert all(client.exists(writer.tier.redis_key(k)) for k in keys), "old values kept"
    client.close()
    # The new fleet stores its own values (nothing skipped as "already there") and serves them.
    reader.store(keys, req)
    assert reader.tier.get_stats().counters["blocks_written"] == 3
    peer = Engine(
        tmp_path / "p",
        server.url,
        integrity_key_file=key_file(tmp_path, b"next year's fleet secret", "p.key"),
    )
    engines.append(peer)
    later = ReqContext("p")
    peer.manager.on_new_request(later)
    assert peer.promote(keys, later) == [True] * 3
    peer.assert_cpu_holds(keys, later)


def test_a_bad_secret_refuses_the_tier_naming_the_key_not_the_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loose = key_file(tmp_path, name="loose.key", mode=0o644)
    with pytest.raises(ValueError, match=r"redis tier: integrity key file .* other users") as info:
        Engine(tmp_path / "e1", "redis://127.0.0.1:1", integrity_key_file=loose)
    assert "fleet secret" not in str(info.value)
    monkeypatch.setenv("KVO_FLEET_SECRET", "short")
    with pytest.raises(ValueError, match="'KVO_FLEET_SECRET' holds 5 bytes"):
        Engine(tmp_path / "e2", "redis://127.0.0.1:1", integrity_key_env="KVO_FLEET_SECRET")
