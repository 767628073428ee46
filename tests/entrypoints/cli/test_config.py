# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""What the options become (config.py): one config per layer, built once from the parsed flags."""

from __future__ import annotations

from pathlib import Path

from vllm.entrypoints.cli.config import RunConfig, build_run_config
from vllm.entrypoints.cli.main import build_parser


def _resolved(*argv: str) -> RunConfig:
    parser = build_parser()
    args = parser.parse_args(["run", *argv])
    return build_run_config(args)


def test_workload_defaults_depend_on_the_workload(tmp_path: Path) -> None:
    root = ["--fs-root", str(tmp_path)]
    mix = _resolved(*root).workload
    # mix and documents keep the defaults of WorkloadConfig.
    assert (mix.num_clients, mix.num_system_prompts) == (12, 3)
    assert _resolved("--workload", "documents", *root).workload.num_clients == 12
    # chat and system-prompt get a working set that overflows the 256-block GPU pool.
    assert _resolved("--workload", "chat", *root).workload.num_clients == 32
    sp = _resolved("--workload", "system-prompt", *root).workload
    assert (sp.num_clients, sp.num_system_prompts) == (32, 12)
    # What the user sets wins.
    chat = _resolved("--workload", "chat", "--num-clients", "5", *root).workload
    assert chat.num_clients == 5
    sp = _resolved("--workload", "system-prompt", "--num-system-prompts", "2", *root).workload
    assert sp.num_system_prompts == 2


def test_json_dash_is_stdout_not_a_file(tmp_path: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["run", "--json", "-", "--fs-root", str(tmp_path)])
    output = build_run_config(args).output
    assert str(output.json_path) == "-"
    assert output.json_to_stdout


def test_each_layer_gets_its_config(tmp_path: Path) -> None:
    config = _resolved("--fs-root", str(tmp_path), "--cpu-bytes", "1MiB", "--engines", "2")
    # The baseline's engine has no connector; the offloaded run's gets the tiers' config.
    assert config.engine.kv_connector_extra_config is None
    assert config.engine.record_block_origins  # a fleet tells another instance's KV apart
    tiers = config.tiers.connector_config()
    assert tiers["cpu_bytes_to_use"] == 2**20
    assert [t["type"] for t in tiers["secondary_tiers"]] == ["fs"]
    assert tiers["secondary_tiers"][0]["root_dir"] == str(tmp_path)
    # A fleet instance has its own fs directory and no output of its own.
    instance = config.for_instance(1)
    (fs,) = instance.tiers.connector_config()["secondary_tiers"]
    assert fs["root_dir"] == str(tmp_path / "engine-1")
    assert not instance.output.progress and instance.output.json_path is None
    assert instance.engine == config.engine
    no_fs = _resolved("--no-fs", "--no-progress")
    assert no_fs.tiers.connector_config()["spec_name"] == "CPUOffloadingSpec"
    assert no_fs.settings["fs_root"] is None and not no_fs.output.progress
