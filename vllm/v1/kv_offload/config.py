# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Parsing and validation of the offloading connector's ``kv_connector_extra_config``.

``OffloadingConfig`` is the single table of accepted keys: each dataclass field is one key, and
its metadata (built by ``_key``) holds the parser and the human-readable description of what is
allowed. Adding a key is one line in that table; unknown keys, missing required keys and bad
values are all reported with the key, the value and what is allowed.

Sizes (``cpu_bytes_to_use``, and the fs tier's ``max_bytes``) are parsed by the one size parser
``vllm.v1.kv_offload.sizes.parse_size``, which the command's size flags use too.

Example::

    cfg = OffloadingConfig.from_extra_config(
        {"cpu_bytes_to_use": "8GB", "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kv"}]}
    )
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from typing_extensions import Self

from vllm.kv_copy.method_choice import DEFAULT_DMA_MIN_CHUNK_BYTES
from vllm.v1.kv_offload.sizes import SIZE_FORMS, SizeError, parse_size

_EXTRA_CONFIG = "kv_connector_extra_config"

BUILTIN_SPEC_NAMES: tuple[str, ...] = ("CPUOffloadingSpec", "TieringOffloadingSpec")
"""Spec classes selectable by name without ``spec_module_path``."""

BUILTIN_EVICTION_POLICIES: tuple[str, ...] = ("lru", "arc")
"""Cache policies shipped in ``vllm.v1.kv_offload.cpu.policies``."""

DEFAULT_MAX_TRACKER_SIZE = 64_000
"""Upstream's default ``max_tracker_size`` of the reuse filter (``cpu/reuse_filter.py``)."""


def _bad_value(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_EXTRA_CONFIG}[{key!r}]={value!r} is invalid: expected {allowed}")


# ---------------------------------------------------------------------------------------------
# Value parsers: (key, raw value) -> normalised value, raising ValueError via _bad_value.
# Each accepts its own output, so a directly constructed OffloadingConfig validates the same way.
# ---------------------------------------------------------------------------------------------

Parser = Callable[[str, Any], Any]


def _parse_int_at_least(key: str, value: Any, minimum: int, allowed: str) -> int:
    """``value`` as an int ``>= minimum``: an int or an integral finite float, never a bool.

    Raises:
        ValueError: any other value (the message says ``allowed``).
    """
    if isinstance(value, bool):
        raise _bad_value(key, value, allowed)
    if isinstance(value, int):
        as_int = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        as_int = int(value)
    else:
        raise _bad_value(key, value, allowed)
    if as_int < minimum:
        raise _bad_value(key, value, allowed)
    return as_int


_POSITIVE_INT = "an integer > 0 (an integral float such as 4e9 is accepted; bools are not)"


def _parse_positive_int(key: str, value: Any) -> int:
    return _parse_int_at_least(key, value, 1, _POSITIVE_INT)


_NON_NEGATIVE_INT = "an integer >= 0 (an integral float such as 2.0 is accepted; bools are not)"


def _parse_non_negative_int(key: str, value: Any) -> int:
    return _parse_int_at_least(key, value, 0, _NON_NEGATIVE_INT)


def _parse_optional_positive_int(key: str, value: Any) -> int | None:
    return None if value is None else _parse_positive_int(key, value)


def _parse_size(key: str, value: Any) -> int:
    try:
        return parse_size(value)
    except SizeError:
        raise _bad_value(key, value, SIZE_FORMS) from None


_POSITIVE_SECONDS = "a finite number of seconds > 0"


def _parse_positive_seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_value(key, value, _POSITIVE_SECONDS)
    as_float = float(value)
    if not (math.isfinite(as_float) and as_float > 0):
        raise _bad_value(key, value, _POSITIVE_SECONDS)
    return as_float


_BOOL = "true or false (a JSON boolean)"


def _parse_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad_value(key, value, _BOOL)
    return value


def _is_dotted_name(value: str) -> bool:
    return bool(value) and all(part.isidentifier() for part in value.split("."))


_EVICTION_POLICY = (
    f"one of {list(BUILTIN_EVICTION_POLICIES)} or an out-of-tree policy 'package.module:ClassName'"
)


