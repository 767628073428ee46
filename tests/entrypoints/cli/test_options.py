# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Option parsing and validation of ``vllm-kv-offload`` (bad options exit with code 2)."""

from __future__ import annotations

import argparse
import socket
import time
from pathlib import Path

import pytest

from tests.subprocesses import run_python
from vllm.entrypoints.cli.config import build_run_config
from vllm.entrypoints.cli.main import build_parser, main
from vllm.entrypoints.cli.option_values import default_fs_root, parse_size
from vllm.entrypoints.cli.options import MODELS, VERIFY_MODES
from vllm.model_executor.models.llama_config import DEFAULT_PRESET, PRESETS
from vllm.v1.engine.model_runner import ModelKind
from vllm.v1.engine.verification import VerifyMode

from .workload_args import command_env


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        ("64MiB", 64 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("4e9", 4 * 10**9),
        ("2 kib", 2048),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "0", "-5", "0.5", "1e400"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workload", "tweets"], "invalid choice: 'tweets'"),
        (["--num-clients", "0"], "--num-clients: must be >= 1, got 0"),
        (["--seed", "x"], "invalid integer 'x'"),
        (["--cpu-bytes", "lots"], "--cpu-bytes: invalid size 'lots'"),
        (["--cpu-bytes", "100"], "--cpu-bytes 100 is smaller than one offloaded block"),
        (["--cpu-bytes", "0"], "--cpu-bytes: invalid size '0' must be at least 1 byte"),
        (["--fs-root", ""], "argument --fs-root: '' is empty, which would mean the current"),
        (["--fs-root", " "], "or pass --no-fs"),
        (["--json", ""], "argument --json: '' is empty: name a file"),
        (["--no-fs", "--fs-clear"], "--fs-clear and --no-fs contradict each other"),
        (
            ["--block-size", "16", "--offload-block-size", "24"],
            "must be a multiple of --block-size",
        ),
        (["--gpu-blocks", "8"], "cannot hold the longest request"),
        (["--think-time", "-1"], "--think-time: must be a finite number >= 0"),
        (["--timeout", "-1"], "--timeout: must be a finite number >= 0"),
        (["--fs-read-threads", "300"], "--fs-read-threads: must be <= 256, got 300"),
        (["--eviction-policy", "fifo"], "invalid choice: 'fifo'"),
        (["--dtype", "int3"], "invalid choice: 'int3'"),
        (["--no-fs", "--fs-root", "/tmp"], "--fs-root and --no-fs contradict each other"),
        (
            ["--fs-max-bytes", "1KiB"],
            # One block file: a 4 KiB header and 16 tokens x 4 KiB per token.
            "--fs-max-bytes 1024 (1.0 KiB) is smaller than one block file (69632 bytes with this "
            "geometry: a 4 KiB header and one offloaded block): raise --fs-max-bytes to at least "
            "69632, or pass --no-fs",
        ),
        (
            ["--json", "/nonexistent-dir/x.json"],
            "--json /nonexistent-dir/x.json: directory /nonexistent-dir does not exist: create it",
        ),
        (["--redis-url", "http://127.0.0.1:6379"], "--redis-url: 'http://127.0.0.1:6379' is not a"),
        (
            ["--max-num-batched-tokens", "8"],
            "--max-num-batched-tokens 8 is below one GPU block (--block-size 16): no step could "
            "compute a whole block; use at least 16",
        ),
        (
            ["--redis-url", "redis://127.0.0.1:notaport"],
            "--redis-url redis://127.0.0.1:notaport: redis tier: config key 'url'=",
        ),
        (["--engines", "0"], "--engines: must be >= 1, got 0"),
        (["--engines", "65"], "--engines: must be <= 64, got 65"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["bench", "--only", "gpu"], "invalid choice: 'gpu'"),
        (["bench", "--timeout", "0"], "--timeout: must be a finite number > 0"),
    ],
)
def test_bad_options_exit_2_with_a_clear_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*argv, *(["--fs-root", str(tmp_path)] if argv[0] == "--fs-max-bytes" else [])])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # One line naming what is wrong, and where to look: no usage block in front of it.
    assert "usage:" not in err
    error, hint = err.splitlines()
    prog = "vllm-kv-offload bench" if argv[0] == "bench" else "vllm-kv-offload run"
    if "unrecognized arguments" in message:  # reported by the top-level parser
        prog = "vllm-kv-offload"
    assert error.startswith(f"{prog}: error: ")
    assert message in error
    assert hint == f"see '{prog} --help'"


