# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Validation of the redis tier's config keys (the ``secondary_tiers`` entry of type "redis").

Every key is checked here, before the tier opens a connection, and every error names the key, the
value and what is allowed. Sizes go through the one size parser of the package
(``vllm.v1.kv_offload.sizes``), so ``max_inflight_bytes`` accepts the same forms as every other
size (``"64MiB"``, ``5e7``, ...).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from vllm.v1.kv_offload.sizes import SIZE_FORMS, SizeError, parse_size
from vllm.v1.kv_offload.tiering.block_format import IntegrityKey

URL_SCHEMES = ("redis", "rediss", "unix")
"""Schemes ``url`` may use: TCP, TCP with TLS, and a Unix domain socket."""

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
"""Namespaces are plain text: in particular no ``{`` or ``}``, which would turn part of every key
into a cluster hash tag and put all blocks in one slot (one master)."""


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"redis tier: config key {key!r}={value!r} is invalid: expected {allowed}")


def _seconds(key: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _bad(key, value, "a finite number of seconds > 0")
    return float(value)


def _url(value: Any) -> str:
    if value is None:
        raise ValueError(
            "redis tier: config key 'url' is required (e.g. 'redis://host:6379', "
            "'rediss://host:6380' or 'unix:///run/redis.sock')"
        )
    allowed = f"a URL with scheme {', '.join(s + '://' for s in URL_SCHEMES)}"
    if not isinstance(value, str):
        raise _bad("url", value, allowed)
    try:
        parts = urlsplit(value)
        if parts.scheme != "unix":
            _ = parts.port  # raises ValueError on a malformed port
    except ValueError:
        raise _bad("url", value, allowed) from None
    if parts.scheme not in URL_SCHEMES:
        raise _bad("url", value, allowed)
    if parts.scheme == "unix" and not parts.path:
        raise _bad("url", value, "a unix:// URL with a socket path, e.g. unix:///run/redis.sock")
    if parts.scheme != "unix" and not parts.hostname:
        raise _bad("url", value, f"{allowed} and a host")
    return value


@dataclass(frozen=True)
class RedisTierConfig:
    """The redis tier's validated settings.

    Attributes:
        url: the server (or, with ``cluster``, any node of the cluster).
        cluster: talk to a Redis Cluster: keys go to the master of their slot (the cluster
            client's slot map), ``MOVED``/``ASK`` redirections are followed once; a TLS or TCP
            URL only.
        namespace: prefix of every key; None means the run's identity (model name and digest of
            the fields that determine a block's bytes), so two models never share keys.
        ttl_s: expiry of every stored block (``SET ... PX``); None stores blocks without expiry
            (then only the server's ``maxmemory`` policy removes them).
        timeout_s: socket connect and read/write timeout of every command; a command that takes
            longer fails its job (and opens the circuit breaker).
        max_inflight_bytes: client-side back-pressure: the most bytes of store jobs queued or
            running (a store submitted above it fails at once: the block is just not in Redis),
            and of values in one pipelined round trip (also capped at 32 MiB, see
            ``transfer.MAX_ROUND_BYTES``). At least one block value.
        integrity: the fleet's integrity key (``block_format.IntegrityKey``, from the
            ``integrity_key_env`` or ``integrity_key_file`` key); None: blocks carry CRCs only.
    """

    url: str
    cluster: bool = False
    namespace: str | None = None
    ttl_s: float | None = None
    timeout_s: float = 2.0
    max_inflight_bytes: int = 256 << 20
    integrity: IntegrityKey | None = None

    @classmethod
    def from_kwargs(
        cls,
        *,
        url: Any = None,
        cluster: Any = False,
        namespace: Any = None,
        ttl_s: Any = None,
        timeout_s: Any = 2.0,
        max_inflight_bytes: Any = 256 << 20,
        integrity_key_env: Any = None,
        integrity_key_file: Any = None,
    ) -> RedisTierConfig:
        """Validate raw config values (e.g. decoded JSON); reads the integrity secret.

        Raises:
            ValueError: a missing ``url`` or any invalid value, naming the key (never a secret).
        """
        url = _url(url)
        if not isinstance(cluster, bool):
            raise _bad("cluster", cluster, "a bool")
        if cluster and url.startswith("unix:"):
            raise _bad("url", url, "a redis:// or rediss:// URL with cluster=true")
        if namespace is not None and (
            not isinstance(namespace, str) or _NAMESPACE_RE.match(namespace) is None
        ):
            raise _bad("namespace", namespace, "1 to 128 characters of [A-Za-z0-9._:-]")
        try:
            inflight = parse_size(max_inflight_bytes)
        except SizeError:
            raise _bad("max_inflight_bytes", max_inflight_bytes, SIZE_FORMS) from None
        return cls(
            url=url,
            cluster=cluster,
            namespace=namespace,
            ttl_s=None if ttl_s is None else _seconds("ttl_s", ttl_s),
            timeout_s=_seconds("timeout_s", timeout_s),
            max_inflight_bytes=inflight,
            integrity=IntegrityKey.from_config(
                env=integrity_key_env, file=integrity_key_file, tier="redis"
            ),
        )
