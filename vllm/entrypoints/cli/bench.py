# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload bench``: run the benchmarks of ``benchmarks/kv_offload/`` and sum them up.

(``bench ttft`` is a mode of its own, in this process: ``bench_ttft.py``.)

Each benchmark is a standalone script (``benchmarks/`` is not a package), so it runs in a child
process with the current interpreter, in its quick mode unless ``--full`` is given (``--quick``
when the script has it, else the reduced sizes of ``QUICK_FALLBACK_ARGS``). Its output is passed
through, and its ratios (to its in-run baseline, or to its target) are collected: from its
``--json FILE`` document when the script offers that option, else from the output lines that
mention a ratio. A benchmark that is missing (e.g. an installation without the source tree) is
reported as skipped rather than failing the others.

The summary says what each benchmark's ratio divides, which way is good and the target it is
held to (``RATIO_GUIDES``), and marks each ratio that a target applies to as meeting or missing
it, so that "ratio: 0.537" never stands alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import vllm

BENCHMARKS: tuple[str, ...] = ("manager", "copy", "fs")
"""Benchmark names; ``NAME`` runs ``bench_NAME.py``."""

QUICK_FALLBACK_ARGS: dict[str, tuple[str, ...]] = {
    "copy": ("--reps", "5", "--job-mib", "32"),
    "fs": ("--total", "64MiB", "--repeat", "1"),
}
"""Reduced sizes for benchmarks without a ``--quick`` flag (used only if they take the flags)."""

_TAG = re.compile(r"(\w+)=([^,\]]+)")


def _row_fields(key: str) -> dict[str, str]:
    # "[path=torch,direction=h2d,block_kib=256].ratio" -> {"path": "torch", ...}
    return dict(_TAG.findall(key))


def _copy_target(key: str, value: float) -> bool | None:
    fields = _row_fields(key)
    if fields.get("path") != "torch" or int(fields.get("block_kib", "0")) < 256:
        return None  # CUDA paths have their own targets, on a GPU; small blocks have none
    return value >= 0.8


def _fs_target(key: str, value: float) -> bool | None:
    if int(_row_fields(key).get("block_bytes", "0")) != 2 * 2**20:
        return None
    return value >= 0.8


@dataclass(frozen=True)
class RatioGuide:
    """What a benchmark's ratios mean, which way is good, and the target they are held to.

    Attributes:
        meaning: the ratio as a quotient, in words.
        better: ``"higher"`` or ``"lower"``.
        target: the target, in words (``docs/benchmarks.md`` has the reasons).
        check: ``(key, value) -> met?`` for one collected ratio; None when no target applies to
            that row. None for benchmarks whose ratios come from output lines that already say
            OK or MISSED.
    """

    meaning: str
    better: str
    target: str
    check: Callable[[str, float], bool | None] | None = None

    def describe(self) -> str:
        """One line: the quotient, the good direction and the target."""
        return f"ratio = {self.meaning}; {self.better} is better; target: {self.target}"


RATIO_GUIDES: dict[str, RatioGuide] = {
    "manager": RatioGuide(
        "per-step cost of the manager with 1e6 blocks cached / with 1e3",
        "lower",
        "<= 1.3 for lru and arc (arc-t2 is a stress case without one)",
    ),
    "copy": RatioGuide(
        "GB/s of one job of scattered blocks / GB/s of one contiguous copy of the same bytes",
        "higher",
        ">= 0.8 on the torch path for blocks >= 256 KiB (the CUDA paths' targets need a GPU)",
        _copy_target,
    ),
    "fs": RatioGuide(
        "GiB/s of the fs tier / GiB/s of plain file I/O of the same blocks",
        "higher",
        ">= 0.8 for 2 MiB blocks, stores and loads",
        _fs_target,
    ),
}
"""How to read each benchmark's ratios (the summary prints it)."""


def _judged(guide: RatioGuide | None, key: str, value: float) -> str:
    met = None if guide is None or guide.check is None else guide.check(key, value)
    if met is None:
        return "no target for this row" if guide is not None and guide.check else ""
    return "meets the target" if met else "MISSES the target"


_RATIO_LINE = re.compile(r"\bratios?\b|\bvs\.? baseline|\bspeedup|\btarget\b", re.IGNORECASE)


def default_bench_dir() -> Path:
    """``benchmarks/kv_offload`` of the source tree this package was imported from."""
    return Path(vllm.__file__).resolve().parent.parent / "benchmarks" / "kv_offload"


