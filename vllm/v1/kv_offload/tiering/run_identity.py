# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The run identity shared by the secondary tiers that store bytes (fs, redis).

A block's bytes depend on the model and on how its KV cache is laid out; two runs may share stored
blocks only if every such field is equal. ``run_fields_from_spec`` lists those fields (model,
dtype, KV layout, geometry, block sizes, sliding windows, parallel sizes, row size, block format
version), and ``RunIdentity`` derives from them:

* ``digest``: the SHA-256 of the fields as canonical JSON (sorted keys, compact separators),
  stamped into every block header (``tiering.block_format``), so a block of another run is
  refused however it got there;
* ``name``: ``<model>_<first 16 hex digits of the digest>``, where ``<model>`` is the model name
  reduced to ``[A-Za-z0-9._-]`` (other characters become ``_``), without leading dots or dashes,
  at most 64 characters. The fs tier names its run directory with it, the redis tier its default
  key namespace; runs with equal fields get equal names, different runs never share one.

``sliding_windows`` is a field only when some group has a window, so the identities of
full-attention runs are those of the layouts that predate the field (their caches stay warm);
likewise ``row_layout`` only for rows laid out per KV-cache group (``RowLayout.PER_GROUP``), so
a run whose blocks were written with the earlier layout finds none of them: another run
directory, another key namespace, and a digest every block header of the old run fails.

Pure computation, no I/O; thread-safe (immutable results).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.kv_offload.spec import RowLayout
from vllm.v1.kv_offload.tiering.block_format import FORMAT_VERSION

if TYPE_CHECKING:
    from vllm.v1.kv_offload.spec import OffloadingSpec

DIGEST_HEX_CHARS = 16
"""Hex digits of the digest in ``RunIdentity.name``."""
_MAX_MODEL_CHARS = 64
_MODEL_UNSAFE_RE = re.compile(r"[^A-Za-z0-9._-]")


def sanitize_model_name(model_name: str) -> str:
    """Reduce ``model_name`` to a safe single path component (see the module docstring)."""
    cleaned = _MODEL_UNSAFE_RE.sub("_", model_name).lstrip(".-")[:_MAX_MODEL_CHARS]
    return cleaned or "model"


def canonical_json(fields: Mapping[str, Any]) -> str:
    """Sorted-key, compact JSON: equal fields always give equal text (and digest)."""
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def run_fields_from_spec(spec: OffloadingSpec, row_bytes: int) -> dict[str, Any]:
    """The run fields that determine a stored block's bytes.

    Args:
        spec: the run's offloading spec.
        row_bytes: bytes of one primary row, i.e. of a stored block's payload.
    """
    run = spec.run
    fields: dict[str, Any] = {
        "inference_engine": "vllm",
        "format_version": FORMAT_VERSION,
        "model_name": run.model_name,
        "dtype": run.dtype,
        "kv_layout": run.kv_layout,
        "num_layers": run.num_layers,
        "num_kv_heads": run.num_kv_heads,
        "head_size": run.head_size,
        "gpu_block_sizes": list(run.gpu_block_sizes),
        "gpu_kv_bytes_per_block": run.gpu_kv_bytes_per_block,
        "offloaded_block_size": spec.offloaded_block_size,
        "num_kv_cache_groups": len(run.gpu_block_sizes),
        "tensor_parallel_size": run.tensor_parallel_size,
        "pipeline_parallel_size": run.pipeline_parallel_size,
        "row_bytes": row_bytes,
    }
    # A window changes what the model computed into a group's blocks (a sliding-window layer
    # attends to fewer tokens), so runs that differ only in a window must not share blocks. Only
    # added when a window is set: full-attention runs (``()`` or all None) keep the identity they
    # had before windows existed, so their existing caches stay warm.
    if any(w is not None for w in run.sliding_windows):
        fields["sliding_windows"] = list(run.sliding_windows)
    # Where each group's bytes sit in a row. Per-group rows (``RowLayout.PER_GROUP``) put every
    # group's block at the row's start; a shared-rows block of the same run has them at other
    # offsets, and page rounding can make both ``row_bytes`` equal, so the layout must be part
    # of the identity. Only added for per-group rows: single-group runs, and multi-group runs
    # with shared rows, keep the identity they had before the field (their caches stay warm).
    if spec.row_layout is RowLayout.PER_GROUP:
        fields["row_layout"] = spec.row_layout.value
    return fields


@dataclass(frozen=True, slots=True)
class RunIdentity:
    """What identifies a run's stored blocks (see the module docstring).

    Attributes:
        fields: the identity fields.
        config_json: ``fields`` as canonical JSON.
        digest: SHA-256 of ``config_json`` (32 bytes), stamped into every block header.
        name: ``<model>_<digest prefix>``.
    """

    fields: Mapping[str, Any]
    config_json: str
    digest: bytes
    name: str

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> RunIdentity:
        """The identity of ``fields``.

        Raises:
            ValueError: ``fields`` has no string ``model_name``.
        """
        model_name = fields.get("model_name")
        if not isinstance(model_name, str):
            raise ValueError(f"run fields need a string 'model_name', got {model_name!r}")
        config_json = canonical_json(fields)
        digest = hashlib.sha256(config_json.encode())
        return cls(
            fields=dict(fields),
            config_json=config_json,
            digest=digest.digest(),
            name=f"{sanitize_model_name(model_name)}_{digest.hexdigest()[:DIGEST_HEX_CHARS]}",
        )

    @classmethod
    def from_spec(cls, spec: OffloadingSpec, row_bytes: int) -> RunIdentity:
        """The identity of the run ``spec`` describes, with rows of ``row_bytes``."""
        return cls.from_fields(run_fields_from_spec(spec, row_bytes))
