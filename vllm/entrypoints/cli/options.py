"""Options of ``vllm-kv-offload run``: argparse definitions, value parsers and validation.

Every option is checked before anything runs; a bad value ends the command with argparse's
usage line, a message that names the option, the value and what is allowed, and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``run`` on ``parser``."""
    d = WorkloadConfig()
    wl = parser.add_argument_group("workload")
    wl.add_argument(
        "--workload",
        choices=[k.value for k in WorkloadKind],
        default=WorkloadKind.MIX.value,
        help="multi-turn chat, shared system prompts, long documents queried several times, or "
        "a mix of the three (default: %(default)s)",
    )
    wl.add_argument("--seed", type=_int_at_least(0), default=d.seed, help="(default: %(default)s)")
    wl.add_argument(
        "--num-clients",
        type=_int_at_least(1),
        default=d.num_clients,
        help="concurrent clients (default: %(default)s)",
    )
    wl.add_argument(
        "--num-sessions",
        type=_int_at_least(1),
        default=d.num_sessions,
        help="conversations / document sessions in the workload (default: %(default)s)",
    )
    wl.add_argument(
        "--turns",
        type=_int_at_least(1),
        default=d.turns_per_session,
        help="requests per session (default: %(default)s)",
    )
    wl.add_argument(
        "--turn-tokens",
        type=_int_at_least(1),
        default=d.turn_tokens,
        help="mean tokens of a user message or question (default: %(default)s)",
    )
    wl.add_argument(
        "--output-tokens",
        type=_int_at_least(1),
        default=d.output_tokens,
        help="tokens generated per request (default: %(default)s)",
    )
    wl.add_argument(
        "--system-prompt-tokens",
        type=_int_at_least(1),
        default=d.system_prompt_tokens,
        help="length of each shared system prompt (default: %(default)s)",
    )
    wl.add_argument(
        "--document-tokens",
        type=_int_at_least(1),
        default=d.document_tokens,
        help="mean length of a document (default: %(default)s)",
    )
    wl.add_argument(
        "--num-documents",
        type=_int_at_least(1),
        default=d.num_documents,
        help="distinct documents (default: %(default)s)",
    )
    wl.add_argument(
        "--think-time",
        type=_non_negative_float,
        default=d.think_time_s,
        metavar="SECONDS",
        help="mean think time between the turns of a session (default: %(default)s)",
    )

    model = parser.add_argument_group("model stand-in and engine")
    model.add_argument(
        "--num-layers", type=_int_at_least(1), default=8, help="(default: %(default)s)"
    )
    model.add_argument(
        "--num-kv-heads", type=_int_at_least(1), default=2, help="(default: %(default)s)"
    )
    model.add_argument(
        "--head-size", type=_int_at_least(1), default=64, help="(default: %(default)s)"
    )
    model.add_argument(
        "--dtype", choices=sorted(DTYPE_BYTES), default="float16", help="(default: %(default)s)"
    )
    model.add_argument(
        "--block-size",
        type=_int_at_least(1),
        default=16,
        help="tokens per GPU block (default: %(default)s)",
    )
    model.add_argument(
        "--offload-block-size",
        type=_int_at_least(1),
        default=None,
        help="tokens per offloaded block, a multiple of --block-size (default: --block-size)",
    )
    model.add_argument(
        "--gpu-blocks",
        type=_int_at_least(1),
        default=256,
        help="blocks in the GPU KV-cache pool; small enough that prefixes get evicted "
        "(default: %(default)s)",
    )
    model.add_argument(
        "--max-num-seqs",
        type=_int_at_least(1),
        default=8,
        help="requests running at once (default: %(default)s)",
    )
    model.add_argument(
        "--max-num-batched-tokens",
        type=_int_at_least(1),
        default=512,
        help="tokens per engine step; longer prefills are chunked (default: %(default)s)",
    )
    model.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="where the 'GPU' KV cache lives: cuda when available with auto (default: %(default)s)",
    )

    tiers = parser.add_argument_group("offload tiers")
    tiers.add_argument(
        "--cpu-bytes",
        type=parse_size,
        default=parse_size("20MiB"),
        metavar="SIZE",
        help="host memory of the CPU tier, e.g. 64MiB; small by default so that the fs tier "
        "serves too (default: 20MiB)",
    )
    tiers.add_argument(
        "--eviction-policy",
        choices=EVICTION_POLICIES,
        default="lru",
        help="the CPU tier's cache policy (default: %(default)s)",
    )
    tiers.add_argument(
        "--fs-root",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"root of the fs tier; a second run over the same root starts warm "
        f"(default: {default_fs_root()})",
    )
    tiers.add_argument(
        "--fs-max-bytes",
        type=parse_size,
        default=parse_size("1GiB"),
        metavar="SIZE",
        help="capacity of the fs tier; least recently used blocks are evicted beyond it "
        "(default: 1GiB)",
    )
    tiers.add_argument(
        "--no-fs", action="store_true", help="run without the fs tier (CPU tier only)"
    )
    tiers.add_argument(
        "--fs-read-threads", type=_int_at_least(1, 256), default=2, help="(default: %(default)s)"
    )
    tiers.add_argument(
        "--fs-write-threads", type=_int_at_least(1, 256), default=2, help="(default: %(default)s)"
    )

    model.add_argument(
        "--timeout",
        type=_non_negative_float,
        default=1800.0,
        metavar="SECONDS",
        help="give up (exit code 1) when one run takes longer; 0 waits forever "
        "(default: %(default)s)",
    )

    out = parser.add_argument_group("output")
    out.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write the report as JSON"
    )
    out.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE.png",
        help="draw hit rate per tier and bytes moved per step over time (needs matplotlib: "
        "pip install 'vllm-kv-offload[plot]')",
    )
    out.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is drawn on stderr only when stderr is a terminal)",
    )


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