@dataclass
class BenchOutcome:
    """What one benchmark did.

    Attributes:
        name: the benchmark name.
        status: ``"ok"``, ``"failed"`` (non-zero exit or timeout) or ``"skipped"`` (missing).
        detail: why it failed or was skipped.
        ratios: ``(name, value)`` pairs collected from its JSON document or output lines.
        lines: the output lines that mention a ratio (used when there is no JSON).
    """

    name: str
    status: str
    detail: str = ""
    ratios: list[tuple[str, float]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``bench`` on ``parser``, and its ``ttft`` mode."""
    from vllm.entrypoints.cli.bench_ttft import add_ttft_arguments

    modes = parser.add_subparsers(dest="bench_mode", metavar="{ttft}")
    ttft = modes.add_parser(
        "ttft",
        help="time to first token of one request by prompt length: recompute, CPU, fs, redis",
        description=(
            "Time to first token of one request alone, by prompt length, measured as a "
            "recompute (cold), a CPU-tier hit, an fs-tier hit (files dropped from the page "
            "cache) and, with --redis-url, a redis-tier hit."
        ),
    )
    add_ttft_arguments(ttft)
    parser.add_argument(
        "--only",
        action="append",
        choices=BENCHMARKS,
        default=None,
        metavar="NAME",
        help=f"run only this benchmark (repeatable; one of {', '.join(BENCHMARKS)})",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="full-size runs instead of the benchmarks' --quick mode (minutes)",
    )
    parser.add_argument(
        "--bench-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"where the bench_*.py scripts are (default: {default_bench_dir()})",
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=900.0,
        metavar="SECONDS",
        help="time limit per benchmark (default: %(default)s)",
    )


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _walk_ratios(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk_ratios(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            # List items are usually table rows: name them by their identifying (non-float)
            # fields, e.g. "[path=torch,direction=h2d,block_kib=64]".
            tag = (
                ",".join(
                    f"{k}={v}" for k, v in value.items() if isinstance(v, (str, int)) and v != ""
                )
                if isinstance(value, dict)
                else ""
            )
            yield from _walk_ratios(value, f"{prefix}[{tag or i}]")
    elif (
        isinstance(obj, (int, float))
        and not isinstance(obj, bool)
        and "ratio" in prefix.rsplit(".", 1)[-1].lower()
    ):
        yield prefix, float(obj)


def _help_text(cmd: Sequence[str], env: dict[str, str]) -> str:
    try:
        result = subprocess.run(
            [*cmd, "--help"], capture_output=True, text=True, timeout=120, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def _quick_args(name: str, help_text: str) -> list[str]:
    if "--quick" in help_text:
        return ["--quick"]
    fallback = QUICK_FALLBACK_ARGS.get(name, ())
    flags = [a for a in fallback if a.startswith("--")]
    if fallback and all(f in help_text for f in flags):
        return list(fallback)
    return []


def run_benchmark(
    name: str, bench_dir: Path, quick: bool, timeout_s: float, out: TextIO
) -> BenchOutcome:
    """Run ``bench_<name>.py`` from ``bench_dir``, echoing its output to ``out``."""
    script = bench_dir / f"bench_{name}.py"
    if not script.is_file():
        return BenchOutcome(name, "skipped", f"{script} not found")
    env = dict(os.environ)
    # The scripts import vllm; make sure the child finds the same package as this process.
    pkg_root = str(Path(vllm.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(script)]
    help_text = _help_text(cmd, env)
    args = _quick_args(name, help_text) if quick else []
    with tempfile.TemporaryDirectory(prefix="vllm-kv-offload-bench-") as tmp:
        json_path = Path(tmp) / f"{name}.json"
        if "--json" in help_text:
            args += ["--json", str(json_path)]
        shown = " ".join([Path(sys.executable).name, str(script), *args])
        out.write(f"=== bench {name}: {shown}\n")
        out.flush()
        try:
            proc = subprocess.run(
                [*cmd, *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout_s,
                env=env,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return BenchOutcome(name, "failed", f"timed out after {timeout_s:.0f} s")
        except OSError as e:
            return BenchOutcome(name, "failed", f"could not start: {e}")
        out.write(proc.stdout)
        out.flush()
        lines = [ln.strip() for ln in proc.stdout.splitlines() if _RATIO_LINE.search(ln)]
        outcome = BenchOutcome(name, "ok" if proc.returncode == 0 else "failed", lines=lines)
        if proc.returncode != 0:
            outcome.detail = f"exit code {proc.returncode}"
        if json_path.is_file():
            try:
                outcome.ratios = list(_walk_ratios(json.loads(json_path.read_text())))
            except (OSError, ValueError) as e:
                outcome.detail = (outcome.detail + f"; unreadable JSON: {e}").lstrip("; ")
    return outcome


def run_bench(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run the selected benchmarks and print their ratios (to ``out``, default stdout).

    Returns:
        0 if every benchmark that exists succeeded, 1 if one failed or none was found.
    """
    if getattr(args, "bench_mode", None) == "ttft":
        from vllm.entrypoints.cli.bench_ttft import run_ttft

        return run_ttft(args)
    out = sys.stdout if out is None else out
    bench_dir = (args.bench_dir or default_bench_dir()).expanduser()
    names = list(dict.fromkeys(args.only)) if args.only else list(BENCHMARKS)
    outcomes = [
        run_benchmark(name, bench_dir, quick=not args.full, timeout_s=args.timeout, out=out)
        for name in names
    ]
    out.write("\n=== summary\n")
    for o in outcomes:
        out.write(f"{o.name:<8} {o.status}" + (f" ({o.detail})" if o.detail else "") + "\n")
        guide = RATIO_GUIDES.get(o.name)
        if guide is not None and (o.ratios or o.lines):
            out.write(f"    {guide.describe()}\n")
        if o.ratios:
            for key, value in o.ratios:
                judged = _judged(guide, key, value)
                out.write(f"    {key}: {value:.3f}" + (f" ({judged})" if judged else "") + "\n")
        else:
            for line in o.lines:
                out.write(f"    {line}\n")
    out.flush()
    if all(o.status == "skipped" for o in outcomes):
        sys.stderr.write(
            f"vllm-kv-offload bench: no benchmark found in {bench_dir} "
            "(run it from a source checkout, or pass --bench-dir)\n"
        )
        return 1
    return 1 if any(o.status == "failed" for o in outcomes) else 0
