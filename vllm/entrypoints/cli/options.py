# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The options of ``vllm-kv-offload run``, declared for argparse: the command's flags and help.

Owns the declaration only: one ``_Option`` row per flag, one function per concern (workload,
model and engine, CPU tier, fs tier, redis tier and fleet, output), each becoming an
argument group of ``--help``. The values' parsers are in ``option_values.py``; what the parsed
values become (and the checks across options and against the machine) is ``config.py``'s.

A bad value ends the command with one line that names the option, the value and what is allowed,
a hint to see ``--help``, and exit code 2 (``CommandParser``).

To add an option: a row in the function of its group (``_count``, ``_size``, ``_switch``, ... give
the common shapes, with the default shown in ``--help``), then its line in ``config.py``;
``tests/test_docs.py`` asks for it in ``docs/cli.md``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from typing_extensions import override

from vllm.entrypoints.cli.option_values import (
    default_fs_root,
    int_at_least,
    non_negative_float,
    parse_directory,
    parse_env_name,
    parse_output_file,
    parse_redis_url,
    parse_secret_file,
    parse_size,
    parse_zmq_endpoint,
)
from vllm.entrypoints.cli.workloads import WORKLOAD_DEFAULTS, WorkloadConfig, WorkloadKind
from vllm.entrypoints.router.policies import ROUTING_POLICIES
from vllm.model_executor.models.llama_config import DEFAULT_PRESET, PRESETS

DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
"""KV-cache dtypes the model stand-in supports, with their element sizes."""

