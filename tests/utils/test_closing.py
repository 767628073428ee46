# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of ``ClosingContextManager``."""

from __future__ import annotations

import pytest
from typing_extensions import override

from vllm.utils.closing import ClosingContextManager


class Resource(ClosingContextManager):
    def __init__(self) -> None:
        self.released = 0

    @override
    def _release(self) -> None:
        self.released += 1


def test_with_returns_the_object_and_releases_it_once() -> None:
    resource = Resource()
    with resource as entered:
        assert entered is resource and resource.released == 0
    assert resource.released == 1


def test_release_happens_on_an_exception_which_propagates() -> None:
    resource = Resource()
    with pytest.raises(KeyError), resource:
        raise KeyError("boom")
    assert resource.released == 1


def test_a_subclass_without_release_cannot_be_created() -> None:
    class Incomplete(ClosingContextManager):
        pass

    with pytest.raises(TypeError, match="_release"):
        Incomplete()  # type: ignore[abstract]
