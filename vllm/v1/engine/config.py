# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``EngineConfig``: the engine core's settings (model, KV geometry, pool, batching, checks)."""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm.model_executor.models.llama_config import LlamaConfig, get_preset
from vllm.utils.field_checks import check_at_least
from vllm.v1.engine.model import KVLayout
from vllm.v1.engine.model_runner import ModelKind
from vllm.v1.engine.verification import VerifyMode

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}

_instance_counter = itertools.count()

HASH_MODEL_NAME = "kv-offload-stand-in"
"""``model_name`` of the hash stand-in (the transformer's names its preset and seed)."""


def default_instance_id() -> str:
    """A fresh id, unique per process and engine, naming the engine's shared host region."""
    return f"engine-{os.getpid()}-{next(_instance_counter)}"


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one ``EngineCore``.

    Attributes:
        model: what computes the tokens: ``ModelKind.HASH`` (the hash stand-in, the default
            here: fast, for tests) or ``ModelKind.TRANSFORMER`` (``vllm.model_executor``; build
            its config with ``EngineConfig.for_transformer``, which fills in its KV geometry).
        model_preset: the transformer's size, a name of ``llama.PRESETS``.
        model_seed: seeds the transformer's weights.
        gpu_block_sizes: tokens per GPU block, one entry per KV-cache group.
        num_gpu_blocks: GPU blocks per group.
        num_layers: attention layers per group (the transformer: its preset's).
        num_kv_heads: KV heads on each worker (the transformer: its preset's).
        head_size: elements per head (the transformer: its preset's).
        dtype: KV dtype name (``float16``, ``bfloat16``, ``float32``).
        kv_layout: layout of the GPU KV tensors.
        tensor_parallel_size: worker ranks (run in this process, one after another).
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens computed per step; prefills are chunked to fit.
        max_model_len: longest request (prompt + output) in tokens; a request reaching it
            finishes length-capped. Default and upper bound: what the GPU KV cache holds.
        enable_prefix_caching: reuse GPU blocks of identical prefixes.
        hash_block_size: tokens per hashed block; defaults to the gcd of the GPU block sizes.
        vocab_size: sampled tokens are below this.
        verify: what the engine's oracle records for its bit-exact check of KV blocks
            (``verification.VerifyMode``: ``loaded`` blocks, ``all`` blocks, ``none``); the check
            itself runs in ``EngineCore.verify_kv``, off the step path.
        intra_op_threads: torch's intra-op threads, set process-wide (``torch.set_num_threads``)
            when the engine starts; 0 leaves torch's setting alone. Default 1: the engine's
            tensors are small, and with more threads every operation ends at a barrier that
            waits for the slowest thread, which on a busy host (tier I/O threads, other
            processes) is a descheduled one (``docs/model.md`` has the measurements).
        kv_connector: the KV connector, by the name ``KVConnectorFactory`` registers it under,
            or its class name in ``kv_connector_module_path`` (an out-of-tree connector).
        kv_connector_module_path: the module of an out-of-tree connector class.
        kv_connector_extra_config: the connector's ``kv_connector_extra_config``; None runs
            without a connector (no offloading).
        enable_kv_events: collect KV events and publish them as encoded ``KVEventBatch`` es.
        model_name: the model's name (part of an offloaded block's identity on disk); empty:
            derived from the model (``HASH_MODEL_NAME``, or the transformer's preset and seed),
            so that tiers never serve one model's KV to another.
        instance_id: names the engine's shared host region; unique per live engine.
        device: where the "GPU" KV cache lives (``"cpu"`` without a GPU).
        record_steps: keep one ``StepRecord`` per step in the stats.
        sliding_windows: per group, the window in tokens of a sliding-window attention group,
            or None for full attention; empty: every group has full attention (see
            ``model.hybrid_stand_in`` for the hybrid model stand-in).
        async_scheduling: schedule step N+1 before step N's output is applied, with one step
            in flight (vLLM's async scheduling); outputs are identical, completions arrive one
            step later.
        record_block_origins: track which offloaded blocks this engine stored itself, and count
            promoted tokens of blocks it had not (``EngineStats.served_not_stored_here``); costs
            memory per block stored, for reports of KV shared between instances.
        freeze_gc_heap: at the end of start-up, collect garbage and then ``gc.freeze()`` what is
            left (as vLLM's engine core does, with ``vllm.utils.gc_utils.freeze_gc_heap``), so
            full collections while serving no longer traverse the start-up heap. That heap
            includes every per-block object of the CPU tier, so a full collection's pause stops
            growing with the cache. The collector keeps running for everything created later;
            objects frozen are never collected as cycles. False leaves the heap alone.
    """

    model: ModelKind = ModelKind.HASH
    model_preset: str = "tiny"
    model_seed: int = 0
    gpu_block_sizes: tuple[int, ...] = (16,)
    num_gpu_blocks: int = 256
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: str = "float16"
    kv_layout: KVLayout = KVLayout.PER_LAYER
    tensor_parallel_size: int = 1
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hash_block_size: int | None = None
    vocab_size: int = 32000
    verify: VerifyMode = VerifyMode.LOADED
    intra_op_threads: int = 1
    kv_connector: str = "OffloadingConnector"
    kv_connector_module_path: str | None = None
    kv_connector_extra_config: Mapping[str, Any] | None = None
    enable_kv_events: bool = True
    model_name: str = ""
    instance_id: str = field(default_factory=default_instance_id)
    device: str = "cpu"
    record_steps: bool = True
    async_scheduling: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    record_block_origins: bool = False
    freeze_gc_heap: bool = True

    def __post_init__(self) -> None:
        if not self.gpu_block_sizes or any(b <= 0 for b in self.gpu_block_sizes):
            raise ValueError(f"gpu_block_sizes must be positive, got {self.gpu_block_sizes}")
        check_at_least(
            self,
            (
                "num_gpu_blocks",
                "num_layers",
                "num_kv_heads",
                "head_size",
                "tensor_parallel_size",
                "max_num_seqs",
                "max_num_batched_tokens",
                "vocab_size",
            ),
        )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        check_at_least(self, ("intra_op_threads",), 0)
        object.__setattr__(self, "model", ModelKind(self.model))
        object.__setattr__(self, "verify", VerifyMode(self.verify))
        if self.model is ModelKind.TRANSFORMER:
            self._check_transformer()
        if not self.model_name:
            object.__setattr__(self, "model_name", self._default_model_name())
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")
        object.__setattr__(self, "kv_layout", KVLayout(self.kv_layout))
        if self.sliding_windows and len(self.sliding_windows) != len(self.gpu_block_sizes):
            raise ValueError(
                f"sliding_windows {self.sliding_windows} must have one entry per group "
                f"({len(self.gpu_block_sizes)})"
            )
        if any(w is not None and w < 1 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be >= 1 token, got {self.sliding_windows}")
        if self.hash_block_size is not None and any(
            b % self.hash_block_size for b in self.gpu_block_sizes
        ):
            raise ValueError(
                f"hash_block_size={self.hash_block_size} must divide every GPU block size "
                f"{list(self.gpu_block_sizes)}"
            )

    @classmethod
    def for_transformer(cls, preset: str = "tiny", **kwargs: Any) -> EngineConfig:
        """A config serving the transformer of size ``preset``, with its KV geometry.

        Args:
            preset: a name of ``vllm.model_executor.models.llama.PRESETS``.
            **kwargs: any other field.
        """
        p = get_preset(preset)
        return cls(
            model=ModelKind.TRANSFORMER,
            model_preset=preset,
            num_layers=p.num_layers,
            num_kv_heads=p.num_kv_heads,
            head_size=p.head_dim,
            **kwargs,
        )

    @property
    def transformer(self) -> LlamaConfig:
        """The transformer's preset (whatever ``model`` is)."""
        return get_preset(self.model_preset)

    def _check_transformer(self) -> None:
        p = self.transformer
        geometry = (self.num_layers, self.num_kv_heads, self.head_size)
        if geometry != (p.num_layers, p.num_kv_heads, p.head_dim):
            raise ValueError(
                f"model preset {p.name!r} has {p.num_layers} layers per group and "
                f"{p.num_kv_heads} KV heads of {p.head_dim}, the config {self.num_layers}, "
                f"{self.num_kv_heads} and {self.head_size} (EngineConfig.for_transformer fills "
                "them in)"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                "the transformer runs on one worker rank (tensor_parallel_size=1); the hash "
                "model serves more"
            )

    def _default_model_name(self) -> str:
        if self.model is ModelKind.HASH:
            return HASH_MODEL_NAME
        return f"kv-offload-llama-{self.model_preset}-seed{self.model_seed}"

    @property
    def torch_dtype(self) -> torch.dtype:
        """The KV dtype."""
        return _DTYPES[self.dtype]

    @property
    def effective_hash_block_size(self) -> int:
        """``hash_block_size`` or the gcd of the GPU block sizes."""
        return self.hash_block_size or math.gcd(*self.gpu_block_sizes)

    @property
    def num_groups(self) -> int:
        """KV-cache groups."""
        return len(self.gpu_block_sizes)

    def gpu_page_bytes(self, group_idx: int) -> int:
        """Bytes one GPU block of one layer (K and V) occupies on one worker."""
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return 2 * self.gpu_block_sizes[group_idx] * self.num_kv_heads * self.head_size * itemsize
