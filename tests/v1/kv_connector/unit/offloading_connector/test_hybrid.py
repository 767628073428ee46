# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Hybrid models (a full-attention group plus a sliding-window (SWA) group, or two groups of
different block sizes) through the connector.

Engine tests run the real engine (which frees SWA blocks that fell out of the window) with the
real connector and CPU tier; the lookup tests drive ``groups.lookup_hit_end`` with a scripted
lookup.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.v1.kv_connector.unit.offloading_connector.scheduler_harness import (
    job_table,
    request_states,
)
from tests.v1.kv_connector.unit.offloading_connector.utils import (
    Chaos,
    EngineCore,
    baseline,
    capture_metadata,
    chaos_factory,
    make_config,
    random_tokens,
    run_multi_turn,
    with_handlers,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.groups import (
    GroupLayout,
    LookupFn,
    lookup_hit_end,
    one_by_one,
    promoting_hit_end,
    window_scan,
)
from vllm.v1.kv_cache_interface import NULL_BLOCK_ID
from vllm.v1.kv_offload.base import get_offload_group_idx

HYBRID = dict(gpu_block_sizes=(16, 16), sliding_windows=(None, 32))


def _load_keys_per_group(engine: EngineCore, metas: list[Any]) -> list[tuple[int, int]]:
    """Per load job, ``(group-0 keys, group-1 keys)``."""
    assert engine.connector is not None
    out = []
    for meta in metas:
        for job in meta.load_jobs.values():
            sizes = job.transfer_spec.dst.group_sizes
            out.append((sizes[0], sizes[1]))
    return out


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "geometry",
    [
        dict(HYBRID),
        dict(gpu_block_sizes=(8, 16), sliding_windows=(None, 40)),
        dict(gpu_block_sizes=(16, 8), sliding_windows=(None, 40)),
        dict(gpu_block_sizes=(16, 16), sliding_windows=(None, 16), extra_block_size=32),
    ],
    ids=[
        "window_2_blocks",
        "swa_own_block_size",
        "swa_smaller_block_size",
        "window_under_one_offloaded_block",
    ],
)
def test_hybrid_multi_turn_is_bit_exact_and_loads_only_the_window(
    tmp_path: Path, geometry: dict[str, Any]
) -> None:
    block_size = geometry.pop("extra_block_size", None)
    extra = {"block_size": block_size} if block_size else None
    geometry["num_gpu_blocks"] = 40

    def workload(engine: EngineCore) -> dict[str, list[int]]:
        return run_multi_turn(engine, seed=3)

    expected = baseline(tmp_path, workload, **geometry)
    config = make_config(tmp_path, cpu_blocks=128, extra=extra, **geometry)
    with EngineCore(config) as engine:
        metas = capture_metadata(engine)
        assert workload(engine) == expected
        stats = engine.stats
        assert stats.tokens_from_cpu > 0 and stats.blocks_loaded_verified > 0
        assert stats.verification_failures == 0
        assert engine.connector is not None
        sched = engine.connector.connector_scheduler
        window = sched.layout.window_blocks[1]
        assert window is not None
        factor = sched.offloaded_block_size // geometry["gpu_block_sizes"][1]
        loads = _load_keys_per_group(engine, metas)
        assert loads
        # The SWA group loads at most the window's GPU blocks, and for long hits fewer blocks
        # than the full-attention group.
        assert all(swa <= window * factor for _, swa in loads)
        assert any(
            swa * geometry["gpu_block_sizes"][1] < full * geometry["gpu_block_sizes"][0]
            for full, swa in loads
        )
        assert not engine.has_pending_work()


