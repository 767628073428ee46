# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The redis tier's config keys: validation, defaults, the namespace, the factory entry."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_offload.tiering.redis.servers import require_redis_server
from tests.v1.kv_offload.utils import make_cpu_spec
from vllm.v1.kv_offload.base import OffloadKey
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.manager import RedisSecondaryTier
from vllm.v1.kv_offload.tiering.run_identity import run_fields_from_spec

ROW = 64 << 10
# A port nothing listens on: construction must not need the server.
DEAD_URL = "redis://127.0.0.1:1"


@pytest.fixture
def view() -> Iterator[memoryview]:
    mm = mmap.mmap(-1, 4 * ROW)
    v = memoryview(mm).cast("B", (4, ROW))
    yield v
    v.release()
    mm.close()


def _tier(view: memoryview, **kwargs: Any) -> RedisSecondaryTier:
    spec = make_cpu_spec(ROW, 4, **kwargs.pop("_run", {}))
    tier = SecondaryTierFactory.create_secondary_tier({"type": "redis", **kwargs}, view, spec)
    assert isinstance(tier, RedisSecondaryTier)
    return tier


def test_defaults_and_sizes() -> None:
    config = RedisTierConfig.from_kwargs(url="redis://h:6379")
    assert (config.cluster, config.namespace, config.ttl_s) == (False, None, None)
    assert config.timeout_s == 2.0 and config.max_inflight_bytes == 256 << 20
    assert (
        RedisTierConfig.from_kwargs(
            url="unix:///r.sock", max_inflight_bytes="64MiB"
        ).max_inflight_bytes
        == 64 << 20
    )
    assert (
        RedisTierConfig.from_kwargs(url="rediss://h", max_inflight_bytes=5e7).max_inflight_bytes
        == 50_000_000
    )


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({}, r"'url' \(or 'url_env'\) is required"),
        ({"url": "http://h:1"}, "'url'"),
        ({"url": "redis://h:99999"}, "'url'"),
        ({"url": "redis://"}, "'url'"),
        ({"url": "unix://"}, "'url'"),
        ({"url": 6379}, "'url'"),
        ({"url": "unix:///r.sock", "cluster": True}, "'url'"),
        ({"url": "redis://h", "cluster": "yes"}, "'cluster'"),
        ({"url": "redis://h", "namespace": "a{tag}"}, "'namespace'"),
        ({"url": "redis://h", "namespace": ""}, "'namespace'"),
        ({"url": "redis://h", "ttl_s": 0}, "'ttl_s'"),
        ({"url": "redis://h", "ttl_s": float("nan")}, "'ttl_s'"),
        ({"url": "redis://h", "timeout_s": -1}, "'timeout_s'"),
        ({"url": "redis://h", "timeout_s": True}, "'timeout_s'"),
        ({"url": "redis://h", "max_inflight_bytes": "12 parsecs"}, "'max_inflight_bytes'"),
        ({"url": "redis://h", "max_inflight_bytes": 0}, "'max_inflight_bytes'"),
        ({"url": "redis://h", "integrity_key_env": 5}, "'integrity_key_env'"),
        ({"url": "redis://h", "integrity_key_file": ""}, "'integrity_key_file'"),
        (
            {"url": "redis://h", "integrity_key_env": "A", "integrity_key_file": "/k"},
            "'integrity_key_env' and 'integrity_key_file'",
        ),
    ],
)
def test_bad_values_name_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        RedisTierConfig.from_kwargs(**kwargs)


def test_factory_builds_the_tier_without_a_server_and_rejects_unknown_keys(
    view: memoryview,
) -> None:
    assert "redis" in SecondaryTierFactory.known_tier_types()
    with pytest.raises(ValueError, match="redis"):
        _tier(view, url=DEAD_URL, root_dir="/tmp")
    with pytest.raises(ValueError, match="smaller than one value"):
        _tier(view, url=DEAD_URL, max_inflight_bytes=ROW)
    tier = _tier(view, url=DEAD_URL, timeout_s=0.2)
    tier.shutdown()


def test_default_namespace_separates_models_and_geometries(view: memoryview) -> None:
    tiers = [
        _tier(view, url=DEAD_URL),
        _tier(view, url=DEAD_URL),
        _tier(view, url=DEAD_URL, _run={"model_name": "org/other-model"}),
        _tier(view, url=DEAD_URL, _run={"dtype": "bfloat16"}),
        _tier(view, url=DEAD_URL, namespace="shared.ns"),
    ]
    names = [t.namespace for t in tiers]
    for tier in tiers:
        tier.shutdown()
    assert names[0] == names[1] and names[0].startswith("org_test-model_")
    # The fs tier's directory for the same run has the same name (one run identity).
    spec = make_cpu_spec(ROW, 4)
    assert names[0] == FileMapper("/kv", run_fields_from_spec(spec, ROW)).base_name
    assert len({names[0], names[2], names[3]}) == 3
    assert names[4] == "shared.ns"
    assert tiers[4].redis_key(OffloadKey(b"\x01\x02")) == b"kvo:shared.ns:0102"


def test_without_redis_server_tests_skip_with_a_hint_or_fail_under_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server on it
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install redis-server"):
        require_redis_server()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_redis_server()
