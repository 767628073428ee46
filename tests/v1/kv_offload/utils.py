# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Spec and run-info factories shared by the kv_offload tests.

Every test that needs an ``OffloadingSpec`` builds it here, so the stand-in model's geometry is
written once. Only ``gpu_kv_bytes_per_block`` (and with it the row size) matters to most tests;
the other fields are a fixed small model that tests override where they check them (the fs tier's
directory names, the shared region's name, the worker count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.spec import KVCacheRunInfo, round_up
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

if TYPE_CHECKING:
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
    from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager


_T = TypeVar("_T")


def closed_at_teardown(close: Callable[[_T], object]) -> Iterator[list[_T]]:
    """The body of a fixture for what a test makes: yields a list for the test to append to,
    then, at teardown, closes each thing in it (in order) with ``close``.

    Args:
        close: how to close one thing (e.g. ``Engine.shutdown``).
    """
    made: list[_T] = []
    yield made
    for thing in made:
        close(thing)


def make_run_info(gpu_kv_bytes_per_block: int, **overrides: Any) -> KVCacheRunInfo:
    """The run of a small float16 stand-in model with one KV group of 16-token blocks.

    Args:
        gpu_kv_bytes_per_block: bytes of one GPU block on one worker.
        **overrides: any other ``KVCacheRunInfo`` field (e.g. ``tensor_parallel_size``,
            ``instance_id``, ``model_name``).
    """
    fields: dict[str, Any] = {
        "model_name": "org/test-model",
        "dtype": "float16",
        "kv_layout": "cross_layer",
        "num_layers": 2,
        "num_kv_heads": 4,
        "head_size": 64,
        "gpu_block_sizes": (16,),
        "gpu_kv_bytes_per_block": gpu_kv_bytes_per_block,
        **overrides,
    }
    return KVCacheRunInfo(**fields)


def make_cpu_spec(row_bytes: int, num_rows: int, **run_overrides: Any) -> CPUOffloadingSpec:
    """A ``CPUOffloadingSpec`` of ``num_rows`` rows of ``row_bytes`` (page-aligned) bytes.

    Args:
        row_bytes: bytes of one row; also the GPU block bytes unless ``run_overrides`` set
            ``gpu_kv_bytes_per_block`` (e.g. half of it with two workers).
        num_rows: rows the CPU tier holds.
        **run_overrides: ``KVCacheRunInfo`` fields, as for ``make_run_info``.
    """
    run_overrides.setdefault("gpu_kv_bytes_per_block", row_bytes)
    run = make_run_info(**run_overrides)
    return CPUOffloadingSpec(OffloadingConfig(cpu_bytes_to_use=num_rows * row_bytes), run)


def make_tiering_spec(
    shared_region_dir: Path,
    num_blocks: int,
    gpu_kv_bytes_per_block: int,
    secondary_tiers: Iterable[Mapping[str, Any]] = (),
    enable_events: bool = False,
    **run_overrides: Any,
) -> TieringOffloadingSpec:
    """A ``TieringOffloadingSpec`` whose shared region holds exactly ``num_blocks`` rows.

    Args:
        shared_region_dir: where the shared region's backing file goes (a temporary directory).
        num_blocks: rows of the primary tier.
        gpu_kv_bytes_per_block: bytes of one GPU block on one worker; a row holds every worker's
            block, padded to the page size.
        secondary_tiers: the ``secondary_tiers`` entries, in lookup order.
        enable_events: passed to the spec.
        **run_overrides: ``KVCacheRunInfo`` fields, as for ``make_run_info``.
    """
    run = make_run_info(gpu_kv_bytes_per_block, **run_overrides)
    row_bytes = round_up(
        run.world_size * gpu_kv_bytes_per_block, TieringOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    )
    config = OffloadingConfig(
        cpu_bytes_to_use=num_blocks * row_bytes,
        spec_name="TieringOffloadingSpec",
        # Raw entries, as a config file gives them: the config parses them.
        secondary_tiers=cast(Any, tuple(dict(tier) for tier in secondary_tiers)),
        shared_region_dir=str(shared_region_dir),
    )
    spec = TieringOffloadingSpec(config, run, enable_events=enable_events)
    assert spec.num_primary_blocks == num_blocks, (spec.num_primary_blocks, num_blocks)
    return spec


def store_and_cascade(
    manager: TieringOffloadingManager,
    tier: SecondaryTierManager,
    rows: npt.NDArray[np.uint8],
    keys: Sequence[OffloadKey],
    ctx: ReqContext,
    fill: Callable[[OffloadKey], npt.NDArray[np.uint8]],
) -> None:
    """GPU -> CPU store of ``keys`` (the worker's copy fills each row with ``fill(key)``), then
    the cascade to ``tier``, stepped until its completions released the pins."""
    output = manager.prepare_store(keys, ctx)
    assert output is not None and output.keys_to_store == list(keys)
    assert isinstance(output.store_spec, CPULoadStoreSpec)
    for key, row in zip(keys, output.store_spec.block_ids.tolist(), strict=True):
        rows[row] = fill(key)
    manager.complete_store(keys, ctx)
    manager.on_schedule_end()  # nothing finished yet
    tier.drain_jobs()
    manager.on_schedule_end()  # cascade completions release the pins