@pytest.mark.parametrize(
    "gpu_block_sizes", [(8, 16), (16, 8), (32, 16)], ids=["8_16", "16_8", "32_16"]
)
def test_full_attention_groups_of_different_block_sizes_are_bit_exact(
    tmp_path: Path, gpu_block_sizes: tuple[int, int]
) -> None:
    # Two full-attention groups, in either order of block size: the CPU views of a worker's slot
    # hold pages of different sizes, the larger first or last (the larger first was refused at
    # construction as "CPU views 0 and 7 overlap"). Every loaded block is verified against
    # recomputation.
    geometry: dict[str, Any] = dict(gpu_block_sizes=gpu_block_sizes, num_gpu_blocks=40)

    def workload(engine: EngineCore) -> dict[str, list[int]]:
        return run_multi_turn(engine, seed=5)

    expected = baseline(tmp_path, workload, **geometry)
    with EngineCore(make_config(tmp_path, cpu_blocks=128, **geometry)) as engine:
        metas = capture_metadata(engine)
        assert workload(engine) == expected
        stats = engine.stats
        assert stats.tokens_from_cpu > 0 and stats.blocks_loaded_verified > 0
        assert stats.verification_failures == 0
        # Both groups were loaded, with as many tokens each (full attention).
        loads = _load_keys_per_group(engine, metas)
        assert loads
        assert all(full * gpu_block_sizes[0] == other * gpu_block_sizes[1] for full, other in loads)
        assert not engine.has_pending_work()


def test_freed_swa_blocks_are_not_stored(tmp_path: Path) -> None:
    # When the prefill's store is built, all its SWA blocks are still on the GPU; offered again
    # a step later (the first offer was refused), the blocks whose SWA part the engine freed
    # meanwhile are offered with their full-attention keys only.
    config = make_config(tmp_path, cpu_blocks=64, num_gpu_blocks=24, **HYBRID)
    with EngineCore(config) as engine:
        assert engine.connector is not None
        sched = engine.connector.connector_scheduler
        offered: list[list[bytes]] = []
        real = sched.manager.prepare_store
        refused = [False]

        def prepare_store(keys: Any, ctx: Any) -> Any:
            offered.append(list(keys))
            if not refused[0]:
                refused[0] = True
                return None  # no room yet: the blocks are offered again next step
            return real(keys, ctx)

        sched.manager.prepare_store = prepare_store  # type: ignore[method-assign]
        rng = random.Random(1)
        prompt = random_tokens(rng, 200)
        engine.add_request("r", prompt, 10)
        for _ in range(3):
            engine.step()
        table = engine.kv_cache_manager.get_block_ids("r")
        assert NULL_BLOCK_ID in table[1] and NULL_BLOCK_ID not in table[0]  # SWA blocks freed
        engine.run_until_done()
        groups = [[get_offload_group_idx(k) for k in keys] for keys in offered]
        # The retried offer covers the refused blocks: all of group 0, fewer of group 1.
        assert groups[1].count(0) > groups[1].count(1) > 0
        assert engine.stats.verification_failures == 0


@pytest.mark.parametrize("fence", [True, False], ids=["fence", "no_fence_control"])
def test_swa_blocks_freed_while_a_store_reads_them_are_fenced(
    tmp_path: Path, fence: bool, scheduling_mode: str
) -> None:
    # Two long prompts at once in a tight pool: SWA blocks freed while their request runs are
    # reallocated to the other request while late stores still read them. Prefixes ending at
    # every block boundary then load each SWA block (a hit loads only the window before it).
    batched = 32 if scheduling_mode == "async" else 48
    config = make_config(
        tmp_path,
        cpu_blocks=128,
        num_gpu_blocks=21,
        max_num_seqs=2,
        max_num_batched_tokens=batched,
        gpu_block_sizes=(16, 16),
        sliding_windows=(None, 16),
    )
    factory = chaos_factory(Chaos(min_delay_polls=12, max_delay_polls=12))
    with EngineCore(with_handlers(config, factory)) as engine:
        assert engine.connector is not None
        sched = engine.connector.connector_scheduler
        if not fence:
            # Negative control: fence stores only when their request finishes (as for
            # full-attention blocks), not from their creation. The fence is internal to the job
            # table: replacing it is the only way to run the connector without it.
            jobs, states = job_table(sched), request_states(sched)
            real = jobs.fence

            def late_fence(job_ids: Any) -> None:
                ids = list(job_ids)
                if all(states[jobs[j].req_id].finished for j in ids):
                    real(ids)

            jobs.fence = late_fence  # type: ignore[method-assign]
        rng = random.Random(7)
        prompts = {f"p{i}": random_tokens(rng, 160) for i in range(4)}
        engine.generate(prompts, 4)
        for k in range(2, 10):
            engine.generate({f"{p}-{k}": v[: 16 * k + 3] for p, v in prompts.items()}, 2)
        stats = engine.stats
        assert stats.blocks_loaded_verified > 100
        if fence:
            assert stats.verification_failures == 0
        else:
            assert stats.verification_failures > 0


