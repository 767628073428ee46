"""Option parsing and validation of ``vllm-kv-offload`` (bad options exit with code 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from vllm.entrypoints.cli.main import build_parser, main
from vllm.entrypoints.cli.options import default_fs_root, parse_size


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
        (["--fs-max-bytes", "1KiB"], "--fs-max-bytes 1024 is smaller than one offloaded block"),
        (["--json", "/nonexistent-dir/x.json"], "--json /nonexistent-dir/x.json: directory"),
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
    assert "usage: vllm-kv-offload" in err
    assert message in err


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


def test_run_is_the_default_subcommand() -> None:
    parser = build_parser()
    from vllm.entrypoints.cli.main import _with_default_subcommand

    args = parser.parse_args(_with_default_subcommand(["--workload", "chat"]))
    assert args.command == "run"
    assert args.workload == "chat"
    assert parser.parse_args(_with_default_subcommand([])).workload == "mix"


# The parsed defaults of `run`, captured before its options became a table (issue #16); a change
# here changes what `vllm-kv-offload run` does with no flags.
_RUN_DEFAULTS: dict[str, object] = {
    "command": "run",
    "workload": "mix",
    "seed": 0,
    "num_clients": 12,
    "num_sessions": 160,
    "turns": 4,
    "turn_tokens": 48,
    "output_tokens": 8,
    "system_prompt_tokens": 384,
    "document_tokens": 1024,
    "num_documents": 16,
    "think_time": 0.05,
    "num_layers": 8,
    "num_kv_heads": 2,
    "head_size": 64,
    "dtype": "float16",
    "block_size": 16,
    "offload_block_size": None,
    "gpu_blocks": 256,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
    "device": "auto",
    "timeout": 1800.0,
    "cpu_bytes": 20 * 2**20,
    "eviction_policy": "lru",
    "fs_root": None,
    "fs_max_bytes": 2**30,
    "no_fs": False,
    "fs_read_threads": 2,
    "fs_write_threads": 2,
    "json": None,
    "plot": None,
    "no_progress": False,
    "metrics_port": None,
    "verbose": 0,
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
    for note in ("(default: 20MiB)", "(default: 1GiB)", "(default: --block-size)"):
        assert note in out
    assert f"(default: {default_fs_root()})" in out
    for group in ("workload:", "model stand-in and engine:", "CPU tier:", "fs tier:", "output:"):
        assert f"\n{group}\n" in out
