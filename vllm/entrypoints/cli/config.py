# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The settings of one ``vllm-kv-offload run``: one config object per layer, built once.

``build_run_config`` turns the parsed options (``options.py``) into a ``RunConfig`` after
checking them against each other and against the machine (``checks.py``); a refusal raises
``OptionError``, which ``main`` reports as a usage error (exit code 2). Each layer is handed the
object it needs and nothing else:

- ``WorkloadConfig`` (``workloads.py``): what the clients send.
- ``EngineConfig`` (``vllm/v1/engine/config.py``): the engine of the baseline run, as built
  here; the offloaded run's is the same plus the connector (``engine_run.engine_config``).
- ``TiersConfig``: the offloaded run's tiers (CPU, fs, redis), which become the connector's
  ``kv_connector_extra_config`` (``TiersConfig.connector_config``).
- ``FleetConfig``: how many engine instances serve, in their own processes (``fleet.py``).
- ``OutputConfig``: where the report, JSON, plot, progress and metrics go (``run.py``).
- ``RunConfig.settings``: the options echoed in the report (header and ``--json``).

Checks come cheapest first, so that a bad option is refused in well under a second: values
against each other and the machine before torch is imported (the engine's config needs it).

To add an option: a row in its group of ``options.py``, then a line in the builder below that
puts its value into the layer config it belongs to (a new field there, with its docstring line),
and, if the report should echo it, a key in ``_settings``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVEventsConfig
from vllm.entrypoints.cli import checks
from vllm.entrypoints.cli.option_values import default_fs_root
from vllm.entrypoints.cli.options import DTYPE_BYTES, HASH_GEOMETRY
from vllm.entrypoints.cli.workloads import (
    WORKLOAD_DEFAULTS,
    WorkloadConfig,
    WorkloadKind,
    max_request_tokens,
)
from vllm.model_executor.models.llama_config import PRESETS

if TYPE_CHECKING:
    from vllm.v1.engine.config import EngineConfig

FS_TIER_TYPE = "fs"
"""Registered type name of the filesystem tier (``secondary_tiers[i]["type"]``)."""
REDIS_TIER_TYPE = "redis"
"""Registered type name of the redis tier."""
COMPARE_TTL_S = 3600.0
"""Expiry of the blocks ``--compare-routing`` stores under its own redis namespaces."""
LOG_LEVELS = (logging.WARNING, logging.INFO, logging.DEBUG)
"""The logging level of ``-v`` given 0, 1, 2 times."""
SMALL_BATCH_TOKENS = 128
"""Below this ``--max-num-batched-tokens`` a run is warned about: prefills are chunked into so
many steps that per-step costs, not the work, decide its time."""


class OptionError(ValueError):
    """An option's value is refused: the message names the option, the value and the fix."""


@dataclass(frozen=True)
class FsTierOptions:
    """The fs tier of the offloaded run.

    Attributes:
        root: the tier's root directory (the instance's own, in a fleet).
        max_bytes: the tier's capacity bound.
        read_threads, write_threads: the tier's I/O threads.
    """

    root: Path
    max_bytes: int
    read_threads: int = 2
    write_threads: int = 2


@dataclass(frozen=True)
class RedisTierOptions:
    """The redis tier of the offloaded run (shared by every engine instance).

    Attributes:
        url: the server's URL (``--redis-url``; credentials included: never print it), or None
            when ``url_env`` names the variable that holds it.
        url_env: the environment variable holding the URL (``--redis-url-env``).
        password_file: the file holding the password (``--redis-password-file``).
        cluster: the URL names a node of a Redis Cluster (``--redis-cluster``).
        integrity_key_file: the fleet secret authenticating every block
            (``--integrity-key-file``).
        namespace: the tier's key namespace (None: the tier's default, the run's identity);
        ttl_s: with it, the expiry of its blocks (None: they do not expire).
    """

    url: str | None = field(default=None, repr=False)
    url_env: str | None = None
    password_file: Path | None = None
    cluster: bool = False
    integrity_key_file: Path | None = None
    namespace: str | None = None
    ttl_s: float | None = None

    @property
    def option(self) -> str:
        """The option that names the server (for messages)."""
        return "--redis-url" if self.url_env is None else f"--redis-url-env {self.url_env}"

    def tier_kwargs(self) -> dict[str, Any]:
        """The tier's ``secondary_tiers`` entry, without ``type`` (``docs/redis_tier.md``)."""
        kwargs: dict[str, Any] = (
            {"url": self.url} if self.url_env is None else {"url_env": self.url_env}
        )
        if self.password_file is not None:
            kwargs["password_file"] = str(self.password_file)
        if self.cluster:
            kwargs["cluster"] = True
        if self.integrity_key_file is not None:
            kwargs["integrity_key_file"] = str(self.integrity_key_file)
        if self.namespace is not None:
            kwargs["namespace"] = self.namespace
        if self.ttl_s is not None:
            kwargs["ttl_s"] = self.ttl_s
        return kwargs

    def shown_url(self) -> str:
        """The server's URL with its password masked (what the report shows)."""
        from vllm.v1.kv_offload.tiering.redis.redaction import redact_url

        url = self.url if self.url_env is None else os.environ.get(self.url_env, "")
        return redact_url(url or "")


@dataclass(frozen=True)
class TiersConfig:
    """The offloaded run's tiers: the CPU tier, then the fs tier, then the redis tier.

    Attributes:
        cpu_bytes: host bytes of the CPU tier.
        eviction_policy: the CPU tier's cache policy (``lru``, ``arc``).
        block_size: tokens per offloaded block (a multiple of the GPU block size).
        fs: the fs tier; None runs without one.
        redis: the redis tier (after the fs tier); None runs without one.
        load_guard: False turns the load guard off (``load_guard: false``); True leaves the
            key to its default (on, but off for the hash stand-in).
    """

    cpu_bytes: int
    eviction_policy: str
    block_size: int
    fs: FsTierOptions | None = None
    redis: RedisTierOptions | None = None
    load_guard: bool = True

    def connector_config(self) -> dict[str, Any]:
        """The offloading connector's ``kv_connector_extra_config`` (``docs/configuration.md``)."""
        cfg: dict[str, Any] = {
            "cpu_bytes_to_use": self.cpu_bytes,
            "eviction_policy": self.eviction_policy,
            "block_size": self.block_size,
        }
        if not self.load_guard:
            cfg["load_guard"] = False
        if self.fs is None and self.redis is None:
            cfg["spec_name"] = "CPUOffloadingSpec"
            return cfg
        cfg["spec_name"] = "TieringOffloadingSpec"
        tiers: list[dict[str, Any]] = []
        if self.fs is not None:
            tiers.append(
                {
                    "type": FS_TIER_TYPE,
                    "root_dir": str(self.fs.root),
                    "n_read_threads": self.fs.read_threads,
                    "n_write_threads": self.fs.write_threads,
                    "max_bytes": self.fs.max_bytes,
                }
            )
        if self.redis is not None:
            # After the fs tier: lookups ask the local disk before the network.
            tiers.append({"type": REDIS_TIER_TYPE, **self.redis.tier_kwargs()})
        cfg["secondary_tiers"] = tiers
        return cfg

    def for_comparison(self, tag: str) -> TiersConfig:
        """Fresh storage for one policy's run of ``--compare-routing``: the fs directories under
        ``<root>/compare-<tag>`` and the redis namespace ``kvo-compare-<tag>`` (blocks expire
        after ``COMPARE_TTL_S``), so every policy starts from the same empty tiers."""
        fs = (
            None
            if self.fs is None
            else dataclasses.replace(self.fs, root=self.fs.root / f"compare-{tag}")
        )
        redis = (
            None
            if self.redis is None
            else dataclasses.replace(
                self.redis, namespace=f"kvo-compare-{tag}", ttl_s=COMPARE_TTL_S
            )
        )
        return dataclasses.replace(self, fs=fs, redis=redis)

    def for_instance(self, index: int) -> TiersConfig:
        """The tiers of fleet instance ``index``: its own fs directory under the root."""
        if self.fs is None:
            return self
        fs = dataclasses.replace(self.fs, root=self.fs.root / f"engine-{index}")
        return dataclasses.replace(self, fs=fs)


@dataclass(frozen=True)
class FleetConfig:
    """The engine instances that serve the workload, and how the front end routes to them.

    Attributes:
        engines: engine instances; > 1 runs each in its own process (``fleet.py``).
        routing: the routing policy (``vllm/entrypoints/router/policies.py``); ``kv-aware``
            subscribes to the instances' KV events (``fleet_events.py``).
        compare_routing: serve the offloaded run once per policy (``ROUTING_POLICIES``) and
            compare them; ``routing`` is then the one the main report shows.
    """

    engines: int = 1
    routing: str = "round-robin"
    compare_routing: bool = False

    @property
    def enabled(self) -> bool:
        """Whether the engines run in processes of their own (more than one)."""
        return self.engines > 1


@dataclass(frozen=True)
class OutputConfig:
    """Where the report goes besides the text on stdout, and what is shown while it runs.

    Attributes:
        json_path: where to write the JSON report (``-``: stdout, the text going to stderr).
        plot_path: where to write the plot.
        progress: draw progress on stderr.
        metrics_port: serve Prometheus metrics on ``127.0.0.1`` at this port during the runs
            (in a fleet instance: record them for the command's process, which serves them).
        log_level: the logging level of the command and of every fleet instance (``-v``).
    """

    json_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = True
    metrics_port: int | None = None
    log_level: int = logging.WARNING

    @property
    def json_to_stdout(self) -> bool:
        """``--json -``: the document goes to stdout and the text report to stderr."""
        return self.json_path is not None and str(self.json_path) == checks.STDOUT


@dataclass(frozen=True)
class RunConfig:
    """Everything one invocation of ``run`` runs with (see the module docstring).

    Attributes:
        workload: what the clients send.
        engine: the baseline's engine (no connector); see ``engine_run.engine_config``.
        tiers: the offloaded run's tiers.
        fleet: the engine instances.
        events: where each engine instance publishes its KV events (``fleet_events.py``).
        output: the report's destinations.
        timeout_s: longest time one run may take (None: no limit).
        settings: the options echoed in the report (JSON-serialisable values).
    """

    workload: WorkloadConfig
    engine: EngineConfig
    tiers: TiersConfig
    fleet: FleetConfig = field(default_factory=FleetConfig)
    events: KVEventsConfig = field(default_factory=KVEventsConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    timeout_s: float | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)

    def for_instance(self, index: int) -> RunConfig:
        """What fleet instance ``index`` runs with: its own fs directory; no report, plot or
        progress of its own (the command's process renders them), the same metrics and logs."""
        output = OutputConfig(
            progress=False,
            metrics_port=self.output.metrics_port,
            log_level=self.output.log_level,
        )
        return dataclasses.replace(self, tiers=self.tiers.for_instance(index), output=output)


def _workload_config(args: argparse.Namespace) -> WorkloadConfig:
    kind = WorkloadKind(args.workload)
    defaults = WORKLOAD_DEFAULTS.get(kind, {})

    def pick(field_name: str, given: int | None) -> Any:
        if given is not None:
            return given
        return defaults.get(field_name, getattr(WorkloadConfig(), field_name))

    return WorkloadConfig(
        kind=kind,
        seed=args.seed,
        num_clients=pick("num_clients", args.num_clients),
        num_sessions=args.num_sessions,
        turns_per_session=args.turns,
        turn_tokens=args.turn_tokens,
        output_tokens=args.output_tokens,
        system_prompt_tokens=args.system_prompt_tokens,
        num_system_prompts=pick("num_system_prompts", args.num_system_prompts),
        document_tokens=args.document_tokens,
        num_documents=args.num_documents,
        think_time_s=args.think_time,
        arrival_interval_s=args.think_time,
    )


def _geometry(args: argparse.Namespace) -> tuple[int, int, int]:
    """``(layers per group, KV heads, head size)``: the hash model's options, or the
    transformer's preset (which the options may not contradict)."""
    given = {
        "--num-layers": args.num_layers,
        "--num-kv-heads": args.num_kv_heads,
        "--head-size": args.head_size,
    }
    if args.model == "hash":
        layers, kv_heads, head_size = (
            default if value is None else value
            for value, default in zip(given.values(), HASH_GEOMETRY, strict=True)
        )
        return layers, kv_heads, head_size
    flags = [flag for flag, value in given.items() if value is not None]
    if flags:
        raise OptionError(
            f"{', '.join(flags)}: the transformer's KV geometry is its preset's "
            f"(--model-preset {args.model_preset}); these options are for --model hash"
        )
    p = PRESETS[args.model_preset]
    return p.num_layers, p.num_kv_heads, p.head_dim


def _kv_bytes_per_token(args: argparse.Namespace) -> int:
    # K and V of every layer and head, in every KV-cache group (hybrid: two).
    groups = 2 if args.model_stand_in == "hybrid" else 1
    layers, kv_heads, head_size = _geometry(args)
    return 2 * layers * kv_heads * head_size * DTYPE_BYTES[args.dtype] * groups


def _row_bytes_per_token(args: argparse.Namespace) -> int:
    # A CPU row holds one key, of one group, and the engine gives its bytes per group, so rows
    # are sized per group (``RowLayout.PER_GROUP``): the hybrid stand-in's two groups have the
    # same geometry, so a row is one group's bytes.
    layers, kv_heads, head_size = _geometry(args)
    return 2 * layers * kv_heads * head_size * DTYPE_BYTES[args.dtype]


def _tiers_config(args: argparse.Namespace) -> TiersConfig:
    offload_block_size = args.offload_block_size or args.block_size
    if offload_block_size % args.block_size:
        raise OptionError(
            f"--offload-block-size {offload_block_size} must be a multiple of --block-size "
            f"{args.block_size}"
        )
    if args.no_fs and (args.fs_root is not None or args.fs_clear):
        flag = "--fs-root" if args.fs_root is not None else "--fs-clear"
        raise OptionError(f"{flag} and --no-fs contradict each other")
    fs = None
    if not args.no_fs:
        fs = FsTierOptions(
            root=(args.fs_root or default_fs_root()).expanduser(),
            max_bytes=args.fs_max_bytes,
            read_threads=args.fs_read_threads,
            write_threads=args.fs_write_threads,
        )
    return TiersConfig(
        cpu_bytes=args.cpu_bytes,
        eviction_policy=args.eviction_policy,
        block_size=offload_block_size,
        fs=fs,
        redis=_redis_options(args),
        load_guard=not args.no_load_guard,
    )


def _redis_options(args: argparse.Namespace) -> RedisTierOptions | None:
    """The redis tier's options, checked against each other (the server is probed later)."""
    if args.redis_url is not None and args.redis_url_env is not None:
        raise OptionError("--redis-url and --redis-url-env name the server twice: keep one")
    if args.redis_url is None and args.redis_url_env is None:
        for flag, value in (
            ("--redis-password-file", args.redis_password_file),
            ("--redis-cluster", args.redis_cluster or None),
            ("--integrity-key-file", args.integrity_key_file),
        ):
            if value is not None:
                raise OptionError(f"{flag} needs a redis tier: add --redis-url or --redis-url-env")
        return None
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    if REDIS_TIER_TYPE not in SecondaryTierFactory.known_tier_types():
        raise OptionError("--redis-url: this installation has no redis tier")
    if args.redis_url_env is not None and not os.environ.get(args.redis_url_env):
        raise OptionError(f"--redis-url-env {args.redis_url_env}: the variable is unset")
    if args.integrity_key_file is not None:
        from vllm.v1.kv_offload.tiering.block_format import IntegrityKey

        try:
            IntegrityKey.from_file(str(args.integrity_key_file))
        except ValueError as e:
            raise OptionError(f"--integrity-key-file: {e}") from None
    return RedisTierOptions(
        url=args.redis_url,
        url_env=args.redis_url_env,
        password_file=args.redis_password_file,
        cluster=args.redis_cluster,
        integrity_key_file=args.integrity_key_file,
    )


def _fleet_config(args: argparse.Namespace) -> FleetConfig:
    if args.engines == 1 and (args.routing is not None or args.compare_routing):
        flag = "--routing" if args.routing is not None else "--compare-routing"
        raise OptionError(f"{flag} routes between engine instances: it needs --engines > 1")
    routing = args.routing or ("kv-aware" if args.engines > 1 else "round-robin")
    return FleetConfig(engines=args.engines, routing=routing, compare_routing=args.compare_routing)


def _events_config(args: argparse.Namespace) -> KVEventsConfig:
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            raise OptionError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        return KVEventsConfig(topic=args.kv_events_topic)
    return KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=args.kv_events_endpoint,
        replay_endpoint=args.kv_events_replay_endpoint,
        topic=args.kv_events_topic,
    )