def test_hybrid_requires_one_window_per_group() -> None:
    with pytest.raises(ValueError, match="one entry per group"):
        make_config(Path("/nonexistent"), cpu_blocks=None, sliding_windows=(None, 16))


# ---------------------------------------------------------------------------------------------
# Lookups (scripted)
# ---------------------------------------------------------------------------------------------


def _hit_end(
    layout: GroupLayout, lookup: LookupFn, keys: list[list[bytes]], start: int, end: int
) -> tuple[int, bool]:
    """``lookup_hit_end`` with the full groups' prefix scans made of ``lookup`` calls."""
    return lookup_hit_end(layout, lookup, one_by_one(lookup), keys, start, end)


def _scripted(answers: dict[bytes, bool | None], log: list[bytes]) -> Any:
    def lookup(key: bytes) -> bool | None:
        log.append(key)
        return answers.get(key, False)

    return lookup


def _keys(group: int, n: int) -> list[bytes]:
    return [bytes([group, i]) for i in range(n)]


@pytest.mark.parametrize(
    ("hits", "window", "expected"),
    [
        ("1111111111", 2, (10, False)),  # the window at the end
        ("1111111100", 2, (8, False)),  # misses at the end: the last full window
        ("1101101001", 2, (5, False)),  # the window in the middle
        ("0000000001", 2, (0, False)),  # no full window, and the run does not reach start
        ("1000000000", 3, (1, False)),  # a run reaching start needs no full window
        ("111111111N", 2, (10, True)),  # a pending key in the window defers
        ("N111111100", 2, (8, False)),  # a pending key outside the returned run does not
        ("11111110N1", 3, (7, False)),  # nor one in a run broken before reaching the window
    ],
)
def test_window_scan(hits: str, window: int, expected: tuple[int, bool]) -> None:
    keys = _keys(1, len(hits))
    answers: dict[bytes, bool | None] = {
        k: {"1": True, "0": False, "N": None}[c] for k, c in zip(keys, hits, strict=True)
    }
    log: list[bytes] = []
    assert window_scan(_scripted(answers, log), keys, 0, len(keys), window) == expected


def test_lookup_needs_the_full_prefix_but_only_the_swa_window() -> None:
    layout = GroupLayout((16, 16), 16, (None, 32))
    full, swa = _keys(0, 8), _keys(1, 8)
    answers: dict[bytes, bool | None] = dict.fromkeys(full, True)
    answers.update(dict.fromkeys(swa[4:6], True))  # only blocks 4 and 5 of the SWA group
    log: list[bytes] = []
    end, deferred = _hit_end(layout, _scripted(answers, log), [full, swa], 0, 8)
    assert (end, deferred) == (6, False)  # the hit at 6 blocks needs SWA blocks 4 and 5 only
    assert layout.load_keys([full, swa], 0, 6) == [*full[:6], *swa[4:6]]
    # With 2 blocks on the GPU, a run reaching them suffices.
    answers = dict.fromkeys(full, True)
    answers[swa[2]] = True
    end, _ = _hit_end(layout, _scripted(answers, []), [full, swa], 2, 8)
    assert end == 3


def test_lookup_converges_over_two_windows_and_a_full_group() -> None:
    layout = GroupLayout((16, 16, 16), 16, (48, None, 16))
    keys = [_keys(g, 10) for g in range(3)]
    answers: dict[bytes, bool | None] = dict.fromkeys(keys[1][:9], True)  # full: 9 blocks
    answers.update(dict.fromkeys(keys[0][2:9], True))  # wide window (3 blocks): up to 9
    answers.update(dict.fromkeys([keys[2][4], keys[2][6]], True))  # narrow: ends at 7 or 5
    end, deferred = _hit_end(layout, _scripted(answers, []), keys, 0, 10)
    # Narrow window -> 7; the wide one needs blocks 4..6 at 7: held; stable.
    assert (end, deferred) == (7, False)
    answers[keys[0][5]] = False  # the wide window at 7 is broken -> 5 -> narrow at 5: held
    end, _ = _hit_end(layout, _scripted(answers, []), keys, 0, 10)
    assert end == 5


