# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``redaction``: passwords masked in URLs and in any text the tier prints."""

from __future__ import annotations

import pytest

from vllm.v1.kv_offload.tiering.redis.redaction import Redactor, redact_url, url_password


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:S3cretPw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://alice:S3cretPw@h:6379", "redis://alice:***@h:6379"),
        ("rediss://alice:p%40ss%3Aword@h", "rediss://alice:***@h"),
        ("redis://h:6379?password=S3cretPw&db=2", "redis://h:6379?password=***&db=2"),
        ("rediss://h?ssl_keyfile_password=S3cretPw", "rediss://h?ssl_keyfile_password=***"),
        ("redis://alice@h:6379", "redis://alice@h:6379"),  # a user name is no secret
        ("unix:///run/redis.sock?password=S3cretPw", "unix:///run/redis.sock?password=***"),
        ("redis://h:6379", "redis://h:6379"),
    ],
)
def test_urls_lose_their_passwords(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_url_password_is_found_where_redis_py_would_find_it() -> None:
    assert url_password("redis://:p%40ss@h") == "p@ss"
    assert url_password("redis://h?password=pw") == "pw"
    assert url_password("redis://h") is None


def test_texts_lose_every_known_secret() -> None:
    redactor = Redactor("redis://alice:p%40ssw0rd@h:1", ["from-a-file-pw"])
    assert redactor.url == "redis://alice:***@h:1"
    text = (
        "Error connecting to redis://alice:p%40ssw0rd@h:1 (p@ssw0rd), "
        "AUTH from-a-file-pw failed; alice stays"
    )
    assert (
        redactor.text(text)
        == "Error connecting to redis://alice:***@h:1 (***), AUTH *** failed; alice stays"
    )
    assert redactor.error(ValueError("p@ssw0rd")) == "ValueError: ***"