def _output_config(args: argparse.Namespace) -> OutputConfig:
    if args.plot is not None:
        from vllm.entrypoints.cli.report.plot import PlotUnavailableError, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailableError as e:
            raise OptionError(str(e)) from None
        problem = checks.plot_format_problem(args.plot)
        if problem is not None:
            raise OptionError(problem)
    return OutputConfig(
        json_path=args.json,
        plot_path=args.plot,
        progress=not args.no_progress,
        metrics_port=args.metrics_port,
        log_level=LOG_LEVELS[min(args.verbose, len(LOG_LEVELS) - 1)],
    )


def _machine_problems(
    args: argparse.Namespace, tiers: TiersConfig, output: OutputConfig, engines: int
) -> list[str]:
    """What the machine would refuse later (paths, free space, formats), in option order."""
    page = os.sysconf("SC_PAGE_SIZE")
    row_bytes = -(-tiers.block_size * _row_bytes_per_token(args) // page) * page
    problems: list[str | None] = []
    if tiers.cpu_bytes < row_bytes:
        problems.append(
            f"--cpu-bytes {tiers.cpu_bytes} is smaller than one offloaded block ({row_bytes} "
            f"bytes with this geometry): raise --cpu-bytes to at least {row_bytes}"
        )
    elif not args.fs_clear:
        # The shared region holds whole rows only; every engine instance has its own region.
        problems.append(checks.shm_problem(engines * (tiers.cpu_bytes // row_bytes * row_bytes)))
    if tiers.fs is not None:
        from vllm.v1.kv_offload.tiering.block_format import file_size

        problems.append(checks.fs_root_problem(tiers.fs.root))
        problems.append(checks.fs_max_bytes_problem(tiers.fs.max_bytes, file_size(row_bytes)))
    if output.metrics_port is not None:
        problems.append(checks.metrics_port_problem(output.metrics_port))
    if output.json_path is not None:
        problems.append(checks.output_file_problem("--json", output.json_path))
    if output.plot_path is not None:
        problems.append(checks.output_file_problem("--plot", output.plot_path))
    if tiers.redis is not None and not any(problems):
        # Last: it waits for the network (at most about two of the tier's timeouts).
        problems.append(checks.redis_problem(tiers.redis.option, tiers.redis.tier_kwargs()))
    return [p for p in problems if p is not None]


def _connector_problem(tiers: TiersConfig) -> str | None:
    """What the connector and its tiers would refuse of ``tiers`` when the offloaded run's engine
    starts (after the whole baseline run), asked of their own config parsers now."""
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.fs.config import FsTierConfig
    from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig

    parsers: dict[str, Callable[..., object]] = {
        FS_TIER_TYPE: FsTierConfig.from_kwargs,
        REDIS_TIER_TYPE: RedisTierConfig.from_kwargs,
    }
    try:
        for tier in OffloadingConfig.from_extra_config(tiers.connector_config()).secondary_tiers:
            parsers[tier.type](**tier.kwargs)
    except ValueError as e:
        if tiers.redis is None:
            return f"the offloading connector refuses these options: {e}"
        # The redis tier's messages show a URL with its password masked.
        return f"{tiers.redis.option} {tiers.redis.shown_url()}: {e}"
    return None


def _batch_problem(args: argparse.Namespace, warn: Callable[[str], None]) -> str | None:
    tokens, block = args.max_num_batched_tokens, args.block_size
    if tokens < block:
        return (
            f"--max-num-batched-tokens {tokens} is below one GPU block (--block-size {block}): "
            f"no step could compute a whole block; use at least {block} (default 512)"
        )
    if tokens < SMALL_BATCH_TOKENS:
        warn(
            f"--max-num-batched-tokens {tokens} is below {SMALL_BATCH_TOKENS}: prefills are "
            "chunked into many small steps, so per-step costs decide the run's time (default 512)"
        )
    return None


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``; ``cuda`` without one is refused.

    Raises:
        OptionError: ``cuda`` was asked for and torch sees no CUDA device.
    """
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise OptionError("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
    return requested


def _engine_config(
    args: argparse.Namespace, workload: WorkloadConfig, fleet: FleetConfig
) -> EngineConfig:
    # Imported here, once every cheaper check passed: the engine's modules import torch, and a
    # refused option should not wait for that.
    from vllm.v1.engine.config import EngineConfig
    from vllm.v1.engine.model import ModelStandIn, hybrid_stand_in

    device = resolve_device(args.device)
    block_sizes: tuple[int, ...] = (args.block_size,)
    windows: tuple[int | None, ...] = ()
    if ModelStandIn(args.model_stand_in) is ModelStandIn.HYBRID:
        block_sizes, windows = hybrid_stand_in(args.block_size, args.sliding_window)
    layers, kv_heads, head_size = _geometry(args)
    return EngineConfig(
        model=args.model,
        model_preset=args.model_preset,
        verify=args.verify,
        gpu_block_sizes=block_sizes,
        sliding_windows=windows,
        num_gpu_blocks=args.gpu_blocks,
        num_layers=layers,
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        vocab_size=workload.vocab_size,
        device=device,
        async_scheduling=args.async_scheduling,
        # A fleet tells KV another instance computed from an instance's own.
        record_block_origins=fleet.enabled,
    )


def _settings(
    args: argparse.Namespace,
    workload: WorkloadConfig,
    engine: EngineConfig,
    tiers: TiersConfig,
    fleet: FleetConfig,
    events: KVEventsConfig,
    timeout_s: float | None,
) -> dict[str, Any]:
    """The options echoed in the report (JSON-serialisable; ``docs/cli.md`` lists them)."""
    w = workload
    return {
        "workload": w.kind.value,
        "seed": w.seed,
        "num_clients": w.num_clients,
        "num_sessions": w.num_sessions,
        "turns": w.turns_per_session,
        "turn_tokens": w.turn_tokens,
        "output_tokens": w.output_tokens,
        "system_prompt_tokens": w.system_prompt_tokens,
        "num_system_prompts": w.num_system_prompts,
        "document_tokens": w.document_tokens,
        "num_documents": w.num_documents,
        "think_time_s": w.think_time_s,
        "model": engine.model.value,
        "model_preset": engine.model_preset if engine.model.value == "transformer" else None,
        "model_name": engine.model_name,
        "verify": engine.verify.value,
        **_model_figures(engine),
        "num_layers": engine.num_layers,
        "num_kv_heads": engine.num_kv_heads,
        "head_size": engine.head_size,
        "dtype": engine.dtype,
        "block_size": args.block_size,
        "offload_block_size": tiers.block_size,
        "block_bytes": args.block_size * _kv_bytes_per_token(args),
        "gpu_blocks": engine.num_gpu_blocks,
        "min_gpu_blocks": -(-max_request_tokens(w) // args.block_size),
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "cpu_bytes": tiers.cpu_bytes,
        "eviction_policy": tiers.eviction_policy,
        # Whether the offloaded run's connector guards its loads (never with the hash model).
        "load_guard": tiers.load_guard and engine.model.value == "transformer",
        "fs_root": None if tiers.fs is None else str(tiers.fs.root),
        "fs_max_bytes": None if tiers.fs is None else tiers.fs.max_bytes,
        "redis_url": None if tiers.redis is None else tiers.redis.shown_url(),
        "redis_cluster": tiers.redis is not None and tiers.redis.cluster,
        "integrity_key_id": _integrity_key_id(tiers.redis),
        "engines": fleet.engines,
        "routing": fleet.routing if fleet.enabled else None,
        "compare_routing": fleet.compare_routing,
        "kv_events_endpoint": events.endpoint if events.enable_kv_cache_events else None,
        "kv_events_replay_endpoint": events.replay_endpoint,
        "device": engine.device,
        "timeout_s": timeout_s,
        "async_scheduling": engine.async_scheduling,
        "model_stand_in": args.model_stand_in,
        "sliding_window": args.sliding_window if args.model_stand_in == "hybrid" else None,
    }


def _integrity_key_id(redis: RedisTierOptions | None) -> str | None:
    """The key id of the fleet secret (hex), or None: blocks not authenticated."""
    if redis is None or redis.integrity_key_file is None:
        return None
    from vllm.v1.kv_offload.tiering.block_format import IntegrityKey

    return IntegrityKey.from_file(str(redis.integrity_key_file)).key_id.hex()


def _model_figures(engine: EngineConfig) -> dict[str, Any]:
    """The transformer's size for the header (None for the hash stand-in)."""
    if engine.model.value != "transformer":
        return {"model_params": None, "model_d_model": None, "model_heads": None}
    p = PRESETS[engine.model_preset]
    return {
        "model_params": p.num_parameters(engine.vocab_size, engine.num_groups),
        "model_d_model": p.hidden_size,
        "model_heads": p.num_heads,
    }


def build_run_config(
    args: argparse.Namespace, warn: Callable[[str], None] = lambda message: None
) -> RunConfig:
    """Check the parsed options of ``run`` and build the ``RunConfig`` of the invocation.

    Everything that can be checked before the first engine step is checked here, cheapest
    first: values against each other and what the connector and its tiers would refuse, then
    against the machine (``checks``: the fs root, free space in ``/dev/shm``, the metrics port,
    output files, the plot's format), then what needs torch (the device).

    Args:
        args: the parsed options of ``run``.
        warn: told each accepted value that will probably not do what the user wants.

    Raises:
        OptionError: a value is refused (the first problem found).
    """
    problem = _batch_problem(args, warn)
    if problem is not None:
        raise OptionError(problem)
    tiers = _tiers_config(args)
    problem = _connector_problem(tiers)
    if problem is not None:
        raise OptionError(problem)
    output = _output_config(args)
    fleet = _fleet_config(args)
    events = _events_config(args)
    workload = _workload_config(args)
    longest = max_request_tokens(workload)
    blocks_needed = -(-longest // args.block_size)
    if blocks_needed > args.gpu_blocks:
        raise OptionError(
            f"--gpu-blocks {args.gpu_blocks} cannot hold the longest request of this workload "
            f"(up to {longest} tokens = {blocks_needed} blocks of {args.block_size}): raise "
            "--gpu-blocks or shrink the workload"
        )
    problems = _machine_problems(args, tiers, output, fleet.engines)
    if problems:
        raise OptionError(problems[0])
    engine = _engine_config(args, workload, fleet)
    timeout_s = args.timeout or None
    return RunConfig(
        workload=workload,
        engine=engine,
        tiers=tiers,
        fleet=fleet,
        events=events,
        output=output,
        timeout_s=timeout_s,
        settings=_settings(args, workload, engine, tiers, fleet, events, timeout_s),
    )