EVICTION_POLICIES = ("lru", "arc")
MAX_ENGINES = 64
DEVICES = ("auto", "cpu", "cuda")


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and a hint, not the whole usage block.

    The usage (two dozen lines for ``run``) buries the one line that says what is wrong; it is
    printed by ``--help`` only. Sub-parsers are of this class too (argparse's default).
    """

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\nsee '{self.prog} --help'\n")


MODELS = ("transformer", "hash")
"""Values of ``--model`` (those of ``vllm.v1.engine.model_runner.ModelKind``)."""
VERIFY_MODES = ("loaded", "all", "none")
"""Values of ``--verify`` (those of ``vllm.v1.engine.verification.VerifyMode``)."""
HASH_GEOMETRY = (8, 2, 64)
"""The hash model's default layers per group, KV heads and head size (the transformer's default
preset has the same)."""

MODEL_STAND_INS = ("standard", "hybrid")
"""Values of ``--model-stand-in`` (those of ``vllm.v1.engine.model.ModelStandIn``; not imported
here so that parsing options does not load torch)."""


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
    return _Option(flag, help, type=int_at_least(minimum, maximum), default=default)


def _choice(flag: str, choices: Sequence[str], default: str, help: str = "") -> _Option:
    return _Option(flag, help, default=default, choices=choices)


def _seconds(flag: str, default: float, help: str) -> _Option:
    return _Option(flag, help, type=non_negative_float, default=default, metavar="SECONDS")


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
    return _Option(flag, help, type=parse_output_file, default_text=None, metavar=metavar)


def _workload_count(flag: str, field_name: str, help: str = "") -> _Option:
    """A count of the workload whose default may depend on ``--workload`` (``WORKLOAD_DEFAULTS``).

    Parsed as None when absent; ``config.build_run_config`` fills in the workload's default.
    """
    base = getattr(WorkloadConfig(), field_name)
    by_kind = [
        f"{kind.value}: {fields[field_name]}"
        for kind, fields in WORKLOAD_DEFAULTS.items()
        if field_name in fields
    ]
    text = "; ".join([str(base), *by_kind])
    return _Option(flag, help, type=int_at_least(1), default=None, default_text=text)


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
        _workload_count("--num-clients", "num_clients", "concurrent clients"),
        _count(
            "--num-sessions", d.num_sessions, "conversations / document sessions in the workload"
        ),
        _count("--turns", d.turns_per_session, "requests per session"),
        _count("--turn-tokens", d.turn_tokens, "mean tokens of a user message or question"),
        _count("--output-tokens", d.output_tokens, "tokens generated per request"),
        _count(
            "--system-prompt-tokens", d.system_prompt_tokens, "length of each shared system prompt"
        ),
        _workload_count("--num-system-prompts", "num_system_prompts", "distinct system prompts"),
        _count("--document-tokens", d.document_tokens, "mean length of a document"),
        _count("--num-documents", d.num_documents, "distinct documents"),
        _seconds("--think-time", d.think_time_s, "mean think time between the turns of a session"),
    )


def _geometry(flag: str, hash_default: int) -> _Option:
    """A KV-geometry option of the hash model (the transformer's geometry is its preset's)."""
    return _Option(
        flag,
        "with --model hash",
        type=int_at_least(1),
        default=None,
        default_text=f"{hash_default}; the transformer: its preset's",
    )


def _engine_options() -> tuple[_Option, ...]:
    """The model, its KV geometry, the GPU pool, the scheduler limits and the run's bound."""
    return (
        _choice(
            "--model",
            MODELS,
            "transformer",
            "what computes the tokens: a Llama-architecture transformer (prefill costs what a "
            "model's costs), or the hash stand-in (almost free: for quick runs and tests)",
        ),
        _choice(
            "--model-preset",
            list(PRESETS),
            DEFAULT_PRESET,
            "the transformer's size (docs/model.md lists them)",
        ),
        _choice(
            "--verify",
            VERIFY_MODES,
            "loaded",
            "what the oracle checks bit-exact, after each run's timed window: the blocks loads "
            "wrote, every block, or nothing (the verdict then says the run was not verified)",
        ),
        _geometry("--num-layers", HASH_GEOMETRY[0]),
        _geometry("--num-kv-heads", HASH_GEOMETRY[1]),
        _geometry("--head-size", HASH_GEOMETRY[2]),
        _choice("--dtype", sorted(DTYPE_BYTES), "float16"),
        _count("--block-size", 16, "tokens per GPU block"),
        _Option(
            "--offload-block-size",
            "tokens per offloaded block, a multiple of --block-size",
            type=int_at_least(1),
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
        _choice(
            "--model-stand-in",
            MODEL_STAND_INS,
            "standard",
            "the model's KV-cache groups: one full-attention group, or (hybrid) a full-attention "
            "and a sliding-window group, as in Gemma-3-style models",
        ),
        _count(
            "--sliding-window",
            64,
            "window in tokens of the hybrid stand-in's sliding-window group",
        ),
        _switch(
            "--async-scheduling",
            "schedule each step before the previous step's output arrived (one step in flight), "
            "as vLLM's async scheduling does; both runs use it",
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
        _switch(
            "--no-load-guard",
            "load every hit, even where loading it is estimated slower than computing it "
            "(docs/load_guard.md; the guard is always off with --model hash)",
        ),
    )


def _fs_tier_options() -> tuple[_Option, ...]:
    """Where the fs tier lives, its capacity and I/O threads, or none at all."""
    return (
        _Option(
            "--fs-root",
            "root of the fs tier; a second run over the same root starts warm",
            type=parse_directory,
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
        _switch(
            "--fs-clear",
            "delete the fs tier's files under --fs-root (only what the tier wrote) and exit",
        ),
        _count("--fs-read-threads", 2, maximum=256),
        _count("--fs-write-threads", 2, maximum=256),
    )


def _fleet_options() -> tuple[_Option, ...]:
    """The shared redis tier and the engine instances that share it."""
    return (
        _Option(
            "--redis-url",
            "add the redis tier after the fs tier (or instead of it with --no-fs), on this "
            "server, shared by every engine instance (a password here shows in ps: prefer "
            "--redis-url-env or --redis-password-file)",
            type=parse_redis_url,
            default_text=None,
            metavar="URL",
        ),
        _Option(
            "--redis-url-env",
            "as --redis-url, the URL taken from this environment variable",
            type=parse_env_name,
            default_text=None,
            metavar="VAR",
        ),
        _Option(
            "--redis-password-file",
            "the redis password: the text of this file (readable by its owner only), for a URL "
            "without one",
            type=parse_secret_file,
            default_text=None,
            metavar="FILE",
        ),
        _switch("--redis-cluster", "the redis URL names a node of a Redis Cluster"),
        _Option(
            "--integrity-key-file",
            "authenticate the redis tier's blocks with this fleet secret (the file's raw bytes, "
            "at least 16, readable by its owner only; every engine instance uses it): a block "
            "not written with it is never served",
            type=parse_secret_file,
            default_text=None,
            metavar="FILE",
        ),
        _count(
            "--engines",
            1,
            "engine instances, each in its own process with its own CPU tier, fs directory "
            "under --fs-root and GPU pool; requests are routed by --routing",
            maximum=MAX_ENGINES,
        ),
    )


def _events_options() -> tuple[_Option, ...]:
    """KV events on ZeroMQ (vLLM's wire format) and how a fleet's front end routes."""
    return (
        _Option(
            "--kv-events-endpoint",
            "publish KV events on ZeroMQ here, in vLLM 0.33's format (docs/fleet.md): an "
            "address with '*' is bound, any other connected to, as vLLM does; instance i of a "
            "fleet uses the port + i",
            type=parse_zmq_endpoint,
            default_text=None,
            metavar="tcp://HOST:PORT",
        ),
        _Option(
            "--kv-events-replay-endpoint",
            "bind the replay socket here (subscribers that missed batches ask it); instance i "
            "uses the port + i",
            type=parse_zmq_endpoint,
            default_text=None,
            metavar="tcp://HOST:PORT",
        ),
        _Option("--kv-events-topic", "topic frame of every event message", default=""),
        _Option(
            "--routing",
            "how a fleet's front end routes requests: by the KV the instances announce "
            "(kv-aware), per session, or round-robin per request",
            choices=ROUTING_POLICIES,
            default=None,
            default_text="kv-aware when --engines > 1",
        ),
        _switch(
            "--compare-routing",
            "serve the offloaded run once per routing policy and compare them side by side "
            "(a benchmark: the workload runs 1 + 3 times; needs --engines > 1)",
        ),
    )


def _output_options() -> tuple[_Option, ...]:
    """Where the report and plot go, and whether progress bars are drawn."""
    return (
        _output_path(
            "--json",
            "FILE",
            "write the report as JSON; '-' writes it to stdout and the text report to stderr",
        ),
        _output_path(
            "--plot",
            "FILE.png",
            "draw hit rate per tier and bytes moved per step over time, in the format the "
            "suffix names (.png, .svg, .pdf, ...; needs matplotlib: "
            "pip install 'vllm-kv-offload[plot]')",
        ),
        _switch(
            "--no-progress",
            "no progress on stderr (a bar on a terminal, else a line every few seconds)",
        ),
        _Option(
            "--metrics-port",
            "serve Prometheus metrics at http://127.0.0.1:PORT/metrics during the runs "
            "(docs/metrics.md)",
            type=int_at_least(1, 65535),
            default_text=None,
            metavar="PORT",
        ),
    )


_RUN_OPTION_GROUPS: tuple[tuple[str, Callable[[], tuple[_Option, ...]]], ...] = (
    ("workload", _workload_options),
    ("model and engine", _engine_options),
    ("CPU tier", _cpu_tier_options),
    ("fs tier", _fs_tier_options),
    ("redis tier and fleet", _fleet_options),
    ("KV events and routing", _events_options),
    ("output", _output_options),
)
"""The options of ``run``, one argparse group per concern, in ``--help`` order."""


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``run`` on ``parser``, one argument group per concern."""
    for title, options in _RUN_OPTION_GROUPS:
        group = parser.add_argument_group(title)
        for option in options():
            option.add_to(group)
