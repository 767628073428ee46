# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload bench ttft``: time to first token of one request, by prompt length and by
where its KV comes from.

For each prompt length (``--sizes``) and repetition (``--reps``), one request alone on the
engine, with a prompt of fresh random tokens, measured as:

- ``recompute``: on an engine without offloading (a cold prompt: every token computed);
- ``cpu``: on the offloading engine, after the same prompt was served once and its GPU blocks
  dropped from the GPU prefix cache (``KVCacheManager.reset_prefix_cache``): a hit in the CPU
  tier;
- ``fs``: on a fresh engine over the same fs root (an empty CPU tier; the tier finds the blocks
  by its start-up scan), with the block files dropped from the page cache first
  (``posix_fadvise(POSIX_FADV_DONTNEED)``; the report says when that failed): a hit on disk;
- ``redis`` (with ``--redis-url``): on a fresh engine with the CPU and redis tiers only: a hit in
  the redis tier.

TTFT is measured on this thread, which drives the engine (``EngineCore.step``): from
``add_request`` to the step that sampled the request's first token, with the correctness check
(``EngineCore.verify_kv``: every loaded block against the blocks the first run computed) after
it, never inside. A hit that served no token from its tier is reported as a miss, not timed as a
hit. Each row is the median of the repetitions, with their range; the ratio divides the median by
recompute's at the same length.

Owns the mode's options, the engines it builds, the table it prints, its ``--json`` rows and its
``--plot`` (TTFT against prompt length, log axes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from vllm.entrypoints.cli.config import (
    FS_TIER_TYPE,
    FsTierOptions,
    RedisTierOptions,
    TiersConfig,
    resolve_device,
)
from vllm.entrypoints.cli.option_values import int_at_least, parse_output_file, parse_redis_url
from vllm.model_executor.models.llama_config import DEFAULT_PRESET, PRESETS
from vllm.v1.engine.stats import TTFT_PARTS

MODES = ("recompute", "cpu", "fs", "redis")
"""Where a measured request's KV comes from (see the module docstring)."""

DEFAULT_SIZES = (512, 2048, 8192, 16384)
BLOCK_SIZE = 16
VOCAB = 32000


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--sizes``: comma-separated prompt lengths in tokens, each >= 2 blocks' worth."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from None
    if not sizes or any(n < 2 * BLOCK_SIZE for n in sizes):
        raise argparse.ArgumentTypeError(
            f"every size must be at least {2 * BLOCK_SIZE} tokens (two blocks), got {text}"
        )
    return tuple(sorted(set(sizes)))


def add_ttft_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``bench ttft`` on ``parser``."""
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=DEFAULT_SIZES,
        metavar="N,N,...",
        help=f"prompt lengths in tokens (default: {','.join(map(str, DEFAULT_SIZES))})",
    )
    parser.add_argument(
        "--reps",
        type=int_at_least(1, 100),
        default=3,
        help="repetitions per size and mode (default: 3)",
    )
    parser.add_argument(
        "--model",
        choices=("transformer", "hash"),
        default="transformer",
        help="what computes the tokens; the hash stand-in makes prefill free, so its TTFT says "
        "little (default: transformer)",
    )
    parser.add_argument(
        "--model-preset",
        choices=sorted(PRESETS),
        default=DEFAULT_PRESET,
        help=f"the transformer's size (default: {DEFAULT_PRESET}, the run command's)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int_at_least(16),
        default=2048,
        help="tokens per engine step: a prompt's prefill is chunked to it (default: 2048)",
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: auto"
    )
    parser.add_argument(
        "--fs-root",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the fs tier writes (default: a temporary directory, removed at the end)",
    )
    parser.add_argument(
        "--redis-url",
        type=parse_redis_url,
        default=None,
        metavar="URL",
        help="also measure hits in the redis tier at this server (redis://host:port/db; "
        "credentials belong in --redis-url-env)",
    )
    parser.add_argument(
        "--redis-url-env",
        default=None,
        metavar="NAME",
        help="the environment variable holding the redis URL (keeps credentials out of argv)",
    )
    parser.add_argument(
        "--json",
        type=parse_output_file,
        default=None,
        metavar="FILE",
        help="write the rows as JSON (- for stdout, the table then on stderr)",
    )
    parser.add_argument(
        "--plot",
        type=parse_output_file,
        default=None,
        metavar="FILE",
        help="plot TTFT against prompt length, log axes (needs matplotlib)",
    )


@dataclass
class Row:
    """One prompt length in one mode.

    Attributes:
        tokens: the prompt's length.
        mode: one of ``MODES``.
        ttft_ms: each repetition's TTFT (hits only: a repetition whose tier served nothing is
            counted in ``misses`` instead).
        served_tokens: per timed repetition, the prompt tokens its tier served.
        misses: repetitions in which the tier served no token.
        parts_ms: per timed repetition, the engine's split of its TTFT (``TTFT_PARTS``: slot,
            lookup, loading, prefill), in milliseconds.
    """

    tokens: int
    mode: str
    ttft_ms: list[float] = field(default_factory=list)
    served_tokens: list[int] = field(default_factory=list)
    misses: int = 0
    parts_ms: list[tuple[float, ...]] = field(default_factory=list)

    @property
    def median_ms(self) -> float | None:
        """The median TTFT, None when no repetition was a hit."""
        return statistics.median(self.ttft_ms) if self.ttft_ms else None


@dataclass
class PageCacheDrops:
    """What ``posix_fadvise(DONTNEED)`` did to the fs tier's files before the fs hits."""

    files: int = 0
    failed: int = 0
    error: str | None = None

    def describe(self) -> str:
        """One line for the report."""
        if self.error is not None:
            return f"fs hits: the fs tier's files NOT dropped from the page cache ({self.error})"
        if self.failed:
            return (
                f"fs hits: posix_fadvise(DONTNEED) failed on {self.failed:,} of {self.files:,} "
                "files of the fs tier (those may have been read from the page cache)"
            )
        return (
            f"fs hits: the fs tier's {self.files:,} files dropped from the page cache before "
            "each (posix_fadvise DONTNEED; it drops clean pages, and the tier fsyncs its files)"
        )


