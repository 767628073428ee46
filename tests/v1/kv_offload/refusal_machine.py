# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What the misbehaving-caller state machines of the managers share: predict, act, compare.

A machine's rule describes a call with ``predict`` (the model update to apply if the call is
legitimate, or ``Refused(error)`` if it must fail) and ``act`` (the call itself). ``call`` runs
the pair: a legitimate call must succeed; a refused one must raise exactly ``error`` (never an
``AssertionError``) and leave everything the machine's ``observe()`` returns unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

NOT_KEYS = st.one_of(
    st.integers(),
    st.text(max_size=4),
    st.none(),
    st.floats(allow_nan=False),
    st.tuples(st.integers()),
)
"""Values a careless caller passes where keys belong."""

KEY_METHODS = [
    "lookup",
    "lookup_prefix",
    "prepare_store",
    "prepare_load",
    "complete_load",
    "complete_store",
]
"""The manager methods that take keys."""


def long_fuzz(machine: type[RuleBasedStateMachine], run_settings: settings) -> type:
    """``machine``'s test case run with ``run_settings`` and marked slow: the long fuzz, many
    more and longer runs of a machine than its test case of every run.

    Args:
        machine: the state machine.
        run_settings: its settings for the long runs.

    Returns:
        A test case class, to bind to a ``Test...`` name of the test module.
    """
    case = type(f"{machine.__name__}Long", (machine.TestCase,), {"settings": run_settings})
    return pytest.mark.slow(case)  # type: ignore[no-any-return]


class Refused(Exception):
    """The model's verdict: this call must be refused with ``error`` and change nothing."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__(error.__name__)
        self.error = error


def refused(error: type[BaseException]) -> Callable[[], Callable[[], None]]:
    """A ``predict`` for a call that must always be refused with ``error``."""

    def predict() -> Callable[[], None]:
        raise Refused(error)

    return predict


class RefusalMachine(RuleBasedStateMachine):
    """Base of the managers' state machines (see the module docstring), with the misbehaving
    calls both machines make: a completion sent again, stray completions (any keys, any
    request), and values that are not keys.

    Subclasses set ``key_lists`` and ``reqs`` (their key and request strategies), keep ``sent``
    (the completions already sent: ``(kind, ctx, keys)``), set ``manager`` and ``shut_down``,
    and implement ``observe``, ``_complete_store`` and ``_complete_load``.
    """

    key_lists: ClassVar[st.SearchStrategy[list[OffloadKey]]]
    reqs: ClassVar[st.SearchStrategy[ReqContext]]
    manager: Any
    shut_down: bool
    steps: int
    sent: list[tuple[str, ReqContext, list[OffloadKey]]]

    def _complete_store(self, keys: list[OffloadKey], ctx: ReqContext, success: bool) -> None:
        raise NotImplementedError

    def _complete_load(self, keys: list[OffloadKey], ctx: ReqContext) -> None:
        raise NotImplementedError

    @precondition(lambda self: self.sent)
    @rule(data=st.data(), success=st.booleans())
    def replay_completion(self, data: st.DataObject, success: bool) -> None:
        """A completion sent again (or one from before a reset): a duplicate."""
        kind, ctx, keys = data.draw(st.sampled_from(self.sent), label="sent")
        if kind == "store":
            self._complete_store(keys, ctx, success)
        else:
            self._complete_load(keys, ctx)

    @rule(data=st.data(), success=st.booleans())
    def complete_store_stray(self, data: st.DataObject, success: bool) -> None:
        """Any keys, any request: absent, ready, pinned, other requests' or legitimate ones."""
        keys = data.draw(self.key_lists, label="keys")
        self._complete_store(keys, data.draw(self.reqs, label="ctx"), success)

    @rule(data=st.data())
    def complete_load_stray(self, data: st.DataObject) -> None:
        """Any keys, any request: absent, not pinned, other requests' or legitimate ones."""
        keys = data.draw(self.key_lists, label="keys")
        self._complete_load(keys, data.draw(self.reqs, label="ctx"))

    @rule(data=st.data(), method=st.sampled_from(KEY_METHODS))
    def not_a_key(self, data: st.DataObject, method: str) -> None:
        """A value that is not an OffloadKey among real keys: TypeError at the call."""
        keys = data.draw(self.key_lists, label="keys")
        self.call_with_a_non_key(
            method,
            data.draw(NOT_KEYS, label="bad"),
            keys,
            data.draw(st.integers(0, len(keys)), label="at"),
            data.draw(self.reqs, label="ctx"),
        )

    def observe(self) -> Any:
        """Everything a refused call must leave unchanged."""
        raise NotImplementedError

    def call(self, predict: Callable[[], Callable[[], None]], act: Callable[[], Any]) -> Any:
        """Run ``act`` against the manager; ``predict`` returns the model update to apply on
        success, or raises ``Refused`` if the call must fail (then nothing may change). After
        ``shutdown()`` every call must be refused with ``RuntimeError`` ("shut down")."""
        self.steps += 1
        try:
            if self.shut_down:
                raise Refused(RuntimeError)
            apply = predict()
        except Refused as verdict:
            before = self.observe()
            with pytest.raises(BaseException) as info:
                act()
            error = info.value
            assert type(error) is verdict.error, f"expected {verdict.error.__name__}, got {error!r}"
            if isinstance(error, RuntimeError):
                assert "shut down" in str(error)
            assert self.observe() == before, f"refused call changed the state: {error}"
            return None
        result = act()
        apply()
        return result

    def call_with_a_non_key(
        self, method: str, bad: Any, keys: list[OffloadKey], at: int, ctx: ReqContext
    ) -> None:
        """``method`` with ``bad`` (not a key) among ``keys`` (at index ``at``): TypeError."""
        mixed: list[Any] = list(keys)
        mixed.insert(at, bad)
        manager = self.manager
        acts: dict[str, Callable[[], Any]] = {
            "lookup": lambda: manager.lookup(bad, ctx),
            "lookup_prefix": lambda: manager.lookup_prefix(mixed, ctx),
            "prepare_store": lambda: manager.prepare_store(mixed, ctx),
            "prepare_load": lambda: manager.prepare_load(mixed, ctx),
            "complete_load": lambda: manager.complete_load(mixed, ctx),
            "complete_store": lambda: manager.complete_store(mixed, ctx),
        }
        if method == "lookup_prefix" and not self.prefix_reaches(keys[:at]):
            # The scan stops at a miss before the value: the call answers as for the keys.
            self.lookup_prefix(mixed, ctx)
            return
        self.call(refused(TypeError), acts[method])

    def prefix_reaches(self, keys: list[OffloadKey]) -> bool:
        """Whether ``lookup_prefix`` reaches the key after ``keys`` (the keys it checks): a
        manager's scan stops at the first miss. Default: always (the manager checks them all
        before anything it could change)."""
        return True

    def lookup_prefix(self, keys: list[Any], ctx: ReqContext) -> None:
        raise NotImplementedError
