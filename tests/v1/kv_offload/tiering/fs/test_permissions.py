# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Files on disk are private (issue #23 item 5): what the fs tier creates is 0700 / 0600 by
default whatever the umask, an existing root open to others gets one WARNING and keeps its mode,
and ``permissions: "group"`` shares a cache with the root's group."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import Primary, TierFactory, key_of, load, store


@pytest.fixture
def umask() -> Iterator[None]:
    """Restores the process's umask after the test (tests set their own)."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


def _modes(root: Path) -> tuple[set[int], set[int]]:
    """The permission bits of every directory (the root included) and file under ``root``."""
    dirs, files = {stat.S_IMODE(root.stat().st_mode)}, set()
    for path in root.rglob("*"):
        mode = path.lstat().st_mode
        (dirs if stat.S_ISDIR(mode) else files).add(stat.S_IMODE(mode))
    return dirs, files


def _use(tier_factory: TierFactory, primary: Primary, **kwargs: object) -> None:
    """A bounded tier (so slot directories and links exist) that stores and loads blocks."""
    tier = tier_factory(max_bytes="8MiB", **kwargs)
    keys = [key_of(i) for i in range(3)]
    assert store(tier, primary, keys, [0, 1, 2])
    assert load(tier, primary, keys, [3, 4, 5])
    files = {p.name for p in Path(tier.rank_dir).rglob("*") if p.is_file()}
    assert len([n for n in files if n.endswith(".bin")]) == 3
    tier.shutdown()


@pytest.mark.parametrize("mask", [0o022, 0o000, 0o077, 0o277], ids=oct)
def test_everything_the_tier_creates_is_private_whatever_the_umask(
    make_tier: TierFactory, primary: Primary, root: Path, umask: None, mask: int
) -> None:
    os.umask(mask)
    _use(make_tier, primary)
    dirs, files = _modes(root)
    assert dirs == {0o700}, [oct(m) for m in dirs]
    assert files == {0o600}, [oct(m) for m in files]
    config_json = next(root.glob("*/config.json"))
    assert stat.S_IMODE(config_json.stat().st_mode) == 0o600


def test_an_existing_root_open_to_others_keeps_its_mode_with_one_warning(
    make_tier: TierFactory, primary: Primary, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root.mkdir(mode=0o755)
    root.chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        _use(make_tier, primary)
    warnings = [r for r in caplog.records if str(root) in r.getMessage()]
    assert len(warnings) == 1 and "0755" in warnings[0].getMessage(), caplog.text
    assert stat.S_IMODE(root.stat().st_mode) == 0o755, "no silent chmod"
    dirs, files = _modes(root)
    assert dirs == {0o755, 0o700} and files == {0o600}


def test_a_private_existing_root_gets_no_warning(
    make_tier: TierFactory, primary: Primary, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root.mkdir(mode=0o700)
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        _use(make_tier, primary)
    assert not [r for r in caplog.records if str(root) in r.getMessage()], caplog.text


def test_group_permissions_share_the_cache_with_the_roots_group(
    make_tier: TierFactory,
    primary: Primary,
    root: Path,
    umask: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    os.umask(0o022)  # would take the group's write bit away
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        _use(make_tier, primary, permissions="group")
    dirs, files = _modes(root)
    assert dirs == {0o2770}, [oct(m) for m in dirs]
    assert files == {0o660}, [oct(m) for m in files]
    assert not caplog.records, caplog.text

    # A second instance over the same root, now open to others: one warning, modes kept.
    root.chmod(0o2775)
    with caplog.at_level(logging.WARNING, logger="vllm.v1.kv_offload.tiering.fs"):
        _use(make_tier, primary, permissions="group")
    assert len([r for r in caplog.records if str(root) in r.getMessage()]) == 1


def test_permissions_are_validated(make_tier: TierFactory) -> None:
    with pytest.raises(ValueError, match="'permissions'"):
        make_tier(permissions="public")