def drop_from_page_cache(root: Path) -> PageCacheDrops:
    """Ask the kernel to drop every file under ``root`` from the page cache."""
    drops = PageCacheDrops()
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        drops.error = "posix_fadvise is not available on this platform"
        return drops
    for dirpath, _, names in os.walk(root):
        for name in names:
            drops.files += 1
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                drops.failed += 1
                continue
            try:
                advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError as e:
                drops.failed += 1
                drops.error = drops.error or f"posix_fadvise: {e.strerror}"
            finally:
                os.close(fd)
    if drops.error is not None and drops.failed < drops.files:
        drops.error = None  # some worked: counted in ``failed``
    return drops


class _Bench:
    """The engines of one invocation and the measurements; this thread only."""

    def __init__(self, args: argparse.Namespace, fs_root: Path) -> None:
        from vllm.v1.engine.config import EngineConfig

        self.args = args
        self.fs_root = fs_root
        longest = max(args.sizes)
        blocks = -(-(longest + BLOCK_SIZE) // BLOCK_SIZE) + 1
        common: dict[str, Any] = dict(
            num_gpu_blocks=blocks,
            gpu_block_sizes=(BLOCK_SIZE,),
            max_num_seqs=1,
            max_num_batched_tokens=args.max_num_batched_tokens,
            vocab_size=VOCAB,
            device=resolve_device(args.device),
            enable_kv_events=False,
        )
        if args.model == "transformer":
            self.engine_config = EngineConfig.for_transformer(args.model_preset, **common)
        else:
            self.engine_config = EngineConfig(**common)
        cfg = self.engine_config
        kv_bytes_per_token = cfg.num_layers * cfg.gpu_page_bytes(0) // BLOCK_SIZE
        self.kv_bytes_per_token = kv_bytes_per_token
        # Room for the two longest prompts: the one measured and the one before it.
        cpu_bytes = 2 * (longest + BLOCK_SIZE) * kv_bytes_per_token + (8 << 20)
        fs = FsTierOptions(root=fs_root, max_bytes=max(16 * cpu_bytes, 1 << 30))
        redis = None
        if args.redis_url is not None or args.redis_url_env is not None:
            redis = RedisTierOptions(
                url=args.redis_url,
                url_env=args.redis_url_env if args.redis_url is None else None,
                namespace=f"kvo-bench-ttft-{os.getpid()}-{random.getrandbits(32):08x}",
                ttl_s=3600.0,
            )
        self.redis = redis
        base = TiersConfig(cpu_bytes=cpu_bytes, eviction_policy="lru", block_size=BLOCK_SIZE)
        # The engine that stores writes through to every tier; each hit's engine has one.
        self.tiers = {
            "store": dataclasses.replace(base, fs=fs, redis=redis),
            "fs": dataclasses.replace(base, fs=fs),
            "redis": dataclasses.replace(base, redis=redis),
        }
        self.rows = {(n, m): Row(n, m) for n in args.sizes for m in MODES}
        self.drops = PageCacheDrops()

    def engine(self, tiers: TiersConfig | None) -> Any:
        from vllm.v1.engine.config import default_instance_id
        from vllm.v1.engine.core import EngineCore

        return EngineCore(
            dataclasses.replace(
                self.engine_config,
                kv_connector_extra_config=None if tiers is None else tiers.connector_config(),
                instance_id=default_instance_id(),
            )
        )

    def run(self, out: TextIO) -> None:
        with self.engine(None) as baseline:
            # Warm-up, untimed: the first forward pass pays for allocations and kernels' setup.
            _ttft(baseline, "warmup", _prompt(-1, 0, 64))
            for rep in range(self.args.reps):
                for n in self.args.sizes:
                    self._measure(n, rep, baseline, out)

    def _measure(self, n: int, rep: int, baseline: Any, out: TextIO) -> None:
        prompt = _prompt(n, rep, n)
        tag = f"{n}-{rep}"
        self._record(n, "recompute", _ttft(baseline, f"cold-{tag}", prompt), n, baseline)
        # Served once by an engine that writes through to every tier, then dropped from its GPU
        # prefix cache only: the CPU hit. Then that engine ends (its tiers' files and values
        # stay), as before a restart: the secondary tiers' hits are a fresh engine's, alone on
        # its fs root.
        with self.engine(self.tiers["store"]) as store:
            _ttft(store, "warmup", _prompt(-n, rep, 64))
            _ttft(store, f"store-{tag}", prompt)
            _drain(store)
            reference = store.computed_block_digests()
            store.kv_cache_manager.reset_prefix_cache()
            before = store.stats.tokens_from_cpu
            ms = _ttft(store, f"cpu-{tag}", prompt)
            self._record(n, "cpu", ms, store.stats.tokens_from_cpu - before, store)
            _check(store, reference)
            _drain(store)
        secondary = (("fs", FS_TIER_TYPE),) + ((("redis", "redis"),) if self.redis else ())
        for mode, _tier in secondary:
            with self.engine(self.tiers[mode]) as fresh:
                fresh.wait_for_tiers_ready(120.0)
                # Warm-up with a prompt of its own (computed: in no tier yet), untimed.
                _ttft(fresh, "warmup", _prompt(-n - 1, rep, 64))
                _drain(fresh)
                before = fresh.stats.tokens_from_secondary
                if mode == "fs":
                    self.drops = drop_from_page_cache(self.fs_root)
                ms = _ttft(fresh, f"{mode}-{tag}", prompt)
                self._record(n, mode, ms, fresh.stats.tokens_from_secondary - before, fresh)
                _check(fresh, reference)
                _drain(fresh)
        out.write(f"  {n:>6} tokens, repetition {rep + 1}/{self.args.reps} done\n")
        out.flush()

    def _record(self, n: int, mode: str, ms: float, served: int, engine: Any) -> None:
        row = self.rows[(n, mode)]
        if served <= 0:
            row.misses += 1
            return
        row.ttft_ms.append(ms)
        row.served_tokens.append(served)
        row.parts_ms.append(tuple(round(p * 1e3, 3) for p in engine.stats.ttft_parts[-1]))


def _prompt(n: int, rep: int, length: int) -> list[int]:
    rng = random.Random(f"bench-ttft-{n}-{rep}")
    return [rng.randrange(VOCAB) for _ in range(length)]


def _ttft(engine: Any, req_id: str, prompt: Sequence[int]) -> float:
    """One request alone: milliseconds from ``add_request`` to the step that sampled its first
    token (then stepped until it finished: one output token)."""
    start = time.perf_counter()
    engine.add_request(req_id, prompt, 1)
    first = None
    while first is None:
        # A step waiting on the tiers is followed by a short wait, as in serving: spinning
        # would keep the GIL from the tiers' I/O threads (vllm/v1/engine/core.py).
        for out in engine.step_or_wait():
            if out.request_id == req_id and out.new_token_ids:
                first = time.perf_counter()
        if first is None and not engine.has_unfinished_requests():
            raise RuntimeError(f"request {req_id} finished without a token")
    return (first - start) * 1e3


def _drain(engine: Any) -> None:
    # Every transfer finished (stores to the tiers included), outside any timing.
    for _ in range(1_000_000):
        if not engine.has_pending_work():
            return
        engine.step_or_wait()  # transfers run on other threads: poll, don't spin the core
    raise RuntimeError("transfers still in flight after a million steps")


def _check(engine: Any, reference: Any) -> None:
    result = engine.verify_kv(reference)
    if engine.stats.verification_failures:
        raise RuntimeError(f"a loaded block differed from its reference: {result}")


def row_json(row: Row, recompute: Row) -> dict[str, Any]:
    """One row of ``--json``: the repetitions, median, range and ratio to recompute."""
    med, base = row.median_ms, recompute.median_ms
    return {
        "tokens": row.tokens,
        "mode": row.mode,
        "ttft_ms": [round(v, 3) for v in row.ttft_ms],
        "median_ms": med,
        "min_ms": min(row.ttft_ms) if row.ttft_ms else None,
        "max_ms": max(row.ttft_ms) if row.ttft_ms else None,
        "ratio_to_recompute": med / base if med is not None and base else None,
        "served_tokens": row.served_tokens,
        "ttft_parts_ms": [dict(zip(TTFT_PARTS, parts, strict=True)) for parts in row.parts_ms],
        "misses": row.misses,
    }


def _cell(row: Row, recompute: Row) -> str:
    med, base = row.median_ms, recompute.median_ms
    if med is None:
        return "miss" if row.misses else "-"
    if row.mode == "recompute" or not base:
        return f"{med:.1f} ms"
    return f"{med:.1f} ms {med / base:.2f}x"


def _spread(row: Row) -> str:
    if not row.ttft_ms:
        return "-"
    return f"{min(row.ttft_ms):.1f}-{max(row.ttft_ms):.1f}"


def render_table(bench: _Bench) -> Iterator[str]:
    """The table: per size, each mode's median TTFT and its ratio to recompute, then the
    repetitions' ranges."""
    modes = [m for m in MODES if m != "redis" or bench.redis is not None]
    head = f"  {'tokens':>7}" + "".join(f"{m:>17}" for m in modes)
    yield head
    for n in bench.args.sizes:
        recompute = bench.rows[(n, "recompute")]
        yield f"  {n:>7}" + "".join(f"{_cell(bench.rows[(n, m)], recompute):>17}" for m in modes)
    yield "  range over the repetitions (min-max, ms)"
    for n in bench.args.sizes:
        yield f"  {n:>7}" + "".join(f"{_spread(bench.rows[(n, m)]):>17}" for m in modes)
    yield "    (median TTFT; x: its ratio to recompute at the same length)"


def _header(bench: _Bench) -> list[str]:
    cfg = bench.engine_config
    a = bench.args
    model = (
        f"transformer {a.model_preset}"
        if a.model == "transformer"
        else "hash stand-in (free prefill)"
    )
    return [
        "vllm-kv-offload bench ttft",
        f"  model: {model}, {cfg.num_layers} layers, {bench.kv_bytes_per_token:,} KV bytes per "
        f"token; device {cfg.device}",
        f"  one request alone, {a.reps} repetition(s) per size; prefill chunks of "
        f"{a.max_num_batched_tokens} tokens; load average {_load():.2f} on {os.cpu_count()} CPUs",
    ]


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def write_ttft_plot(path: Path, bench: _Bench) -> None:
    """TTFT against prompt length per mode (log axes), the repetitions' range as error bars."""
    from vllm.entrypoints.cli.report.plot import check_plot_available

    check_plot_available()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    try:
        for mode in MODES:
            rows = [bench.rows[(n, mode)] for n in bench.args.sizes]
            rows = [r for r in rows if r.ttft_ms]
            if not rows:
                continue
            med = [r.median_ms or 0.0 for r in rows]
            lo = [m - min(r.ttft_ms) for m, r in zip(med, rows, strict=True)]
            hi = [max(r.ttft_ms) - m for m, r in zip(med, rows, strict=True)]
            ax.errorbar(
                [r.tokens for r in rows],
                med,
                yerr=[lo, hi],
                marker="o",
                capsize=3,
                label={
                    "recompute": "recompute (cold)",
                    "cpu": "CPU tier hit",
                    "fs": "fs tier hit (page cache dropped)",
                    "redis": "redis tier hit",
                }[mode],
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("TTFT (ms), median of the repetitions")
        cfg = bench.engine_config
        ax.set_title(
            f"TTFT by prompt length: {bench.args.model} "
            f"{bench.args.model_preset if bench.args.model == 'transformer' else ''}, "
            f"{cfg.device}, {bench.args.reps} reps",
            fontsize="medium",
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(str(path), dpi=100)
    finally:
        plt.close(fig)


def run_ttft(args: argparse.Namespace) -> int:
    """``bench ttft``: measure, print the table, write ``--json`` and ``--plot``.

    Returns:
        0 on success; 1 when a hit mode missed at every repetition of some size (its tier
        served nothing), or on an error.
    """
    to_stdout = args.json is not None and str(args.json) == "-"
    out = sys.stderr if to_stdout else sys.stdout
    if args.plot is not None:
        from vllm.entrypoints.cli.report.plot import PlotUnavailableError, check_plot_available

        try:
            check_plot_available()
        except PlotUnavailableError as e:
            sys.stderr.write(f"vllm-kv-offload bench ttft: error: {e}\n")
            return 1
    with contextlib.ExitStack() as stack:
        root = args.fs_root
        if root is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvo-bench-ttft-")))
        try:
            bench = _Bench(args, root.expanduser())
            header = [
                wrapped
                for line in _header(bench)
                for wrapped in textwrap.wrap(line, 80, subsequent_indent="    ")
            ]
            out.write("\n".join(header) + "\n")
            out.flush()
            bench.run(out)
        except (OSError, ValueError, RuntimeError) as e:
            sys.stderr.write(f"vllm-kv-offload bench ttft: error: {e}\n")
            return 1
    lines = list(render_table(bench))
    lines += textwrap.wrap(
        bench.drops.describe(), 80, initial_indent="  ", subsequent_indent="    "
    )
    out.write("\n".join(lines) + "\n")
    out.flush()
    rows = [
        row_json(bench.rows[(n, m)], bench.rows[(n, "recompute")])
        for n in args.sizes
        for m in MODES
        if m != "redis" or bench.redis is not None
    ]
    doc = {
        "settings": {
            "sizes": list(args.sizes),
            "reps": args.reps,
            "model": args.model,
            "model_preset": args.model_preset if args.model == "transformer" else None,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "device": bench.engine_config.device,
            "kv_bytes_per_token": bench.kv_bytes_per_token,
            "redis": bench.redis is not None,
            "cpus": os.cpu_count(),
        },
        "page_cache": {
            "files": bench.drops.files,
            "failed": bench.drops.failed,
            "error": bench.drops.error,
        },
        "rows": rows,
    }
    try:
        if args.json is not None:
            text = json.dumps(doc, indent=2) + "\n"
            if to_stdout:
                sys.stdout.write(text)
            else:
                Path(args.json).write_text(text)
        if args.plot is not None:
            write_ttft_plot(Path(args.plot), bench)
    except OSError as e:
        sys.stderr.write(f"vllm-kv-offload bench ttft: error: cannot write the results: {e}\n")
        return 1
    missed = [
        r for r in bench.rows.values() if r.mode != "recompute" and r.misses and not r.ttft_ms
    ]
    if missed and (bench.redis is not None or all(r.mode != "redis" for r in missed)):
        shown = ", ".join(f"{r.mode} at {r.tokens}" for r in missed)
        sys.stderr.write(f"vllm-kv-offload bench ttft: no hit in: {shown}\n")
        return 1
    return 0
