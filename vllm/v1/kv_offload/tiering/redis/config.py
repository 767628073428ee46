# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Validation of the redis tier's config keys (the ``secondary_tiers`` entry of type "redis").

Every key is checked here, before the tier opens a connection, and every error names the key, the
value and what is allowed; a URL is shown with its password masked (``redaction``), and a secret
read from the environment or a file is never shown. Sizes go through the one size parser of the
package (``vllm.v1.kv_offload.sizes``), so ``max_inflight_bytes`` accepts the same forms as every
other size (``"64MiB"``, ``5e7``, ...).

Credentials can stay out of the config and off command lines (``ps``): ``url_env`` names an
environment variable holding the URL, and ``password_file`` a file (readable by its owner only)
holding the password for a URL without one.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vllm.v1.kv_offload.sizes import SIZE_FORMS, SizeError, parse_size
from vllm.v1.kv_offload.tiering.block_format import IntegrityKey
from vllm.v1.kv_offload.tiering.redis.redaction import Redactor, redact_url, url_password
from vllm.v1.kv_offload.tiering.secret_files import read_private_file

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


def _url(value: Any, key: str = "url") -> str:
    """``value`` checked as a server URL; errors name ``key`` and show the URL redacted."""
    if value is None:
        raise ValueError(
            "redis tier: config key 'url' (or 'url_env') is required (e.g. 'redis://host:6379', "
            "'rediss://host:6380' or 'unix:///run/redis.sock')"
        )
    allowed = f"a URL with scheme {', '.join(s + '://' for s in URL_SCHEMES)}"
    if not isinstance(value, str):
        raise _bad(key, value, allowed)
    shown = redact_url(value)
    try:
        parts = urlsplit(value)
        if parts.scheme != "unix":
            _ = parts.port  # raises ValueError on a malformed port
    except ValueError:
        raise _bad(key, shown, allowed) from None
    if parts.scheme not in URL_SCHEMES:
        raise _bad(key, shown, allowed)
    if parts.scheme == "unix" and not parts.path:
        raise _bad(key, shown, "a unix:// URL with a socket path, e.g. unix:///run/redis.sock")
    if parts.scheme != "unix" and not parts.hostname:
        raise _bad(key, shown, f"{allowed} and a host")
    return value


def _url_from_env(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise _bad("url_env", name, "the name of an environment variable holding the URL")
    value = os.environ.get(name)
    if not value:
        raise ValueError(
            f"redis tier: config key 'url_env': environment variable {name!r} is unset"
        )
    return _url(value, key=f"url_env ({name})")


def _password_from_file(path: Any) -> str:
    """The password in file ``path``: its text, without one trailing newline."""
    if not isinstance(path, str) or not path:
        raise _bad("password_file", path, "the path of a file holding the password")
    raw = read_private_file(path, "redis tier: password_file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"redis tier: password_file {path!r} is not UTF-8 text") from None
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        raise ValueError(f"redis tier: password_file {path!r} is empty")
    return text


@dataclass(frozen=True)
class RedisTierConfig:
    """The redis tier's validated settings.

    Attributes:
        url: the server (or, with ``cluster``, any node of the cluster), credentials included:
            never print it (``redactor.url`` is the printable form).
        password: the password from ``password_file``, or None (then the URL's, if any).
        redactor: masks the credentials in what the tier prints.
        cluster: talk to a Redis Cluster: keys go to the master of their slot (the cluster
            client's slot map), ``MOVED``/``ASK`` redirections are followed once; a TLS or TCP
            URL only.
        namespace: prefix of every key; None means the run's identity (model name and digest of
            the fields that determine a block's bytes), so two models never share keys.
        ttl_s: expiry of every stored block (``SET ... PX``); None stores blocks without expiry
            (then only the server's ``maxmemory`` policy removes them).
        timeout_s: socket connect and read/write timeout of every command; nothing is retried,
            so a round trip that waits longer fails its job after one ``timeout_s`` (and opens
            the circuit breaker).
        max_inflight_bytes: client-side back-pressure: the most bytes of store jobs queued or
            running (a store submitted above it fails at once: the block is just not in Redis),
            and of values in one pipelined round trip (also capped at 32 MiB, see
            ``transfer.MAX_ROUND_BYTES``). At least one block value.
        integrity: the fleet's integrity key (``block_format.IntegrityKey``, from the
            ``integrity_key_env`` or ``integrity_key_file`` key); None: blocks carry CRCs only.
        follow_stores: announce this instance's stores on the namespace's channel and follow
            every writer's (``key_feed``), so that a lookup of a block nobody stored answers in
            the step that asks; false: such lookups wait a step for the server's answer.
    """

    url: str = field(repr=False)
    password: str | None = field(default=None, repr=False)
    redactor: Redactor = field(init=False, repr=False, compare=False)
    cluster: bool = False
    namespace: str | None = None
    ttl_s: float | None = None
    timeout_s: float = 2.0
    max_inflight_bytes: int = 256 << 20
    integrity: IntegrityKey | None = None
    follow_stores: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "redactor", Redactor(self.url, [self.password]))

    @classmethod
    def from_kwargs(
        cls,
        *,
        url: Any = None,
        url_env: Any = None,
        password_file: Any = None,
        cluster: Any = False,
        namespace: Any = None,
        ttl_s: Any = None,
        timeout_s: Any = 2.0,
        max_inflight_bytes: Any = 256 << 20,
        integrity_key_env: Any = None,
        integrity_key_file: Any = None,
        follow_stores: Any = True,
    ) -> RedisTierConfig:
        """Validate raw config values (e.g. decoded JSON); reads the integrity secret.

        Raises:
            ValueError: a missing ``url`` or any invalid value, naming the key (never a secret).
        """
        if url is not None and url_env is not None:
            raise ValueError("redis tier: set one of the config keys 'url' and 'url_env', not both")
        url = _url(url) if url_env is None else _url_from_env(url_env)
        password = None if password_file is None else _password_from_file(password_file)
        if password is not None and url_password(url) is not None:
            raise ValueError(
                "redis tier: the URL carries a password and 'password_file' gives one: set it in "
                "one place"
            )
        shown = redact_url(url)
        if not isinstance(cluster, bool):
            raise _bad("cluster", cluster, "a bool")
        if not isinstance(follow_stores, bool):
            raise _bad("follow_stores", follow_stores, "a bool")
        if cluster and url.startswith("unix:"):
            raise _bad("url", shown, "a redis:// or rediss:// URL with cluster=true")
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
            password=password,
            cluster=cluster,
            namespace=namespace,
            ttl_s=None if ttl_s is None else _seconds("ttl_s", ttl_s),
            timeout_s=_seconds("timeout_s", timeout_s),
            max_inflight_bytes=inflight,
            integrity=IntegrityKey.from_config(
                env=integrity_key_env, file=integrity_key_file, tier="redis"
            ),
            follow_stores=follow_stores,
        )
