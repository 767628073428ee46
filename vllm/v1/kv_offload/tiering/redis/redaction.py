# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Keeping the redis tier's credentials out of everything it prints.

The tier's name (in every log line), its repr, its start-up line and every exception text it logs
go through here: ``redact_url`` replaces the password of a URL (userinfo or a ``password``-like
query argument) with ``***``; ``Redactor`` also replaces each known secret (the password however
it was given: in the URL, from ``url_env`` or from ``password_file``) wherever it appears in a
text, e.g. inside an exception message that a library built from the URL. The usernames stay: they
say which ACL user is in use and are no secret.

Pure functions and an immutable object: thread-safe.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

MASK = "***"
_SECRET_QUERY_RE = re.compile(r"pass|secret|token|credential", re.IGNORECASE)
_MIN_SECRET_CHARS = 3
"""Shorter "secrets" are not searched for in texts (they would mask unrelated characters); a URL's
password is still masked where the URL is printed."""


def url_password(url: str) -> str | None:
    """The password a URL carries (userinfo, else a ``password`` query argument), or None."""
    parts = urlsplit(url)
    if parts.password:
        return unquote(parts.password)
    for name, value in parse_qsl(parts.query):
        if name == "password" and value:
            return value
    return None


def redact_url(url: str) -> str:
    """``url`` with its password (and any query argument that looks secret) replaced by
    ``***``; a URL that does not parse is replaced whole."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user = parts.username or ""
            host = netloc.rpartition("@")[2]
            netloc = f"{quote(unquote(user), safe='')}:{MASK}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, MASK if _SECRET_QUERY_RE.search(k) else v) for k, v in pairs], safe="*"
            )
        # Not urlunsplit: it drops the empty authority of ``unix:///path``.
        return (
            f"{parts.scheme}://{netloc}{parts.path}"
            + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else "")
        )
    except ValueError:
        return "<unparsable url>"


class Redactor:
    """Replaces known secrets in texts.

    Attributes:
        url: the redacted URL (what the tier prints as its address).
    """

    __slots__ = ("_secrets", "url")

    def __init__(self, url: str, secrets: Iterable[str | None] = ()) -> None:
        self.url = redact_url(url)
        found = {url_password(url), *secrets}
        variants: set[str] = set()
        for secret in found:
            if secret and len(secret) >= _MIN_SECRET_CHARS:
                variants.update((secret, quote(secret, safe=""), quote(secret)))
        # Longest first, so that a secret containing another is masked whole.
        self._secrets = tuple(sorted(variants, key=len, reverse=True))

    def text(self, text: str) -> str:
        """``text`` with every known secret replaced by ``***``."""
        for secret in self._secrets:
            if secret in text:
                text = text.replace(secret, MASK)
        return text

    def error(self, exc: BaseException) -> str:
        """``"<ExceptionType>: <message>"``, redacted (what the tier logs for an error)."""
        return self.text(f"{type(exc).__name__}: {exc}")
