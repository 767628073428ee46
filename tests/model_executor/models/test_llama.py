# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The transformer: correct (logits of a plain unpaged float64 implementation), sensitive to its KV
(one changed byte changes the logits) and batch-invariant (identical KV bytes and tokens in any
batch, chunking, KV layout and thread count). Smallest preset only."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

import pytest
import torch

from vllm.model_executor.models.llama import PRESETS, LlamaForCausalLM, get_preset
from vllm.v1.engine.config import EngineConfig
from vllm.v1.engine.model import KVLayout, allocate_group_kv_cache, block_digests, gather_blocks
from vllm.v1.engine.model_runner import ScheduledSeq, TransformerModelRunner

PRESET = "tiny"
ENGINE_THREADS = EngineConfig().intra_op_threads
VOCAB = 500
BS = 16


@pytest.fixture(autouse=True)
def engine_threads() -> Iterator[None]:
    """Run at the engine's intra-op setting (as in an engine), unless a test sets another."""
    before = torch.get_num_threads()
    torch.set_num_threads(ENGINE_THREADS)
    yield
    torch.set_num_threads(before)


def _runner(
    layout: KVLayout = KVLayout.PER_LAYER,
    windows: Sequence[int | None] = (None,),
    num_blocks: int = 64,
    seed: int = 0,
) -> TransformerModelRunner:
    p = get_preset(PRESET)
    caches = [
        allocate_group_kv_cache(
            g, BS, num_blocks, p.num_layers, p.num_kv_heads, p.head_dim, torch.float16, layout
        )
        for g in range(len(windows))
    ]
    return TransformerModelRunner(caches, PRESET, VOCAB, seed, windows)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _reference_logits(
    model: LlamaForCausalLM, tokens: list[int], windows: Sequence[int | None]
) -> torch.Tensor:
    """Logits of every position: the textbook forward pass in float64, no cache, no paging (K
    and V rounded to float16, as the cache stores them)."""
    cfg = model.config
    hd, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = len(tokens)
    pos = torch.arange(n)
    inv = torch.tensor(
        [cfg.rope_theta ** (-2 * i / hd) for i in range(hd // 2)], dtype=torch.double
    )
    angles = pos[:, None].double() * inv
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]

    def rope(t: torch.Tensor) -> torch.Tensor:
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + cfg.rms_norm_eps) * w.double()

    x = model.embed[torch.tensor(tokens)].double()
    for i, w in enumerate(model.layers):
        window = windows[model.layer_group(i)[0]]
        qkv = norm(x, w.attn_norm) @ w.qkv.double()
        q = rope(qkv[:, : heads * hd].view(n, heads, hd))
        k = rope(qkv[:, heads * hd : (heads + kv) * hd].view(n, kv, hd)).half().double()
        v = qkv[:, (heads + kv) * hd :].view(n, kv, hd).half().double()
        k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        visible = pos[None, :] <= pos[:, None]
        if window is not None:
            visible &= pos[None, :] > pos[:, None] - window
        probs = scores.masked_fill(~visible, -math.inf).softmax(-1)
        x = x + torch.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd) @ w.o.double()
        gu = norm(x, w.mlp_norm) @ w.gate_up.double()
        ff = cfg.intermediate_size
        x = x + (torch.nn.functional.silu(gu[:, :ff]) * gu[:, ff:]) @ w.down.double()
    return norm(x, model.final_norm) @ model.embed.double().t()


def _hidden(runner: TransformerModelRunner, seq: ScheduledSeq) -> torch.Tensor:
    """The model's hidden states for one scheduled sequence, over the runner's KV cache."""
    # private: the runner's per-layer views of its KV cache; execute() returns sampled tokens
    # only, and these tests compare logits.
    return runner.model.forward(runner.build_batch([seq]), runner._planes, runner.sliding_windows)


def _prefill_logits(
    runner: TransformerModelRunner, tokens: list[int], chunks: Sequence[int]
) -> torch.Tensor:
    """Logits of the last token after computing ``tokens`` in chunks ending at ``chunks``."""
    table = [list(range(10, 50))] * len(runner.kv_caches)
    start, hidden = 0, torch.empty(0)
    for end in chunks:
        seq = ScheduledSeq("r", tokens, start, end, table, end == len(tokens))
        hidden = _hidden(runner, seq)
        start = end
    return runner.model.compute_logits(hidden)[0]


