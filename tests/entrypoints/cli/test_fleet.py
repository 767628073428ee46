# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Fleet mode of ``vllm-kv-offload run``: ``--engines N`` processes sharing a real redis server.

The instances are real processes (multiprocessing's ``spawn``) and the redis tier talks to a real
``redis-server`` started on a free loopback port (skipped with an install hint without the
binary, failed under ``CI=true``). The tests check the report's fleet figures, that a session's
turns are served by several instances and still give the baseline's outputs, and that an
interrupt (SIGTERM to the command, or a terminal's Ctrl-C to the whole process group) ends every
instance and leaves no shared region behind.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.v1.kv_offload.tiering.redis.servers import RedisServer
from vllm.entrypoints.cli.fleet import cross_instance_tokens
from vllm.entrypoints.cli.main import main
from vllm.v1.kv_offload.tiering.redis.redaction import redact_url

from .test_metrics import figure_checks, free_port, scrape_while_running, value
from .workload_args import REPO, command_env, workload_args

# Documents asked for by several sessions: an instance often gets a document another instance
# read (and stored in redis) before.
FLEET = workload_args(clients=2, sessions=10, think_time=0.001, timeout=300, turns=3)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


def _fleet_regions(pid: int) -> list[Path]:
    # The instances' shared regions are named after the command's pid (fleet_instance_id).
    return list(Path("/dev/shm").glob(f"vllm_offload_fleet-{pid}-*"))


def test_cross_instance_reuse_counts_shared_tier_blocks_another_instance_stored() -> None:
    mine = {("redis", b"a"): 16, ("redis", b"b"): 16, ("fs", b"c"): 16, ("redis", b"d"): 5}
    others = [frozenset({b"a", b"c"}), frozenset({b"d"})]
    # b: nobody in this run stored it (an earlier run did); c: not from a shared tier.
    assert cross_instance_tokens(mine, others) == 16 + 5
    assert cross_instance_tokens(mine, []) == 0


def test_fleet_with_redis_passes_and_serves_kv_another_instance_computed(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    fs_root = tmp_path / "fs"
    code = main(
        [
            *FLEET,
            "--no-progress",
            "--fs-root",
            str(fs_root),
            "--redis-url",
            redis_server.url,
            "--engines",
            "2",
            # Round-robin moves every session between the instances, so the second turn of
            # each is served KV the other one computed (kv-aware routing keeps sessions where
            # their KV is: on this small workload it left no cross-instance reuse in 1 run of 3).
            "--routing",
            "round-robin",
            "--json",
            str(out),
            "--metrics-port",
            str(free_port()),
        ]
    )
    text = capsys.readouterr()
    assert code == 0, text.out + text.err
    doc = json.loads(out.read_text())
    assert doc["verdict"]["status"] == "PASS"
    off, base = doc["runs"]["offload"], doc["runs"]["baseline"]
    # The instances' metrics, summed, are the fleet's figures: every tier's, redis's included.
    figure_checks(off, doc["metrics"]["offload"])
    assert off["redis_url"] == redis_server.url
    # Cross-instance reuse: KV one instance computed, served to another through redis.
    assert off["cross_instance_tokens"] > 0
    assert off["prompt_tokens"]["redis_tier"] >= off["cross_instance_tokens"]
    assert off["transfers"]["cpu_to_redis"]["blocks"] > 0
    assert off["transfers"]["redis_to_cpu"]["blocks"] > 0
    # Every block promoted from redis reached the GPU through the bit-exact check.
    verification = off["verification"]
    assert verification["blocks_verified_from_redis"] > 0
    assert verification["blocks_mismatched"] == 0
    p = off["prompt_tokens"]
    assert (
        p["computed"] + sum(p[t] for t in ("gpu_prefix_cache", "cpu_tier", "fs_tier", "redis_tier"))
        == p["total"]
    )
    # Per instance: its own verdict and its share of the requests, as the router counted them
    # (each run routed afresh, so the shares may differ between runs).
    fleet = doc["fleet"]
    assert fleet["engines"] == 2 and len(fleet["instances"]) == 2
    assert fleet["routing"]["policy"] == "round-robin"
    for inst, routed in zip(fleet["instances"], fleet["routing"]["requests"], strict=True):
        assert inst["verdict"]["status"] == "PASS"
        assert 0 < inst["runs"]["offload"]["requests"]["finished"] == routed
    assert sum(fleet["routing"]["requests"]) == off["requests"]["submitted"]
    assert fleet["routing"]["events"] is None  # round-robin subscribes to no events
    assert base["cross_instance_tokens"] is None and base["prompt_tokens"]["redis_tier"] == 0
    # The report: the fleet's rows, every line within 80 columns.
    for row in (
        "served from redis tier",
        "computed by another instance",
        "per engine instance",
        "promoted from the redis tier",
        "verdict: PASS",
    ):
        assert row in text.out
    assert max(len(line) for line in text.out.splitlines()) <= 80, [
        line for line in text.out.splitlines() if len(line) > 80
    ]
    # Each instance had its own fs directory under --fs-root, and --fs-clear empties them all.
    assert sorted(d.name for d in fs_root.iterdir()) == ["engine-0", "engine-1"]
    assert not _fleet_regions(os.getpid())
    assert main(["--fs-root", str(fs_root), "--fs-clear"]) == 0
    assert "removed 2 run directories" in capsys.readouterr().out
    assert list(fs_root.iterdir()) == []


def test_a_redis_password_never_reaches_the_report() -> None:
    assert redact_url("redis://:s3cret@10.0.0.5:6379/0") == "redis://:***@10.0.0.5:6379/0"
    assert redact_url("rediss://app:s3cret@h:6380") == "rediss://app:***@h:6380"
    assert redact_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_one_engine_with_the_redis_tier_instead_of_the_fs_tier(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # --no-fs --redis-url: the redis tier is the only secondary tier; one engine, no fleet.
    out = tmp_path / "report.json"
    args = [*FLEET, "--no-progress", "--no-fs", "--redis-url", redis_server.url]
    code = main([*args, "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    doc = json.loads(out.read_text())
    off = doc["runs"]["offload"]
    assert doc["fleet"] is None and off["cross_instance_tokens"] is None
    assert off["fs_tier"] is None and off["prompt_tokens"]["fs_tier"] == 0
    assert off["transfers"]["cpu_to_redis"]["blocks"] > 0
    assert off["transfers"]["cpu_to_fs"]["blocks"] == 0
    assert "served from redis tier" in text and "computed by another instance" not in text
    assert "per engine instance" not in text


def _children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ends_within(pid: int, timeout_s: float) -> bool:
    # A pidfd turns readable when the process ends: an event for a process that is not ours.
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _start_fleet(tmp_path: Path, url: str) -> tuple[subprocess.Popen[str], dict[int, str]]:
    """The command in a session of its own, once its offloaded run started; and its children."""
    env = command_env(tmp_path)
    # Interrupted as soon as the offloaded run starts: a workload longer than that is enough.
    args = [*FLEET, "--num-sessions", "40", "--think-time", "0.01", "--no-progress"]
    args += ["--redis-url", url, "--engines", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "run", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A session of its own: the process group's Ctrl-C must not reach pytest.
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        # Printed once every instance built its offloading engine (regions exist): the event.
        for line in proc.stdout:
            if "fs tier started" in line:
                break
        else:
            pytest.fail(f"the offloaded run never started: {proc.communicate()}")
        # The two instances, and multiprocessing's resource tracker.
        children = {pid: _cmdline(pid) for pid in _children(proc.pid)}
        assert len([c for c in children.values() if "spawn_main" in c]) == 2, children
        # Each instance's scheduler side and worker joined its region while the engine was
        # built, so the names are already gone: even a SIGKILL from here on leaves nothing.
        assert not _fleet_regions(proc.pid)
    except BaseException:
        _kill(proc)
        raise
    return proc, children


def _kill(proc: subprocess.Popen[str]) -> None:
    # A failed test's cleanup: SIGKILL leaves the instances no chance to unlink their regions.
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for path in _fleet_regions(proc.pid):
            path.unlink(missing_ok=True)


def _assert_nothing_left(proc: subprocess.Popen[str], children: dict[int, str]) -> None:
    # The instances were joined before the command ended; the tracker ends when its pipe closes
    # (the command's exit), a moment later.
    instances = [pid for pid, cmd in children.items() if "spawn_main" in cmd]
    assert not [pid for pid in instances if _alive(pid)]
    assert all(_ends_within(pid, 30) for pid in children)
    assert not _fleet_regions(proc.pid)


@pytest.mark.parametrize(
    ("to_group", "signum", "exit_code"),
    [(False, signal.SIGTERM, 143), (True, signal.SIGINT, 130)],
    ids=["sigterm-to-command", "ctrl-c-to-process-group"],
)
def test_an_interrupt_ends_every_instance_cleanly(
    tmp_path: Path, redis_server: RedisServer, to_group: bool, signum: int, exit_code: int
) -> None:
    proc, children = _start_fleet(tmp_path, redis_server.url)
    try:
        if to_group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        _kill(proc)
    assert proc.returncode == exit_code, err
    word = "terminated" if signum == signal.SIGTERM else "interrupted"
    assert [line for line in err.splitlines() if line.strip()] == [f"vllm-kv-offload: {word}"]
    _assert_nothing_left(proc, children)


def test_an_instance_killed_mid_run_fails_the_run_and_leaves_nothing(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    proc, children = _start_fleet(tmp_path, redis_server.url)
    try:
        victim = min(pid for pid, cmd in children.items() if "spawn_main" in cmd)
        os.kill(victim, signal.SIGKILL)  # no chance to unlink its region
        _, err = proc.communicate(timeout=120)
    finally:
        _kill(proc)
    assert proc.returncode == 1, err
    assert re.search(r"error: engine \d ended unexpectedly \(exit code -9\)", err), err
    _assert_nothing_left(proc, children)


def _fleet_json(tmp_path: Path, name: str, workload: list[str], *extra: str) -> dict[str, object]:
    """Run a fleet of two instances over ``workload`` (with ``extra`` options), each under
    ``tmp_path / name``; check that it passes and return its JSON report."""
    out = tmp_path / f"{name}.json"
    code = main(
        [
            *workload,
            "--no-progress",
            "--fs-root",
            str(tmp_path / name),
            "--engines",
            "2",
            "--json",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["verdict"]["status"] == "PASS"
    return doc  # type: ignore[no-any-return]


# Sessions that share documents: 40 sessions from 2 clients over 8 documents (7 read, by 17, 9,
# 4, 4, 3, 2 and 1 sessions), each instance with its own CPU tier and fs directory (nothing
# shared), so an instance keeps every document it read. Session affinity spreads the sessions
# of a document over both instances, and each computes it; only an index of the KV finds that
# another session read it, and where. The documents split into two halves of 20 sessions, so
# the load-balance guard need not move a document; with fewer sessions per document, or more
# clients, the guard on the first requests (one instance may not take all of the first three)
# and the order in which the clients' sessions arrive decide more of the outcome than the
# routing does. A GPU pool of two documents (48 blocks, not the tiny workload's 24): with one,
# two documents in flight on one instance preempt each other, and the recomputation that
# follows depends on the machine's timing more than on the routing.
SHARED_DOCUMENTS = [
    *workload_args(clients=2, sessions=40, think_time=0.001, timeout=300, turns=2, documents=8),
    "--gpu-blocks",
    "48",
]


def test_kv_aware_routing_computes_less_than_session_affinity(tmp_path: Path) -> None:
    session = _fleet_json(tmp_path, "session", SHARED_DOCUMENTS, "--routing", "session")
    kv = _fleet_json(
        tmp_path,
        "kv",
        SHARED_DOCUMENTS,
        "--routing",
        "kv-aware",
        "--metrics-port",
        str(free_port()),
    )
    computed = {
        name: doc["runs"]["offload"]["prompt_tokens"]["computed"]  # type: ignore[index]
        for name, doc in (("session", session), ("kv-aware", kv))
    }
    assert computed["kv-aware"] < computed["session"], computed
    for doc, policy in ((session, "session"), (kv, "kv-aware")):
        routing = doc["fleet"]["routing"]  # type: ignore[index]
        assert routing["policy"] == policy
        requests = routing["requests"]
        assert sum(requests) == 80 and max(requests) <= 1.2 * 40 + 1
    events = kv["fleet"]["routing"]["events"]  # type: ignore[index]
    assert events["lost"] == [0, 0] and min(events["batches"]) > 0
    assert session["fleet"]["routing"]["events"] is None  # type: ignore[index]
    # The router's own series (--metrics-port): its decisions per instance, and the feed's.
    metrics = kv["metrics"]["offload"]  # type: ignore[index]
    decisions = [
        metrics[f'vllm:router_decisions_total{{instance="{i}",policy="kv-aware"}}'] for i in (0, 1)
    ]
    assert decisions == kv["fleet"]["routing"]["requests"]  # type: ignore[index]
    assert metrics['vllm:router_event_lost{instance="0",policy="kv-aware"}'] == 0
    # The hash stand-in runs without the load guard: no instance measured its costs, and the
    # router scored both with the defaults.
    assert kv["fleet"]["routing"]["measured_costs"] == [None, None]  # type: ignore[index]


def test_kv_aware_routing_scores_the_instances_with_the_costs_they_measured(
    tmp_path: Path,
) -> None:
    # The transformer (its smallest preset) turns the load guard on: each instance estimates
    # what a prompt token costs it to compute and a block to load, and reports it with every
    # answer; the router scores the instance with those figures from then on.
    args = workload_args(clients=2, sessions=8, think_time=0.001, timeout=300)
    args[args.index("hash")] = "transformer"
    for flag in ("--num-layers", "--head-size"):  # the preset's geometry instead
        i = args.index(flag)
        del args[i : i + 2]
    doc = _fleet_json(tmp_path, "fleet", [*args, "--model-preset", "tiny"], "--routing", "kv-aware")
    measured = doc["fleet"]["routing"]["measured_costs"]  # type: ignore[index]
    assert len(measured) == 2
    reported = [m for m in measured if m is not None]
    assert reported, measured
    for m in reported:
        assert m["compute_us_per_token"] > 0
        assert m["load_cost"]["GPU"] == 0.0
        assert set(m["load_cost"]) == {"GPU", "CPU", "LOCAL_STORAGE", "SHARED_STORAGE"}


def test_a_fleet_serves_metrics_per_instance_and_logs_each_instance_with_v(
    tmp_path: Path,
) -> None:
    # No --redis-url: the instances share nothing (said in the header), and still each one's
    # metrics are served (series told apart by the engine label) and its log lines prefixed.
    out = tmp_path / "report.json"
    argv = [*FLEET, "--no-progress", "--fs-root", str(tmp_path / "fs"), "--engines", "2", "-v"]
    code, stderr, scrapes = scrape_while_running([*argv, "--json", str(out)], free_port())
    assert code == 0, stderr
    # Live: scraped during the runs, one series per instance.
    queries = "vllm:prefix_cache_queries_total"
    for engine in ("0", "1"):
        assert any(value(s, queries, engine=engine, run="baseline") > 0 for s in scrapes)
        assert any(
            value(s, "vllm:kv_offload_transfer_blocks_total", engine=engine, run="offload") > 0
            for s in scrapes
        ), engine
    # Counters only grow between scrapes.
    seen = [value(s, queries) for s in scrapes]
    assert seen == sorted(seen)
    # At the end: the JSON's metrics (summed over the instances) equal the fleet's figures.
    doc = json.loads(out.read_text())
    figure_checks(doc["runs"]["offload"], doc["metrics"]["offload"])
    base = doc["runs"]["baseline"]["prompt_tokens"]["total"]
    assert doc["metrics"]["baseline"][queries] == base
    # -v: each instance's INFO lines, prefixed with its index.
    for engine in ("0", "1"):
        assert f"engine {engine}: INFO vllm.v1.kv_offload.tiering.spec: Created secondary" in (
            stderr
        )
