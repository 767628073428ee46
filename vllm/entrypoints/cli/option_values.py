# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Value parsers of ``vllm-kv-offload run``'s options (the ``type=`` of ``add_argument``).

Each turns one flag's text into its value or raises ``argparse.ArgumentTypeError``, whose
message argparse prefixes with the option's name. ``options.py`` declares the options with them.
Also here: the values a parser's result implies (``default_fs_root``). A redis URL is shown
without its password by the redis tier's own ``redact_url`` (``tiering/redis/redaction.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from vllm.distributed.kv_events import check_endpoint
from vllm.v1.kv_offload.sizes import SizeError
from vllm.v1.kv_offload.sizes import parse_size as parse_size_value

REDIS_URL_SCHEMES = ("redis", "rediss", "unix")


def parse_size(text: str) -> int:
    """Parse a size flag (``4096``, ``64MiB``, ``1.5GB``, ``4e9``) with the one size parser.

    The forms are those of the config keys (``vllm.v1.kv_offload.sizes.SIZE_FORMS``).

    Raises:
        argparse.ArgumentTypeError: not a size of at least one byte.
    """
    try:
        return parse_size_value(text)
    except SizeError as e:
        raise argparse.ArgumentTypeError(f"invalid size {e}") from None


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    # argparse prefixes an ArgumentTypeError's message with the option's name.
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def parse_directory(text: str) -> Path:
    # Path("") is Path("."): an empty --fs-root would silently mean the current directory.
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is empty, which would mean the current directory: name a directory "
            f"(default {default_fs_root()}) or pass --no-fs"
        )
    return Path(text)


def parse_output_file(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: name a file")
    return Path(text)


def default_fs_root() -> Path:
    """``$XDG_CACHE_HOME/vllm-kv-offload`` (``~/.cache/vllm-kv-offload`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "vllm-kv-offload"


def parse_redis_url(text: str) -> str:
    scheme = text.partition("://")[0] if "://" in text else ""
    if scheme not in REDIS_URL_SCHEMES:
        from vllm.v1.kv_offload.tiering.redis.redaction import redact_url

        # Never its password: a URL is shown redacted, a text with user info not at all.
        shown = redact_url(text) if "://" in text else text if "@" not in text else "the value"
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not a redis URL: use redis://HOST:PORT, rediss://HOST:PORT or "
            "unix:///PATH"
        )
    return text


def parse_env_name(text: str) -> str:
    """The name of an environment variable (its value is read when the options are checked)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an environment variable name")
    return text


def parse_secret_file(text: str) -> Path:
    """A file holding a secret (read, and checked to be private, when the options are checked)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: name a file")
    return Path(text)


def parse_zmq_endpoint(text: str) -> str:
    """A ZeroMQ address for the KV event sockets (``tcp://HOST:PORT``, ``ipc://``, ``inproc://``)."""
    try:
        check_endpoint(text, "endpoint")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