@pytest.mark.parametrize(
    "windows", [(None,), (None, 24)], ids=["full-attention", "hybrid-sliding-window"]
)
@pytest.mark.parametrize("length", [1, 5, 40, 150])
def test_logits_match_an_unpaged_reference(windows: tuple[int | None, ...], length: int) -> None:
    runner = _runner(windows=windows)
    tokens = _tokens(length, length)
    chunks = sorted({length, max(1, length // 3), max(1, length - 1)})
    logits = _prefill_logits(runner, tokens, chunks)
    expected = _reference_logits(runner.model, tokens, windows)[-1]
    assert torch.allclose(logits.double(), expected, rtol=1e-4, atol=1e-3), (
        (logits.double() - expected).abs().max()
    )


def test_one_changed_kv_byte_changes_the_logits() -> None:
    runner = _runner()
    tokens = _tokens(3, 60)
    logits = _prefill_logits(runner, tokens, [59, 60])
    assert torch.equal(_prefill_logits(runner, tokens, [60])[None], logits[None])
    # The last token again, over the cache with one bit of one V element of block 1 (physical
    # block 11) of layer 0 flipped.
    runner.kv_caches[0].tensors[0][1, 11, 4].view(torch.int16)[0, 0] ^= 1
    seq = ScheduledSeq("r", tokens, 59, 60, [list(range(10, 50))], True)
    hidden = _hidden(runner, seq)
    assert not torch.equal(runner.model.compute_logits(hidden)[0], logits)


def test_presets_count_their_parameters() -> None:
    for name, preset in PRESETS.items():
        if name != PRESET:
            continue
        model = LlamaForCausalLM(preset, VOCAB, num_groups=2)
        tensors = [model.embed, model.final_norm]
        for layer in model.layers:
            tensors += [layer.attn_norm, layer.qkv, layer.o, layer.mlp_norm, layer.gate_up]
            tensors.append(layer.down)
        assert preset.num_parameters(VOCAB, 2) == sum(t.numel() for t in tensors)
    with pytest.raises(ValueError, match="unknown model preset 'huge'; presets: tiny"):
        get_preset("huge")


def test_weights_are_a_function_of_the_seed() -> None:
    a, b, c = (LlamaForCausalLM(get_preset(PRESET), VOCAB, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.layers[1].down, b.layers[1].down)
    assert not torch.equal(a.layers[1].down, c.layers[1].down)


# ---------------------------------------------------------------------------------------------
# Batch invariance
# ---------------------------------------------------------------------------------------------

Plan = list[list[tuple[int, int, int]]]
"""Steps, each a list of (sequence, start, end): the same sequences computed in another order."""


def _run_plan(
    runner: TransformerModelRunner, prompts: list[list[int]], plan: Plan
) -> tuple[dict[int, int], list[list[bytes]]]:
    """Run the plan; return each sequence's sampled token and the digests of its full blocks.
    Sequence ``i`` owns blocks ``8 i .. 8 i + 7`` of every group (tables are reversed, so
    logical and physical order differ)."""
    tables = [[8 * i + 7 - j for j in range(8)] for i in range(len(prompts))]
    sampled: dict[int, int] = {}
    for step in plan:
        seqs = [
            ScheduledSeq(
                str(i),
                prompts[i],
                lo,
                hi,
                [tables[i]] * len(runner.kv_caches),
                hi == len(prompts[i]),
            )
            for i, lo, hi in step
        ]
        for req_id, token in runner.execute(seqs).items():
            sampled[int(req_id)] = token
    digests = [
        [
            d
            for g in range(len(runner.kv_caches))
            for d in block_digests(gather_blocks(runner.kv_caches[g], tables[i][: len(p) // BS]))
        ]
        for i, p in enumerate(prompts)
    ]
    return sampled, digests


def _plans(lengths: list[int]) -> dict[str, Plan]:
    alone_whole = [[(i, 0, n)] for i, n in enumerate(lengths)]
    together = [[(i, 0, n) for i, n in enumerate(lengths)]]
    one_token_steps: Plan = []
    for i, n in enumerate(lengths):
        one_token_steps.append([(i, 0, n // 2)])
        one_token_steps += [[(i, t, t + 1)] for t in range(n // 2, n)]
    mixed: Plan = [
        [(0, 0, 17), (1, 0, 3), (2, 0, 40)],
        [(0, 17, 18), (1, 3, lengths[1]), (2, 40, 41), (3, 0, 64)],
        [(0, 18, lengths[0]), (2, 41, lengths[2]), (3, 64, lengths[3])],
    ]
    return {"alone": alone_whole, "together": together, "tokens": one_token_steps, "mixed": mixed}


LENGTHS = [48, 21, 80, 100]
PROMPTS = [_tokens(10 + i, n) for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("windows", [(None,), (None, 24)], ids=["full", "hybrid"])
def test_kv_and_tokens_are_identical_in_every_batch_and_chunking(
    layout: KVLayout, windows: tuple[int | None, ...]
) -> None:
    results = {
        name: _run_plan(_runner(layout, windows), PROMPTS, plan)
        for name, plan in _plans(LENGTHS).items()
    }
    first = results["alone"]
    assert len(first[0]) == len(PROMPTS) and all(first[1])
    for name, result in results.items():
        assert result == first, name


def test_kv_and_tokens_are_identical_at_one_and_two_intra_op_threads() -> None:
    before = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, plan in _plans(LENGTHS).items():
                if name != "tokens":  # one token per step: long, and covered above
                    results[(threads, name)] = _run_plan(_runner(windows=(None, 24)), PROMPTS, plan)
    finally:
        torch.set_num_threads(before)
    first = results[(1, "alone")]
    for key, result in results.items():
        assert result == first, key
