# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The docs stand alone and match the code: links resolve, every key and flag is documented."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from vllm.entrypoints.cli.main import build_parser
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.fs.config import FsTierConfig
from vllm.v1.kv_offload.tiering.redis.config import RedisTierConfig

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])


def _md_link_targets(text: str) -> list[str]:
    # [text](target): relative targets only, anchors dropped.
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and t.split("#")[0]]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_and_named_docs_exist_in_the_repository(doc: Path) -> None:
    text = doc.read_text()
    for target in _md_link_targets(text):
        assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
    # A document named in passing (`fs_tier.md`) must be in the repository too.
    named = set(re.findall(r"[\w./-]+\.md\b", text))
    present = {p.name for p in REPO.rglob("*.md") if ".venv" not in p.parts}
    for name in named:
        assert Path(name).name in present, f"{doc.name} names {name}, which is not in the repo"


def _configuration_keys() -> set[str]:
    table = (REPO / "docs" / "configuration.md").read_text().split("## Every key")[1]
    table = table.split("\n## ")[0]
    return set(re.findall(r"^\| `(\w+)` \|", table, flags=re.MULTILINE))


def test_every_config_key_is_in_the_configuration_table() -> None:
    documented = _configuration_keys()
    top = set(OffloadingConfig.allowed_keys())
    fs = set(inspect.signature(FsTierConfig.from_kwargs).parameters)
    fs |= set(inspect.signature(RedisTierConfig.from_kwargs).parameters)
    example = set(inspect.signature(ExampleSecondaryTierManager.__init__).parameters) - {
        "self",
        "offloading_spec",
        "primary_kv_view",
        "tier_type",
    }
    missing = (top | fs | example) - documented
    assert not missing, f"docs/configuration.md lacks {sorted(missing)}"
    assert not documented - (top | fs | example), "the table documents keys the code lacks"


def _readme_table() -> dict[str, list[str]]:
    # The "Relation to vLLM" table: its first column -> its cells.
    section = (REPO / "README.md").read_text().split("## Relation to vLLM")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    table = {}
    for row in rows[1:]:  # below the header (the rule below it starts "|---")
        first, *cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        table[first] = cells
    return table


def _backticked(text: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", text))


def test_the_readme_table_names_every_config_key_and_no_other() -> None:
    # Its first column names the keys of kv_connector_extra_config; two rows list the keys of
    # each secondary tier (in the "here" column), as the tiers' config parsers accept them.
    table = _readme_table()
    tier_rows = {"fs tier keys": FsTierConfig, "redis tier keys": RedisTierConfig}
    top = set().union(*(_backticked(k) for k in table if k not in tier_rows))
    assert top == set(OffloadingConfig.allowed_keys())
    for row, config in tier_rows.items():
        here = _backticked(table[row][0])
        assert here == set(inspect.signature(config.from_kwargs).parameters), row


def test_every_run_flag_is_in_docs_cli() -> None:
    text = (REPO / "docs" / "cli.md").read_text()
    parser = build_parser()
    run = parser.parse_args(["run"]).command_parser
    # Every flag --help lists (argparse has no public list of a parser's actions).
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", run.format_help())) - {"--help"}
    assert len(flags) > 30
    for flag in sorted(flags):
        assert f"`{flag}" in text, f"docs/cli.md does not document {flag}"