def _parse_eviction_policy(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad_value(key, value, _EVICTION_POLICY)
    if value in BUILTIN_EVICTION_POLICIES:
        return value
    module, sep, class_name = value.partition(":")
    # Syntax only: the policy factory imports and checks the class.
    if sep and _is_dotted_name(module) and class_name.isidentifier():
        return value
    raise _bad_value(key, value, _EVICTION_POLICY)


_SPEC_NAME = (
    f"one of {list(BUILTIN_SPEC_NAMES)}, or any class name when 'spec_module_path' is given"
)


def _parse_spec_name(key: str, value: Any) -> str:
    # Whether the name is builtin is checked in __post_init__, which sees spec_module_path too.
    if not isinstance(value, str) or not value.isidentifier():
        raise _bad_value(key, value, _SPEC_NAME)
    return value


_MODULE_PATH = "a dotted module path such as 'my_pkg.offload_spec'"


def _parse_optional_module_path(key: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _is_dotted_name(value):
        raise _bad_value(key, value, _MODULE_PATH)
    return value


_DIRECTORY = "a non-empty directory path (str or os.PathLike)"


def _parse_directory(key: str, value: Any) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise _bad_value(key, value, _DIRECTORY)
    return value


_DMA_THRESHOLD = (
    f"a size ({SIZE_FORMS}) or 0, for both directions, or a mapping with 'store' and/or 'load' "
    "sizes"
)
_DIRECTIONS = ("store", "load")


def _threshold_size(key: str, value: Any) -> int:
    # A size, or 0 (every job takes DMA), which sizes elsewhere do not allow.
    if isinstance(value, int) and not isinstance(value, bool) and value == 0:
        return 0
    try:
        return parse_size(value)
    except SizeError:
        raise _bad_value(key, value, _DMA_THRESHOLD) from None


def _parse_dma_threshold(key: str, value: Any) -> tuple[int, int]:
    if isinstance(value, tuple) and len(value) == 2:  # the normalised (store, load) form
        return (_threshold_size(key, value[0]), _threshold_size(key, value[1]))
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in _DIRECTIONS]
        if unknown or not value:
            raise _bad_value(key, dict(value), _DMA_THRESHOLD)
        store, load = (
            _threshold_size(f"{key}.{d}", value.get(d, DEFAULT_DMA_MIN_CHUNK_BYTES))
            for d in _DIRECTIONS
        )
        return (store, load)
    size = _threshold_size(key, value)
    return (size, size)


@dataclass(frozen=True)
class SecondaryTierConfig:
    """One entry of ``secondary_tiers``: a tier type and its keyword arguments.

    Attributes:
        type: the registered tier type (e.g. ``"fs"``); the tier factory resolves it.
        kwargs: every other key of the entry, deep-copied and read-only; the tier factory and the
            tier validate them.
    """

    type: str
    kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not isinstance(self.type, str) or not self.type:
            raise ValueError(f"secondary tier 'type' must be a non-empty string, got {self.type!r}")
        if "type" in self.kwargs:
            raise ValueError(f"secondary tier kwargs must not contain 'type': {dict(self.kwargs)}")
        object.__setattr__(self, "kwargs", MappingProxyType(copy.deepcopy(dict(self.kwargs))))

    def to_dict(self) -> dict[str, Any]:
        """Return a fresh mutable ``{"type": ..., **kwargs}`` dict, as the tier factory takes."""
        return {"type": self.type, **copy.deepcopy(dict(self.kwargs))}


_SECONDARY_TIERS = "a list of dicts, each with a non-empty string 'type' key"


def _parse_secondary_tiers(key: str, value: Any) -> tuple[SecondaryTierConfig, ...]:
    if not isinstance(value, (list, tuple)):
        raise _bad_value(key, value, _SECONDARY_TIERS)
    tiers: list[SecondaryTierConfig] = []
    for i, entry in enumerate(value):
        if isinstance(entry, SecondaryTierConfig):
            tiers.append(entry)
            continue
        if not isinstance(entry, Mapping):
            raise _bad_value(f"{key}[{i}]", entry, _SECONDARY_TIERS)
        tier_type = entry.get("type")
        if not isinstance(tier_type, str) or not tier_type:
            raise _bad_value(f"{key}[{i}]", dict(entry), _SECONDARY_TIERS)
        tiers.append(
            SecondaryTierConfig(tier_type, {k: v for k, v in entry.items() if k != "type"})
        )
    return tuple(tiers)


# ---------------------------------------------------------------------------------------------
# The key table
# ---------------------------------------------------------------------------------------------

_PARSER = "parser"
_DOC = "doc"


def _key(parser: Parser, doc: str) -> Mapping[str, Any]:
    """Field metadata declaring one key: how to parse it and what it allows."""
    return MappingProxyType({_PARSER: parser, _DOC: doc})


@dataclass(frozen=True, kw_only=True)
class OffloadingConfig:
    """Validated ``kv_connector_extra_config`` of the offloading connector (immutable).

    Each field is one key; build it with ``from_extra_config``. Constructing it directly runs the
    same per-key validation and normalisation.

    Attributes:
        cpu_bytes_to_use: host bytes for the CPU tier, in total across all workers; any size
            form of ``vllm.v1.kv_offload.sizes`` (``8e9``, ``"8GB"``, ``"20GiB"``).
        block_size: offloaded block size in tokens; None means the GPU block size.
        eviction_policy: ``"lru"``, ``"arc"`` or ``"package.module:ClassName"``.
        spec_name: the ``OffloadingSpec`` class to use.
        spec_module_path: module to import ``spec_name`` from, for out-of-tree specs.
        secondary_tiers: ordered secondary tiers behind the CPU tier.
        shared_region_dir: directory of the shared host region's backing file.
        shared_region_join_timeout_s: how long a process keeps retrying when the region's file
            vanishes under it (a creator that gave up) before it gives up too.
        offload_prompt_only: store only blocks made entirely of prompt tokens, not blocks that
            hold generated tokens (those are rarely shared by another request).
        store_threshold: the reuse filter (upstream's key and default): with 2 or more, a block
            is stored in the CPU tier only from its ``store_threshold``-th offer on, so one-off
            prompts cost no write bandwidth; 0 (default) or 1 stores every block offered.
        max_tracker_size: most block keys whose offers the reuse filter counts (upstream's
            default 64,000); ignored without the filter.
        copy_dma_min_chunk_bytes: ``(store, load)``: with the KV cache on a GPU, jobs whose mean
            contiguous chunk has at least this many bytes take the batched DMA path, smaller
            ones the SM-copy kernel (``vllm.kv_copy.method_choice``; default 1 MiB each way, the
            H200 crossover). Given as one size or ``{"store": size, "load": size}``.
        load_guard: load a hit only when loading it is estimated faster than computing it
            (``offloading/load_guard.py``, ``docs/load_guard.md``); False loads every hit.
    """

    # fmt: off
    cpu_bytes_to_use: int = field(metadata=_key(_parse_size, SIZE_FORMS))
    block_size: int | None = field(default=None, metadata=_key(_parse_optional_positive_int, _POSITIVE_INT))  # noqa: E501
    eviction_policy: str = field(default="lru", metadata=_key(_parse_eviction_policy, _EVICTION_POLICY))  # noqa: E501
    spec_name: str = field(default="CPUOffloadingSpec", metadata=_key(_parse_spec_name, _SPEC_NAME))
    spec_module_path: str | None = field(default=None, metadata=_key(_parse_optional_module_path, _MODULE_PATH))  # noqa: E501
    secondary_tiers: tuple[SecondaryTierConfig, ...] = field(default=(), metadata=_key(_parse_secondary_tiers, _SECONDARY_TIERS))  # noqa: E501
    shared_region_dir: str = field(default="/dev/shm", metadata=_key(_parse_directory, _DIRECTORY))
    shared_region_join_timeout_s: float = field(default=30.0, metadata=_key(_parse_positive_seconds, _POSITIVE_SECONDS))  # noqa: E501
    offload_prompt_only: bool = field(default=False, metadata=_key(_parse_bool, _BOOL))
    store_threshold: int = field(default=0, metadata=_key(_parse_non_negative_int, _NON_NEGATIVE_INT))  # noqa: E501
    max_tracker_size: int = field(default=DEFAULT_MAX_TRACKER_SIZE, metadata=_key(_parse_positive_int, _POSITIVE_INT))  # noqa: E501
    copy_dma_min_chunk_bytes: tuple[int, int] = field(default=(DEFAULT_DMA_MIN_CHUNK_BYTES, DEFAULT_DMA_MIN_CHUNK_BYTES), metadata=_key(_parse_dma_threshold, _DMA_THRESHOLD))  # noqa: E501
    load_guard: bool = field(default=True, metadata=_key(_parse_bool, _BOOL))
    # fmt: on

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            parser: Parser = f.metadata[_PARSER]
            object.__setattr__(self, f.name, parser(f.name, getattr(self, f.name)))
        if self.spec_module_path is None and self.spec_name not in BUILTIN_SPEC_NAMES:
            raise _bad_value("spec_name", self.spec_name, _SPEC_NAME)

    @classmethod
    def allowed_keys(cls) -> tuple[str, ...]:
        """Every key ``from_extra_config`` accepts, in table order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Self:
        """Parse and validate a ``kv_connector_extra_config`` mapping.

        Args:
            extra: the raw mapping (typically decoded JSON); None is treated as empty.

        Raises:
            TypeError: ``extra`` is not a mapping.
            ValueError: an unknown key (listing the allowed keys, with a suggestion when one is
                close), a missing required key, or a bad value (naming the key, the value and
                what is allowed).
        """
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise TypeError(
                f"{_EXTRA_CONFIG} must be a mapping (a JSON object), got "
                f"{type(extra).__name__}: {extra!r}"
            )
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in extra if k not in fields]
        if unknown:
            raise ValueError(_unknown_keys_message(unknown, tuple(fields)))
        for name, f in fields.items():
            if name not in extra and f.default is dataclasses.MISSING:
                raise ValueError(
                    f"{_EXTRA_CONFIG} is missing required key {name!r}: expected {f.metadata[_DOC]}"
                )
        return cls(**extra)


def _unknown_keys_message(unknown: list[Any], allowed: tuple[str, ...]) -> str:
    parts = []
    for key in unknown:
        part = repr(key)
        close = difflib.get_close_matches(key, allowed, n=1) if isinstance(key, str) else []
        if close:
            part += f" (did you mean {close[0]!r}?)"
        parts.append(part)
    return (
        f"{_EXTRA_CONFIG} has unknown key(s) {', '.join(parts)}; allowed keys: {', '.join(allowed)}"
    )


parse_offloading_config = OffloadingConfig.from_extra_config
"""Alias of ``OffloadingConfig.from_extra_config``."""
