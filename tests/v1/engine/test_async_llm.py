# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Tests of the asyncio front end ``AsyncLLM`` over a real ``EngineCore``."""

from __future__ import annotations

import asyncio
import threading

import pytest

from vllm.v1.engine.async_llm import AsyncLLM, EngineDeadError, GenerateOutput
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.core import EngineCore

NUM_GPU_BLOCKS = 64
TIMEOUT_S = 120  # a bound on every wait, so that a broken engine fails the test instead of hanging


def _config(offload: bool = False, **kwargs: object) -> EngineConfig:
    return EngineConfig(
        num_gpu_blocks=NUM_GPU_BLOCKS,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        kv_connector_extra_config={"cpu_bytes_to_use": 1 << 22} if offload else None,
        **kwargs,  # type: ignore[arg-type]
    )


def _prompt(i: int, n: int = 40) -> list[int]:
    # A shared 32-token prefix, then a per-request tail.
    return [7] * 32 + [100 + i + j for j in range(n - 32)]


async def _collect(llm: AsyncLLM, req_id: str, prompt: list[int], n: int) -> list[GenerateOutput]:
    async def collect() -> list[GenerateOutput]:
        return [out async for out in llm.generate(req_id, prompt, n)]

    return await asyncio.wait_for(collect(), TIMEOUT_S)


def _free_blocks(engine: EngineCore) -> int:
    return sum(p.num_free_blocks for p in engine.kv_cache_manager.pools)


async def test_concurrent_generates_match_the_synchronous_engine() -> None:
    prompts = {f"r{i}": _prompt(i) for i in range(6)}
    with EngineCore(_config()) as sync_engine:
        expected = sync_engine.generate(prompts, max_tokens=5)
    async with AsyncLLM(EngineCore(_config(offload=True))) as llm:
        results = await asyncio.gather(*(_collect(llm, r, p, 5) for r, p in prompts.items()))
        await asyncio.wait_for(llm.wait_until_idle(), TIMEOUT_S)
        max_running = await llm.call(lambda e: max(rec.num_running for rec in e.stats.step_records))
    assert max_running >= 2, "requests never overlapped"
    for (req_id, _), outs in zip(prompts.items(), results, strict=True):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert list(outs[-1].output_token_ids) == expected[req_id]
        assert [t for o in outs for t in o.new_token_ids] == expected[req_id]


@pytest.mark.parametrize("offload", [False, True])
async def test_cancelling_a_generate_mid_flight_aborts_it_and_frees_its_blocks(
    offload: bool,
) -> None:
    async with AsyncLLM(EngineCore(_config(offload=offload))) as llm:
        first_output = asyncio.Event()

        async def consume() -> None:
            async for _ in llm.generate("long", _prompt(0, 200), max_tokens=100_000):
                first_output.set()

        task = asyncio.create_task(consume())
        waiter = asyncio.create_task(first_output.wait())
        await asyncio.wait({task, waiter}, timeout=TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        assert first_output.is_set(), f"no output: {task}"
        held = await llm.call(lambda e: NUM_GPU_BLOCKS - _free_blocks(e))
        assert held > 0, "the running request holds no GPU block"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(llm.wait_until_idle(), TIMEOUT_S)
        free, aborted, unfinished = await llm.call(
            lambda e: (_free_blocks(e), e.stats.requests_aborted, e.has_unfinished_requests())
        )
        assert (free, aborted, unfinished) == (NUM_GPU_BLOCKS, 1, False)
        # The engine keeps serving after the abort.
        outs = await _collect(llm, "after", _prompt(1), 3)
        assert len(outs[-1].output_token_ids) == 3


async def test_leaving_the_stream_early_aborts_the_request() -> None:
    async with AsyncLLM(EngineCore(_config())) as llm:
        stream = llm.generate("r", _prompt(0), max_tokens=100_000)
        await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        await stream.aclose()
        await asyncio.wait_for(llm.wait_until_idle(), TIMEOUT_S)
        assert await llm.call(lambda e: (e.stats.requests_aborted, _free_blocks(e))) == (
            1,
            NUM_GPU_BLOCKS,
        )


async def test_abort_ends_the_stream_with_reason_abort() -> None:
    async with AsyncLLM(EngineCore(_config())) as llm:
        outs: list[GenerateOutput] = []

        async def consume() -> None:
            async for out in llm.generate("r", _prompt(0), max_tokens=100_000):
                outs.append(out)
                if len(outs) == 2:
                    await llm.abort("r")

        await asyncio.wait_for(consume(), TIMEOUT_S)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"


async def test_bad_requests_are_rejected() -> None:
    async with AsyncLLM(EngineCore(_config())) as llm:
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await _collect(llm, "a", [], 3)
        with pytest.raises(ValueError, match="max_tokens"):
            await _collect(llm, "a", [1, 2], 0)
        stream = llm.generate("dup", _prompt(0), max_tokens=100_000)
        await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        with pytest.raises(ValueError, match="already running"):
            await _collect(llm, "dup", _prompt(1), 3)
        await stream.aclose()


async def test_call_runs_on_the_engine_thread() -> None:
    async with AsyncLLM(EngineCore(_config())) as llm:
        name = await llm.call(lambda e: threading.current_thread().name)
        assert name == "vllm_engine_core"
        with pytest.raises(ZeroDivisionError):
            await llm.call(lambda e: 1 // 0)
        assert llm.is_running  # a failing call does not stop the engine


async def test_an_engine_failure_fails_open_streams_and_later_calls() -> None:
    def explode(engine: EngineCore, outputs: object) -> None:
        if engine.stats.steps == 3:
            raise RuntimeError("boom")

    llm = AsyncLLM(EngineCore(_config()), step_callback=explode)
    async with llm:
        with pytest.raises(EngineDeadError, match="boom"):
            await _collect(llm, "r", _prompt(0), 50)
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await _collect(llm, "r2", _prompt(1), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(llm.wait_until_idle(), TIMEOUT_S)


async def test_shutdown_ends_open_streams() -> None:
    llm = AsyncLLM(EngineCore(_config()))
    llm.start()
    stream = llm.generate("r", _prompt(0), max_tokens=100_000)
    await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
    await llm.shutdown()
    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError, match="shut down"):
        await _collect(llm, "r2", _prompt(1), 3)
    await llm.shutdown()  # idempotent
