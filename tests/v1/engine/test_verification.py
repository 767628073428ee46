# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine's oracle: steps only record digests; ``verify_kv`` checks them against the
caller's reference, the engine's own computations or a recomputation, once each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.v1.kv_connector.unit.offloading_connector.utils import make_config
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.verification import VerificationResult, VerifyMode


def _serve(engine: EngineCore, prompts: dict[str, list[int]]) -> None:
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, 3)
    while engine.has_pending_work():
        engine.step()


PROMPT = list(range(1, 97))  # 6 full blocks


@contextlib.contextmanager
def _loaded_a_prefix(tmp_path: Path, verify: str = "loaded") -> Iterator[EngineCore]:
    """An engine (``--verify verify``) that served ``PROMPT`` as "a", then loaded its 6 blocks
    from the CPU tier for "b" (``PROMPT`` and one more token)."""
    with EngineCore(make_config(tmp_path, num_gpu_blocks=16, verify=verify)) as engine:
        _serve(engine, {"a": PROMPT})
        engine.kv_cache_manager.reset_prefix_cache()  # GPU only: the CPU tier keeps the blocks
        _serve(engine, {"b": [*PROMPT, 7]})
        yield engine


def test_steps_record_and_verify_kv_checks_each_record_once(tmp_path: Path) -> None:
    with _loaded_a_prefix(tmp_path) as engine:
        assert engine.stats.tokens_from_cpu == 96
        assert engine.stats.blocks_verified == 0  # nothing checked while serving
        first = engine.verify_kv()
        assert (first.loaded_checked, first.mismatched, first.recomputed) == (6, 0, 0)
        assert first.seconds > 0 and engine.stats.verify_seconds == first.seconds
        again = engine.verify_kv()
        assert again == VerificationResult(seconds=again.seconds)
        assert engine.stats.blocks_loaded_verified == 6


def test_a_reference_takes_precedence_and_a_differing_digest_is_a_mismatch(
    tmp_path: Path,
) -> None:
    with _loaded_a_prefix(tmp_path) as engine:
        reference = engine.computed_block_digests()
        assert len(reference) == 6  # a's 6 blocks (b's 100 tokens fill no seventh)
        wrong_key = next(iter(reference))
        reference[wrong_key] = b"\0" * 16
        result = engine.verify_kv(reference)
        assert result.mismatched == 1 and result.mismatched_keys == [wrong_key]
        assert engine.stats.verification_failures == 1


def test_without_a_reference_or_an_own_computation_the_block_is_recomputed(
    tmp_path: Path,
) -> None:
    with _loaded_a_prefix(tmp_path) as engine:
        assert engine.oracle is not None and len(engine.computed_block_digests()) == 6
        engine.oracle.computed.clear()  # as if another instance had computed the blocks
        result = engine.verify_kv()
        assert (result.loaded_checked, result.recomputed, result.mismatched) == (6, 6, 0)


def test_all_also_checks_finished_requests_and_computed_blocks(tmp_path: Path) -> None:
    with _loaded_a_prefix(tmp_path, "all") as engine:
        reference = engine.computed_block_digests()
        result = engine.verify_kv(reference)
        # a's 6 blocks and b's 6 (loaded ones, at finish) plus the 6 b loaded.
        assert (result.blocks_checked, result.loaded_checked) == (18, 6)
        assert result.computed_checked == 6 and result.mismatched == 0


def test_none_records_nothing(tmp_path: Path) -> None:
    with _loaded_a_prefix(tmp_path, "none") as engine:
        assert engine.oracle is None and engine.config.verify is VerifyMode.NONE
        assert engine.verify_kv() == VerificationResult()
        assert engine.computed_block_digests() == {}


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="'some' is not a valid VerifyMode"):
        make_config(Path("/nonexistent"), cpu_blocks=None, verify="some")
