# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``check_at_least``: the lower bounds a config's ``__post_init__`` checks on its counts."""

from __future__ import annotations

from collections.abc import Iterable


def check_at_least(obj: object, names: Iterable[str], minimum: int = 1) -> None:
    """Raise ``ValueError`` naming the first attribute of ``names`` of ``obj`` below
    ``minimum``, and its value."""
    for name in names:
        value = getattr(obj, name)
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")
