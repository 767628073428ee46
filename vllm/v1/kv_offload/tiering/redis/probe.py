# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Probing the server of a redis tier config before a run: does it answer, with our credentials?

A tier pointed at a server it cannot use still runs (every store fails, every lookup misses); a
tool that is about to start a long run wants to refuse instead. ``probe_server`` does what the
tier does when it starts using the server, once, with the tier's own timeouts: connect, ``AUTH``
and ``SELECT`` (through redis-py, and through the tier's own connections of ``direct_io``), then
``PING``. It returns a one-line cause (credentials masked) or None.

Bounded by about two connect timeouts plus two command timeouts (``timeout_s`` each); a cluster
by the cluster client's start-up (its first node's slot map) and one ``PING`` per master until
one answers (the tier serves the keys of the masters that are up).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import redis.exceptions as rexc
from redis.cluster import RedisCluster

from vllm.v1.kv_offload.tiering.redis.client import close_client, make_client
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig
from vllm.v1.kv_offload.tiering.redis.direct_io import DirectConnection, endpoint_from_url


def describe_failure(exc: BaseException, config: RedisTierConfig) -> str:
    """The cause of a failed connection or command in a few words, credentials masked:
    ``connection refused``, ``no such host``, ``authentication failed (...)``, ...."""
    cause = exc.__context__ if exc.__context__ is not None else exc.__cause__
    if isinstance(exc, (rexc.AuthenticationError, rexc.AuthenticationWrongNumberOfArgsError)):
        return f"authentication failed ({config.redactor.text(str(exc))})"
    if isinstance(exc, rexc.NoPermissionError):
        return f"permission denied ({config.redactor.text(str(exc))})"
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, socket.gaierror):
        return "no such host"
    if isinstance(cause, FileNotFoundError):
        return "no such socket"
    if isinstance(exc, rexc.TimeoutError) or isinstance(cause, TimeoutError):
        return f"no answer within {config.timeout_s:g} s"
    return config.redactor.error(exc)


def _ping_some_master(client: RedisCluster) -> None:
    """PING each master; raises the first error unless one answers (the tier serves the keys of
    the masters that are up)."""
    error: Exception | None = None
    for node in client.get_primaries():
        try:
            (node.redis_connection or client.get_redis_connection(node)).ping()
            return
        except rexc.RedisError as e:
            error = error or e
    if error is not None:
        raise error


def probe_server(tier_kwargs: Mapping[str, Any]) -> str | None:
    """Connect to the server ``tier_kwargs`` (a ``secondary_tiers`` entry of type "redis",
    without ``type``) names and ``PING`` it.

    Returns:
        None when the server answers with these credentials; otherwise what went wrong, in one
        line that starts with the server's address (credentials masked), e.g.
        ``"redis://:***@127.0.0.1:6379: authentication failed (invalid username-password
        pair ...)"``.

    Raises:
        ValueError: an invalid config key (as ``RedisTierConfig.from_kwargs``).
    """
    config = RedisTierConfig.from_kwargs(**tier_kwargs)
    where = config.redactor.url
    client = None
    try:
        client = make_client(config)
        if isinstance(client, RedisCluster):
            _ping_some_master(client)
        else:
            client.ping()
            endpoint = endpoint_from_url(config.url, config.password, config.timeout_s)
            if not isinstance(endpoint, str):
                DirectConnection(endpoint).close()  # its own AUTH, SELECT and TLS
    except (rexc.RedisError, rexc.RedisClusterException) as e:
        return f"{where}: {describe_failure(e, config)}"
    except OSError as e:
        return f"{where}: {config.redactor.error(e)}"
    finally:
        close_client(client)
    return None