class _Tiered:
    """A scripted manager: ``resident`` keys are readable, ``in_tier`` keys are held by a slower
    tier (a lookup promotes them; a probe does not), ``refused`` keys cannot be promoted."""

    def __init__(
        self, resident: set[bytes], in_tier: set[bytes], refused: frozenset[bytes] = frozenset()
    ) -> None:
        self.resident, self.in_tier, self.refused = resident, in_tier, refused
        self.promoted: list[bytes] = []

    def probe(self, key: bytes) -> bool | None:
        if key in self.resident:
            return True
        return None if key in self.in_tier else False

    def lookup(self, key: bytes) -> bool | None:
        if key in self.in_tier and key not in self.refused:
            self.promoted.append(key)
        if key in self.refused:
            return False
        return self.probe(key)


def test_promoting_hit_end_promotes_only_the_keys_the_hit_loads() -> None:
    layout = GroupLayout((16, 16), 16, (None, 32))  # SWA window: 2 blocks
    full, swa = _keys(0, 8), _keys(1, 8)
    # Everything in the slow tier except SWA block 6, so the SWA run ending at 8 breaks at 6:
    # the hit ends at 6 and loads full 0..5 and SWA 4..5.
    manager = _Tiered(set(), {*full, *swa} - {swa[6]})
    end, deferred = promoting_hit_end(layout, manager.probe, manager.lookup, [full, swa], 0, 8)
    assert (end, deferred) == (6, True)
    assert manager.promoted == [*full[:6], *swa[4:6]]
    assert manager.promoted == layout.load_keys([full, swa], 0, 6)
    # A plain lookup scan would have promoted SWA block 7 and full blocks 6 and 7 too.
    plain = _Tiered(set(), {*full, *swa} - {swa[6]})
    assert _hit_end(layout, plain.lookup, [full, swa], 0, 8) == (6, True)
    assert set(plain.promoted) - set(manager.promoted) == {full[6], full[7], swa[7]}


def test_promoting_hit_end_skips_resident_keys_and_rescans_after_a_refusal() -> None:
    layout = GroupLayout((16, 16), 16, (None, 16))  # SWA window: 1 block
    full, swa = _keys(0, 6), _keys(1, 6)
    resident = {*full[:2], swa[1]}
    # Full block 4 cannot be promoted (no room): the hit is found again, ending at 4.
    manager = _Tiered(resident, {*full[2:], *swa[2:]}, refused=frozenset({full[4]}))
    end, deferred = promoting_hit_end(layout, manager.probe, manager.lookup, [full, swa], 0, 6)
    assert (end, deferred) == (4, True)
    # Resident keys are not looked up; the first pass promoted full 2..3 before the refusal,
    # the second pass the new window's SWA block 3 only.
    assert manager.promoted == [full[2], full[3], swa[3]]
    # Everything resident: nothing is promoted, nothing deferred.
    manager = _Tiered({*full, *swa}, set())
    assert promoting_hit_end(layout, manager.probe, manager.lookup, [full, swa], 0, 6) == (
        6,
        False,
    )
    assert manager.promoted == []


def test_a_pending_full_attention_key_beyond_the_hit_does_not_defer() -> None:
    layout = GroupLayout((16, 16), 16, (None, 16))
    full, swa = _keys(0, 6), _keys(1, 6)
    answers: dict[bytes, bool | None] = dict.fromkeys(full, True)
    answers[full[5]] = None
    answers[swa[2]] = True  # the SWA window (one block) holds at 3 only
    assert _hit_end(layout, _scripted(answers, []), [full, swa], 0, 6) == (3, False)
    answers[swa[5]] = True
    assert _hit_end(layout, _scripted(answers, []), [full, swa], 0, 6) == (6, True)
