"""Options of ``vllm-kv-offload run``: argparse definitions, value parsers and validation.

The options are declared as a table: one ``_Option`` row per flag, one function per concern
(workload, model stand-in and engine, CPU tier, fs tier, output), each becoming an argparse
argument group of ``--help``.

Every option is checked before anything runs; a bad value ends the command with argparse's
usage line, a message that names the option, the value and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm.entrypoints.cli.workloads import WorkloadConfig, WorkloadKind, max_request_tokens

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
"""KV-cache dtypes the model stand-in supports, with their element sizes."""

EVICTION_POLICIES = ("lru", "arc")
DEVICES = ("auto", "cpu", "cuda")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    # Bare k/m/g/t are binary, as in the fs tier's own size parser.
    "k": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Parse a byte count such as ``4096``, ``64MiB``, ``1.5GB`` or ``4e9``.

    Raises:
        argparse.ArgumentTypeError: not a size, not a whole number of bytes, or not > 0.
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: expected a number of bytes with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 64MiB"
        )
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value < 1 or not value.is_integer():
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: must be a whole number of bytes >= 1"
        )
    return int(value)


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    # argparse prefixes an ArgumentTypeError's message with the option's name.
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def default_fs_root() -> Path:
    """``$XDG_CACHE_HOME/vllm-kv-offload`` (``~/.cache/vllm-kv-offload`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "vllm-kv-offload"


@dataclass(frozen=True)
class RunOptions:
    """Validated settings of one ``run`` invocation.

    Attributes:
        workload: what to serve.
        num_layers, num_kv_heads, head_size, dtype: geometry of the model stand-in's KV cache.
        block_size: tokens per GPU block.
        offload_block_size: tokens per offloaded block (a multiple of ``block_size``).
        gpu_blocks: blocks in the GPU KV-cache pool.
        max_num_seqs: requests the engine runs at once.
        max_num_batched_tokens: tokens per engine step (prefills are chunked to fit).
        cpu_bytes: host bytes of the CPU tier.
        eviction_policy: the CPU tier's cache policy.
        fs_root: root of the fs tier; None runs without one.
        fs_max_bytes: capacity bound of the fs tier (None: bounded by the filesystem).
        fs_read_threads, fs_write_threads: the fs tier's I/O threads.
        device: ``"cpu"`` or ``"cuda"`` (``auto`` is resolved before this is built).
        json_path: where to write the JSON report, if anywhere.
        plot_path: where to write the plot, if anywhere.
        progress: whether to draw progress bars (on a terminal only).
        timeout_s: longest time one run may take (None: no limit).
        metrics_port: serve Prometheus metrics on ``127.0.0.1`` at this port during the runs
            (None: no server).
    """

    workload: WorkloadConfig
    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    offload_block_size: int
    gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    cpu_bytes: int
    eviction_policy: str
    fs_root: Path | None
    fs_max_bytes: int | None
    fs_read_threads: int
    fs_write_threads: int
    device: str
    json_path: Path | None
    plot_path: Path | None
    progress: bool
    timeout_s: float | None
    metrics_port: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token occupies in the KV cache (K and V of every layer and head)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * DTYPE_BYTES[self.dtype]

    @property
    def gpu_block_bytes(self) -> int:
        """Bytes of one GPU block."""
        return self.block_size * self.kv_bytes_per_token

    @property
    def offload_block_bytes(self) -> int:
        """Bytes of one offloaded block (before the CPU tier pads rows to the page size)."""
        return self.offload_block_size * self.kv_bytes_per_token


@dataclass(frozen=True)
class _Option:
    """One row of the option table: a flag and what ``add_argument`` gets for it.

    Attributes:
        flag: the option string, e.g. ``--num-clients``.
        help: what the option does; may be empty when the flag says it all.
        type: parser of the value (None: the string itself, or a flag with ``action``).
        default: the value when the option is absent.
        default_text: what the help's ``(default: ...)`` says: ``%(default)s`` (the value),
            a fixed text where the value reads badly (a size in bytes), or None for no note.
        choices, metavar, action: passed to ``add_argument`` when set.
    """

    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    default_text: str | None = "%(default)s"
    choices: Sequence[str] | None = None
    metavar: str | None = None
    action: str | None = None

    def add_to(self, group: argparse._ArgumentGroup) -> None:
        """Declare this option on ``group``."""
        kwargs: dict[str, Any] = {"default": self.default}
        for name in ("type", "choices", "metavar", "action"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        help_text = self.help
        if self.default_text is not None:
            note = f"(default: {self.default_text})"
            help_text = f"{help_text} {note}" if help_text else note
        group.add_argument(self.flag, help=help_text, **kwargs)


def _count(
    flag: str, default: int, help: str = "", minimum: int = 1, maximum: int | None = None
) -> _Option:
    """An integer option in ``[minimum, maximum]``: the common shape (counts, token lengths)."""
    return _Option(flag, help, type=_int_at_least(minimum, maximum), default=default)


def _choice(flag: str, choices: Sequence[str], default: str, help: str = "") -> _Option:
    return _Option(flag, help, default=default, choices=choices)


def _seconds(flag: str, default: float, help: str) -> _Option:
    return _Option(flag, help, type=_non_negative_float, default=default, metavar="SECONDS")


def _size(flag: str, default: str, help: str) -> _Option:
    # The help quotes the default as written ("20MiB"), not as the byte count it parses to.
    return _Option(
        flag,
        help,
        type=parse_size,
        default=parse_size(default),
        default_text=default,
        metavar="SIZE",
    )


def _switch(flag: str, help: str) -> _Option:
    """A ``store_true`` flag (off by default, so the help needs no default note)."""
    return _Option(flag, help, default=False, default_text=None, action="store_true")


def _output_path(flag: str, metavar: str, help: str) -> _Option:
    """A file to write (none by default, so the help needs no default note)."""
    return _Option(flag, help, type=Path, default_text=None, metavar=metavar)


def _workload_options() -> tuple[_Option, ...]:
    """What to serve: the workload kind and its shape (defaults of ``WorkloadConfig``)."""
    d = WorkloadConfig()
    return (
        _choice(
            "--workload",
            [k.value for k in WorkloadKind],
            WorkloadKind.MIX.value,
            "multi-turn chat, shared system prompts, long documents queried several times, or "
            "a mix of the three",
        ),
        _count("--seed", d.seed, minimum=0),
        _count("--num-clients", d.num_clients, "concurrent clients"),
        _count(
            "--num-sessions", d.num_sessions, "conversations / document sessions in the workload"
        ),
        _count("--turns", d.turns_per_session, "requests per session"),
        _count("--turn-tokens", d.turn_tokens, "mean tokens of a user message or question"),
        _count("--output-tokens", d.output_tokens, "tokens generated per request"),
        _count(
            "--system-prompt-tokens", d.system_prompt_tokens, "length of each shared system prompt"
        ),
        _count("--document-tokens", d.document_tokens, "mean length of a document"),
        _count("--num-documents", d.num_documents, "distinct documents"),
        _seconds("--think-time", d.think_time_s, "mean think time between the turns of a session"),
    )


def _engine_options() -> tuple[_Option, ...]:
    """The model stand-in's KV geometry, the GPU pool, the scheduler limits and the run's bound."""
    return (
        _count("--num-layers", 8),
        _count("--num-kv-heads", 2),
        _count("--head-size", 64),
        _choice("--dtype", sorted(DTYPE_BYTES), "float16"),
        _count("--block-size", 16, "tokens per GPU block"),
        _Option(
            "--offload-block-size",
            "tokens per offloaded block, a multiple of --block-size",
            type=_int_at_least(1),
            default=None,
            default_text="--block-size",
        ),
        _count(
            "--gpu-blocks",
            256,
            "blocks in the GPU KV-cache pool; small enough that prefixes get evicted",
        ),
        _count("--max-num-seqs", 8, "requests running at once"),
        _count(
            "--max-num-batched-tokens", 512, "tokens per engine step; longer prefills are chunked"
        ),
        _choice(
            "--device",
            DEVICES,
            "auto",
            "where the 'GPU' KV cache lives: cuda when available with auto",
        ),
        _seconds(
            "--timeout", 1800.0, "give up (exit code 1) when one run takes longer; 0 waits forever"
        ),
    )


def _cpu_tier_options() -> tuple[_Option, ...]:
    """Size and policy of the CPU (primary) tier."""
    return (
        _size(
            "--cpu-bytes",
            "20MiB",
            "host memory of the CPU tier, e.g. 64MiB; small by default so that the fs tier "
            "serves too",
        ),
        _choice("--eviction-policy", EVICTION_POLICIES, "lru", "the CPU tier's cache policy"),
    )


def _fs_tier_options() -> tuple[_Option, ...]:
    """Where the fs tier lives, its capacity and I/O threads, or none at all."""
    return (
        _Option(
            "--fs-root",
            "root of the fs tier; a second run over the same root starts warm",
            type=Path,
            # Resolved when the parser is built, so the help shows this user's cache directory.
            default_text=str(default_fs_root()),
            metavar="DIR",
        ),
        _size(
            "--fs-max-bytes",
            "1GiB",
            "capacity of the fs tier; least recently used blocks are evicted beyond it",
        ),
        _switch("--no-fs", "run without the fs tier (CPU tier only)"),
        _count("--fs-read-threads", 2, maximum=256),
        _count("--fs-write-threads", 2, maximum=256),
    )


def _output_options() -> tuple[_Option, ...]:
    """Where the report and plot go, and whether progress bars are drawn."""
    return (
        _output_path("--json", "FILE", "write the report as JSON"),
        _output_path(
            "--plot",
            "FILE.png",
            "draw hit rate per tier and bytes moved per step over time (needs matplotlib: "
            "pip install 'vllm-kv-offload[plot]')",
        ),
        _switch(
            "--no-progress",
            "no progress bar (it is drawn on stderr only when stderr is a terminal)",
        ),
        _Option(
            "--metrics-port",
            "serve Prometheus metrics at http://127.0.0.1:PORT/metrics during the runs "
            "(docs/metrics.md)",
            type=_int_at_least(1, 65535),
            default_text=None,
            metavar="PORT",
        ),
    )


_RUN_OPTION_GROUPS: tuple[tuple[str, Callable[[], tuple[_Option, ...]]], ...] = (
    ("workload", _workload_options),
    ("model stand-in and engine", _engine_options),
    ("CPU tier", _cpu_tier_options),
    ("fs tier", _fs_tier_options),
    ("output", _output_options),
)
"""The options of ``run``, one argparse group per concern, in ``--help`` order."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``run`` on ``parser``, one argument group per concern."""
    for title, options in _RUN_OPTION_GROUPS:
        group = parser.add_argument_group(title)
        for option in options():
            option.add_to(group)


def _check_writable_file(parser: argparse.ArgumentParser, option: str, path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.exists() and path.is_dir():
        parser.error(f"{option} {path}: is a directory")
    if not parent.is_dir():
        parser.error(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        parser.error(f"{option} {path}: directory {parent} is not writable")


def _check_fs_root(parser: argparse.ArgumentParser, root: Path) -> None:
    # The tier creates the root; here only what would make it fail later is reported early.
    probe = root
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        parser.error(f"--fs-root {root}: {probe} exists and is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        parser.error(f"--fs-root {root}: {probe} is not writable")


def resolve_device(requested: str) -> str:
    """``auto`` -> ``cuda`` when torch sees a GPU, else ``cpu``."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def build_run_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> RunOptions:
    """Cross-check the parsed values and build ``RunOptions``; errors exit through ``parser``."""
    offload_block_size = args.offload_block_size or args.block_size
    if offload_block_size % args.block_size:
        parser.error(
            f"--offload-block-size {offload_block_size} must be a multiple of --block-size "
            f"{args.block_size}"
        )
    device = resolve_device(args.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (use --device cpu or auto)")
    workload = WorkloadConfig(
        kind=WorkloadKind(args.workload),
        seed=args.seed,
        num_clients=args.num_clients,
        num_sessions=args.num_sessions,
        turns_per_session=args.turns,
        turn_tokens=args.turn_tokens,
        output_tokens=args.output_tokens,
        system_prompt_tokens=args.system_prompt_tokens,
        document_tokens=args.document_tokens,
        num_documents=args.num_documents,
        think_time_s=args.think_time,
        arrival_interval_s=args.think_time,
    )
    longest = max_request_tokens(workload)
    blocks_needed = -(-longest // args.block_size)
    if blocks_needed > args.gpu_blocks:
        parser.error(
            f"--gpu-blocks {args.gpu_blocks} cannot hold the longest request of this workload "
            f"(up to {longest} tokens = {blocks_needed} blocks of {args.block_size}); raise "
            "--gpu-blocks or shrink the workload"
        )
    fs_root: Path | None = None
    if not args.no_fs:
        fs_root = (args.fs_root or default_fs_root()).expanduser()
        _check_fs_root(parser, fs_root)
    elif args.fs_root is not None:
        parser.error("--fs-root and --no-fs contradict each other")
    opts = RunOptions(
        workload=workload,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        dtype=args.dtype,
        block_size=args.block_size,
        offload_block_size=offload_block_size,
        gpu_blocks=args.gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cpu_bytes=args.cpu_bytes,
        eviction_policy=args.eviction_policy,
        fs_root=fs_root,
        fs_max_bytes=None if fs_root is None else args.fs_max_bytes,
        fs_read_threads=args.fs_read_threads,
        fs_write_threads=args.fs_write_threads,
        device=device,
        json_path=args.json,
        plot_path=args.plot,
        progress=not args.no_progress,
        timeout_s=args.timeout or None,
        metrics_port=args.metrics_port,
    )
    row_bytes = -(-opts.offload_block_bytes // os.sysconf("SC_PAGE_SIZE")) * os.sysconf(
        "SC_PAGE_SIZE"
    )
    if opts.cpu_bytes < row_bytes:
        parser.error(
            f"--cpu-bytes {opts.cpu_bytes} is smaller than one offloaded block "
            f"({row_bytes} bytes with this geometry)"
        )
    if opts.fs_max_bytes is not None and opts.fs_max_bytes < opts.offload_block_bytes:
        parser.error(
            f"--fs-max-bytes {opts.fs_max_bytes} is smaller than one offloaded block "
            f"({opts.offload_block_bytes} bytes with this geometry)"
        )
    if opts.json_path is not None:
        _check_writable_file(parser, "--json", opts.json_path)
    if opts.plot_path is not None:
        _check_writable_file(parser, "--plot", opts.plot_path)
        from vllm.entrypoints.cli.plot import PlotUnavailableError, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailableError as e:
            parser.error(str(e))
    return opts
