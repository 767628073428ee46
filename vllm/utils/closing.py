# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``ClosingContextManager``: ``with obj:`` returns ``obj`` and releases it on the way out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType

from typing_extensions import Self


class ClosingContextManager(ABC):
    """Mixin for objects whose ``with`` block ends by releasing them, exception or not.

    A subclass implements ``_release`` by calling its own public release method (``close``,
    ``cleanup``, ``shutdown``, ...); an exception it raises propagates out of the ``with``.
    """

    @abstractmethod
    def _release(self) -> None:
        """Release the object: what leaving its ``with`` block does."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._release()
