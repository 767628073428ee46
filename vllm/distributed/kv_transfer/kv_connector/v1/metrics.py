# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``KVConnectorStats``: the base of a KV connector's statistics, in vLLM's shape.

A connector's statistics travel from each worker to the scheduler (inside ``KVConnectorOutput``)
and from the scheduler to whoever logs or exports them, so they are a plain dataclass over a
``data`` dict of builtins: msgspec (msgpack) serialises it without a custom encoder, and the
receiving side rebuilds the object from ``data`` alone.

Lifecycle of one step: each worker's connector hands out its stats with ``clone_and_reset``; the
engine folds the ranks together with ``aggregate``; the scheduler-side connector adds its own and
hands out the total; a logger summarises it with ``reduce`` or an exporter observes ``data``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import Self


@dataclass
class KVConnectorStats(ABC):
    """Statistics of a KV connector since the last ``clone_and_reset``.

    Attributes:
        data: the connector-defined payload; builtins only (dicts, lists, tuples, str, int,
            float), so that it survives msgspec serialisation between processes.
    """

    data: dict[str, Any] = field(default_factory=dict)

    @abstractmethod
    def aggregate(self, other: Self) -> Self:
        """Fold ``other`` (another rank's, or a later step's, stats) into this object.

        Returns:
            ``self``, updated; ``other`` is not modified.
        """

    @abstractmethod
    def reduce(self) -> dict[str, int | float]:
        """A flat summary for logging: metric name -> value."""

    @abstractmethod
    def is_empty(self) -> bool:
        """Whether nothing was recorded."""

    def reset(self) -> None:
        """Forget everything recorded."""
        self.data = {}

    def clone_and_reset(self) -> Self:
        """Return a copy holding everything recorded so far, and reset this object."""
        clone = type(self)(data=self.data)
        self.reset()
        return clone
