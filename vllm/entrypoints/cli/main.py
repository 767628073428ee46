# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``vllm-kv-offload``: the command-line entry point.

Subcommands: ``run`` (the default: serve a workload with and without offloading and report what
offloading bought) and ``bench`` (run the benchmarks of ``benchmarks/kv_offload/``). Declared as
the console script ``vllm-kv-offload = "vllm.entrypoints.cli.main:main"``; also runnable as
``python -m vllm.entrypoints.cli.main``.

Owns the parser of the whole command (the options of ``run`` are declared in ``options.py``,
those of ``bench`` in ``bench.py``), the dispatch to the subcommand, and the exit code, signals
included.

Exit codes: 0 success; 1 the run's verdict failed, a benchmark failed, or the run hit an error;
2 bad options (argparse's convention: one line naming the option, and a hint to see --help);
130 interrupted (Ctrl-C, SIGINT); 143 terminated (SIGTERM). A ``run`` handles SIGTERM exactly as
SIGINT: the engine, its tiers and the shared host region are shut down before it exits, and one
line is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from types import FrameType

import vllm
from vllm.entrypoints.cli.bench import add_bench_arguments, run_bench
from vllm.entrypoints.cli.config import OptionError, build_run_config
from vllm.entrypoints.cli.fs_clear import clear_fs
from vllm.entrypoints.cli.interrupt import Interrupted
from vllm.entrypoints.cli.options import CommandParser, add_run_arguments

PROG = "vllm-kv-offload"
SUBCOMMANDS = ("run", "bench")
_TOP_LEVEL_FLAGS = ("-h", "--help", "--version")


def build_parser() -> argparse.ArgumentParser:
    """The parser of the whole command, with one sub-parser per subcommand."""
    parser = CommandParser(
        prog=PROG,
        description=(
            "Serve a workload through the engine core, the offloading connector, the CPU tier "
            "and the fs tier, next to a no-offload baseline, and report what offloading bought. "
            "'run' is the default subcommand."
        ),
        epilog=f"'{PROG} run --help' and '{PROG} bench --help' list each subcommand's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {vllm.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{run,bench}")
    run = sub.add_parser(
        "run",
        help="serve a workload with and without offloading and print the report (default)",
        description=(
            "Serve a seeded workload from concurrent clients through the asyncio front end, "
            "once without offloading (baseline) and once with the CPU and fs tiers, then print "
            "the report: where prompt tokens came from, hit rates, bytes moved, overhead, "
            "prefill tokens saved and a correctness verdict."
        ),
    )
    add_run_arguments(run)
    run.set_defaults(command_parser=run)
    run.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    bench = sub.add_parser(
        "bench",
        help="run the benchmarks of benchmarks/kv_offload/ and print their ratios",
        description=(
            "Run the manager, copy and fs benchmarks (each in --quick mode unless --full) and "
            "print the ratios they report against their baselines."
        ),
    )
    add_bench_arguments(bench)
    bench.set_defaults(command_parser=bench)
    return parser


def _with_default_subcommand(argv: Sequence[str]) -> list[str]:
    # 'run' is the default: `vllm-kv-offload --workload chat` means `... run --workload chat`.
    argv = list(argv)
    if not argv or (argv[0] not in SUBCOMMANDS and argv[0] not in _TOP_LEVEL_FLAGS):
        return ["run", *argv]
    return argv


class _Termination:
    """While active, SIGTERM goes through the SIGINT handler (asyncio's graceful cancellation,
    or ``KeyboardInterrupt``), so a terminated run cleans up exactly as an interrupted one."""

    def __init__(self) -> None:
        self.received = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        on_sigint = signal.getsignal(signal.SIGINT)
        if callable(on_sigint):
            on_sigint(signal.SIGINT, frame)
        else:  # SIGINT ignored or default: terminate anyway, through the same unwinding
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = signal.signal(signal.SIGTERM, self.handle)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default: ``sys.argv[1:]``) and return its exit code.

    Option errors raise ``SystemExit(2)`` from argparse, as do ``--help`` (0) and ``--version``
    (0); callers that embed the command should catch ``SystemExit``.
    """
    parser = build_parser()
    args = parser.parse_args(_with_default_subcommand(sys.argv[1:] if argv is None else argv))
    if args.command == "bench":
        return run_bench(args)

    def warn(message: str) -> None:
        sys.stderr.write(f"{args.command_parser.prog}: warning: {message}\n")

    try:
        config = build_run_config(args, warn)
    except OptionError as e:
        args.command_parser.error(str(e))
    if args.fs_clear:
        assert config.tiers.fs is not None  # --fs-clear --no-fs is refused
        return clear_fs(config.tiers.fs.root)
    logging.basicConfig(level=config.output.log_level, format="%(levelname)s %(name)s: %(message)s")
    # Imported once the options are accepted: the engine's modules import torch, and a refused
    # option should not wait for that.
    from vllm.entrypoints.cli.run import run_command

    termination = _Termination()
    try:
        with termination.active():
            return run_command(config)
    except Interrupted as e:
        # run_command shut everything down before raising: one line, no traceback.
        word = "terminated" if e.signum == signal.SIGTERM else "interrupted"
        sys.stderr.write(f"{PROG}: {word}\n")
        return e.exit_code
    except KeyboardInterrupt:
        # Outside the run's event loop (generating the workload, printing the report).
        if termination.received:
            sys.stderr.write(f"{PROG}: terminated\n")
            return 143
        sys.stderr.write(f"{PROG}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