@pytest.mark.parametrize(
    ("root", "message"),
    [
        ("/proc", "--fs-root /proc: cannot create files in /proc ("),
        ("/proc/kv-cache", "--fs-root /proc/kv-cache: cannot create files in /proc ("),
    ],
)
def test_unusable_fs_roots_are_refused_before_anything_runs(
    root: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--fs-root", root])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "choose a writable directory with --fs-root, or run without the fs tier (--no-fs)" in err
    assert not Path("/proc/kv-cache").exists()


def test_cpu_bytes_beyond_dev_shm_is_refused_with_the_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import os

    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + 2**30
    with pytest.raises(SystemExit) as exc:
        main(["run", "--cpu-bytes", str(too_big), "--fs-root", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--cpu-bytes: the CPU tier needs" in err
    assert "in /dev/shm, which has" in err
    assert "lower --cpu-bytes or enlarge /dev/shm (in Docker: docker run --shm-size=...)" in err


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("r.txt", "suffix .txt, and the format is taken from the suffix: use one of"),
        ("r", "no suffix, and the format is taken from the suffix"),
        ("-", "--plot -: a plot is binary, name a file such as run.png"),
    ],
)
def test_plot_names_a_format_matplotlib_writes(
    name: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) is not installed")
    path = name if name == "-" else str(tmp_path / name)
    with pytest.raises(SystemExit) as exc:
        main(["--plot", path, "--fs-root", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    if name != "-":
        assert ".png" in err and ".svg" in err and "(e.g. r.png)" in err
    for ok in ("r.png", "r.SVG", "r.pdf", "r.jpg"):
        parser = build_parser()
        args = parser.parse_args(["run", "--plot", str(tmp_path / ok), "--fs-root", str(tmp_path)])
        assert build_run_config(args).output.plot_path == tmp_path / ok


def test_fs_root_that_is_a_file_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SystemExit) as exc:
        main(["run", "--fs-root", str(f / "sub")])
    assert exc.value.code == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    with pytest.raises(SystemExit) as exc:
        main(["--plot", str(tmp_path / "p.png"), "--fs-root", str(tmp_path)])
    assert exc.value.code == 2
    assert "pip install 'vllm-kv-offload[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["bench", "--help"]])
def test_help_everywhere(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: vllm-kv-offload" in out
    if argv[0] == "run":
        for opt in ("--workload", "--cpu-bytes", "--fs-root", "--json", "--plot", "--no-progress"):
            assert opt in out


def test_default_fs_root_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_fs_root() == tmp_path / "vllm-kv-offload"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_fs_root() == tmp_path / "home" / ".cache" / "vllm-kv-offload"


def test_run_is_the_default_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    # An option of run without a subcommand goes to run (its help, its errors).
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "chat", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: vllm-kv-offload run ")
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "tweets"])
    assert capsys.readouterr().err.startswith("vllm-kv-offload run: error: argument --workload")


# The parsed defaults of `run`, captured before its options became a table (issue #16); a change
# here changes what `vllm-kv-offload run` does with no flags.
_RUN_DEFAULTS: dict[str, object] = {
    "command": "run",
    "workload": "mix",
    "seed": 0,
    "num_clients": None,  # by workload: 12, chat and system-prompt 32
    "num_sessions": 160,
    "turns": 4,
    "turn_tokens": 48,
    "output_tokens": 8,
    "system_prompt_tokens": 384,
    "num_system_prompts": None,  # by workload: 3, system-prompt 12
    "document_tokens": 1024,
    "num_documents": 16,
    "think_time": 0.05,
    "model": "transformer",
    "model_preset": DEFAULT_PRESET,
    "verify": "loaded",
    # The hash model's geometry (8, 2, 64) when absent; the transformer's is its preset's.
    "num_layers": None,
    "num_kv_heads": None,
    "head_size": None,
    "dtype": "float16",
    "block_size": 16,
    "offload_block_size": None,
    "gpu_blocks": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "device": "auto",
    "timeout": 1800.0,
    "async_scheduling": False,
    "model_stand_in": "standard",
    "sliding_window": 64,
    "cpu_bytes": 20 * 2**20,
    "eviction_policy": "lru",
    "fs_root": None,
    "fs_max_bytes": 2**30,
    "no_fs": False,
    "no_load_guard": False,
    "fs_clear": False,
    "fs_read_threads": 2,
    "fs_write_threads": 2,
    "json": None,
    "plot": None,
    "no_progress": False,
    "metrics_port": None,
    "verbose": 0,
    "redis_url": None,
    "redis_url_env": None,
    "redis_password_file": None,
    "redis_cluster": False,
    "integrity_key_file": None,
    "engines": 1,
    # KV events and routing (issue 28): off, and routing only matters with --engines > 1.
    "kv_events_endpoint": None,
    "kv_events_replay_endpoint": None,
    "kv_events_topic": "",
    "routing": None,
    "compare_routing": False,
}


def test_run_defaults_are_unchanged() -> None:
    args = vars(build_parser().parse_args(["run"]))
    assert args.pop("command_parser") is not None
    assert args == _RUN_DEFAULTS


def test_run_help_lists_every_option_with_its_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # one line per option: no wrapped help to match across
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for dest in _RUN_DEFAULTS.keys() - {"command"}:
        assert f"--{dest.replace('_', '-')}" in out, dest
    for note in (
        "(default: 20MiB)",
        "(default: 1GiB)",
        "(default: --block-size)",
        "(default: 12; chat: 32; system-prompt: 32)",
        "(default: 3; system-prompt: 12)",
    ):
        assert note in out
    assert f"(default: {default_fs_root()})" in out
    for group in (
        "workload:",
        "model and engine:",
        "CPU tier:",
        "fs tier:",
        "redis tier and fleet:",
        "output:",
    ):
        assert f"\n{group}\n" in out


def test_model_presets_and_verify_modes_are_the_engines() -> None:
    assert tuple(k.value for k in ModelKind) == MODELS
    assert sorted(m.value for m in VerifyMode) == sorted(VERIFY_MODES)
    assert DEFAULT_PRESET in PRESETS


def test_the_transformer_refuses_geometry_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--num-layers", "4", "--head-size", "32"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--num-layers, --head-size: the transformer's KV geometry is its preset's" in err


def test_model_stand_in_choices_are_the_engines() -> None:
    from vllm.entrypoints.cli.options import MODEL_STAND_INS
    from vllm.v1.engine.model import ModelStandIn

    assert tuple(m.value for m in ModelStandIn) == MODEL_STAND_INS


def test_a_redis_password_never_reaches_a_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    # Refused by the redis tier's own config parser (up front), whose message quotes the URL.
    with pytest.raises(SystemExit) as exc:
        main(["run", "--no-fs", "--redis-url", "redis://:s3cret@127.0.0.1:notaport"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--redis-url redis://:***@127.0.0.1:notaport: redis tier" in err
    assert "s3cret" not in err


def test_few_batched_tokens_are_accepted_with_a_warning(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # --fs-clear: the options are checked as for a run, then nothing runs.
    argv = ["run", "--fs-root", str(tmp_path), "--fs-clear", "--max-num-batched-tokens"]
    assert main([*argv, "64"]) == 0
    err = capsys.readouterr().err
    assert err == (
        "vllm-kv-offload run: warning: --max-num-batched-tokens 64 is below 128: prefills are "
        "chunked into many small steps, so per-step costs decide the run's time (default 512)\n"
    )
    assert main([*argv, "128"]) == 0
    assert capsys.readouterr().err == ""


def test_a_metrics_port_in_use_is_refused_up_front(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            main(["run", "--fs-root", str(tmp_path), "--metrics-port", str(port)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"vllm-kv-offload run: error: --metrics-port {port}: cannot listen on 127.0.0.1:{port} "
        "(Address already in use): choose another port, or leave --metrics-port out\n"
    )


# One of each kind of refusal: argparse's own, values against each other, the connector's and
# tiers' parsers, and the machine (directories, space, ports, files).
_SEMANTIC_REFUSALS = [
    ["--workload", "tweets"],
    ["--offload-block-size", "24"],
    ["--max-num-batched-tokens", "8"],
    ["--gpu-blocks", "8"],
    ["--cpu-bytes", "100"],
    ["--fs-root", "/proc"],
    ["--fs-max-bytes", "1KiB"],
    ["--json", "/nonexistent-dir/x.json"],
    ["--redis-url", "redis://127.0.0.1:notaport"],
    ["--metrics-port", "PORT_IN_USE"],
]
REFUSAL_BOUND_S = 10.0
"""Generous: the target is 3 s on a quiet machine; this one is shared with other test runs."""


def test_every_bad_option_is_refused_at_once_without_importing_torch(tmp_path: Path) -> None:
    # The real command in a process of its own, timed from start to exit; -X importtime lists
    # every module it imported, so a refusal that waited for torch (or the workload) shows.
    env = command_env(tmp_path)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for argv in _SEMANTIC_REFUSALS:
            argv = [port if a == "PORT_IN_USE" else a for a in argv]
            start = time.monotonic()
            proc = run_python(
                "-X", "importtime", "-m", "vllm.entrypoints.cli.main", *argv, env=env, timeout=120
            )
            elapsed = time.monotonic() - start
            errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
            imported = {ln.rsplit("|", 1)[-1].strip() for ln in proc.stderr.splitlines()}
            assert proc.returncode == 2, (argv, errors)
            assert errors[0].startswith("vllm-kv-offload run: error: "), (argv, errors)
            assert "torch" not in imported, argv
            assert elapsed < REFUSAL_BOUND_S, (argv, elapsed)
