# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``--metrics-port``: Prometheus metrics scraped over HTTP during a run, and equal to the report.

Scrapes are real HTTP requests to ``127.0.0.1`` (a free port, short timeouts), parsed with
``prometheus_client``'s own parser. The catalogue's documentation and the Grafana dashboard are
checked against the metric names too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.cli.test_run import TINY
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metric_catalog import (
    BY_NAME,
    CATALOG,
    MetricType,
)
from vllm.entrypoints.cli.config import build_run_config
from vllm.entrypoints.cli.engine_run import engine_config
from vllm.entrypoints.cli.main import build_parser
from vllm.entrypoints.cli.metrics_server import EngineMetrics, MetricsServer
from vllm.entrypoints.cli.workloads import generate_workload
from vllm.v1.engine.core import EngineCore

REPO = Path(__file__).resolve().parents[3]
SCRAPE_TIMEOUT_S = 5.0

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> Series:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        text = response.read().decode()
    series: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return series


def value(series: Series, name: str, **labels: str) -> float:
    """The sum of ``name``'s series whose labels include ``labels``."""
    return sum(v for (n, ls), v in series.items() if n == name and set(labels.items()) <= set(ls))


def test_scrape_during_a_run_shows_hits_stores_and_loads_of_both_tiers(tmp_path: Path) -> None:
    """The CLI's engine and exporter, driven step by step here, scraped before the run ends."""
    parser = build_parser()
    args = parser.parse_args(["run", *TINY, "--fs-root", str(tmp_path / "fs")])
    config = build_run_config(args)
    workload = generate_workload(config.workload)
    recorder = EngineMetrics()
    server = MetricsServer(recorder.registry, 0)
    try:
        with EngineCore(engine_config(config, offload=True)) as engine:
            recorder.attach(engine, "offload")
            sessions = workload.sessions
            for session in sessions:
                history: list[int] = list(session.prefix)
                for t, turn in enumerate(session.turns):
                    prompt = session.prompt(t, history)
                    out = engine.generate({session.request_id(t): prompt}, turn.max_tokens)
                    if session.keeps_history:
                        history = [*prompt, *out[session.request_id(t)]]
            # The run is not over (the engine and its tiers are up): scrape it.
            live = scrape(server.url)
    finally:
        server.close()
    run = {"run": "offload"}
    for tier in ("0:primary", "1:fs"):
        assert value(live, "vllm:kv_offload_tiering_chunk_hits_total", tier=tier, **run) > 0
        assert value(live, "vllm:kv_offload_tier_hit_tokens_total", tier=tier, **run) > 0
    for direction in ("GPU_to_CPU", "CPU_to_GPU", "CPU_to_fs", "fs_to_CPU"):
        blocks = value(
            live, "vllm:kv_offload_transfer_blocks_total", transfer_type=direction, **run
        )
        assert blocks > 0, direction
        assert (
            value(
                live,
                "vllm:kv_offload_transfer_latency_seconds_count",
                transfer_type=direction,
                **run,
            )
            > 0
        )
    assert value(live, "vllm:kv_offload_store_bytes_total", **run) > 0
    assert value(live, "vllm:kv_offload_load_bytes_total", **run) > 0
    assert value(live, "vllm:kv_offload_tier_used_blocks", tier="1:fs", **run) > 0


def figure_checks(run: dict[str, Any], metrics: dict[str, float]) -> None:
    """Every figure the report derives from counters equals the matching counter exactly."""

    def m(key: str) -> float:
        return metrics.get(key, 0.0)

    names = {
        "gpu_to_cpu": "GPU_to_CPU",
        "cpu_to_gpu": "CPU_to_GPU",
        "cpu_to_fs": "CPU_to_fs",
        "fs_to_cpu": "fs_to_CPU",
    }
    for key, direction in names.items():
        figures = run["transfers"][key]
        label = f'{{transfer_type="{direction}"}}'
        assert m(f"vllm:kv_offload_transfer_blocks_total{label}") == figures["blocks"], key
        assert m(f"vllm:kv_offload_transfer_bytes_total{label}") == figures["bytes"], key
        assert (
            m(f"vllm:kv_offload_transfer_failed_blocks_total{label}") == figures["failed_blocks"]
        ), key
    assert (
        m('vllm:kv_offload_tier_skipped_blocks_total{tier="1:fs"}')
        == (run["transfers"]["cpu_to_fs"]["skipped_blocks"])
    )
    tokens = run["prompt_tokens"]
    assert m("vllm:prefix_cache_queries_total") == tokens["total"]
    assert m("vllm:prefix_cache_hits_total") == tokens["gpu_prefix_cache"]
    assert m('vllm:kv_offload_tier_hit_tokens_total{tier="0:primary"}') == tokens["cpu_tier"]
    assert m('vllm:kv_offload_tier_hit_tokens_total{tier="1:fs"}') == tokens["fs_tier"]
    if run["redis_url"] is not None:  # the second secondary tier, after the fs tier
        assert m('vllm:kv_offload_tier_hit_tokens_total{tier="2:redis"}') == tokens["redis_tier"]
    corrupt = run["verification"]["corrupt_blocks_detected"]
    assert m('vllm:kv_offload_tier_corrupt_blocks_total{tier="1:fs"}') == corrupt
    assert m("vllm:kv_offload_jobs_in_flight") == 0


def scrape_while_running(argv: list[str], port: int) -> tuple[int, str, list[Series]]:
    """Run the command in its own process (it owns the signals) and scrape ``port`` until it
    ends; its exit code, its stderr and the scrapes that succeeded."""
    url = f"http://127.0.0.1:{port}/metrics"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv, "--metrics-port", str(port)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    scrapes: list[Series] = []
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError):  # not listening yet, or already closed
                scrapes.append(scrape(url))
            time.sleep(0.05)  # the pace of the scrapes, not a synchronisation
        _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, stderr, scrapes


def test_cli_serves_metrics_during_the_run_and_they_equal_the_report(tmp_path: Path) -> None:
    """The command in its own process, scraped from here while it runs."""
    out = tmp_path / "report.json"
    argv = [*TINY, "--fs-root", str(tmp_path / "fs"), "--json", str(out)]
    code, stderr, scrapes = scrape_while_running(argv, free_port())
    assert code == 0, stderr
    # Live: scraped while the runs were going, with both runs' series told apart.
    assert scrapes, "no scrape succeeded while the run was going"
    assert any(value(s, "vllm:prefix_cache_queries_total", run="baseline") > 0 for s in scrapes)
    # Counters only grow between scrapes.
    key = "vllm:prefix_cache_queries_total"
    seen = [value(s, key) for s in scrapes]
    assert seen == sorted(seen)

    doc = json.loads(out.read_text())
    assert set(doc["metrics"]) == {"baseline", "offload"}
    figure_checks(doc["runs"]["offload"], doc["metrics"]["offload"])
    base = doc["metrics"]["baseline"]
    assert (
        base["vllm:prefix_cache_queries_total"] == doc["runs"]["baseline"]["prompt_tokens"]["total"]
    )
    assert not any(k.startswith("vllm:kv_offload") for k in base)


# ---------------------------------------------------------------------------------------------
# Documentation and dashboard
# ---------------------------------------------------------------------------------------------


def test_docs_list_every_metric_with_its_type_and_labels() -> None:
    text = (REPO / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `(vllm:[a-z_:]+)` \| (\w+) \| ([^|]*) \|", text, re.MULTILINE)
    documented = {name: (kind, labels.strip()) for name, kind, labels in rows}
    assert set(documented) == set(BY_NAME)
    for m in CATALOG:
        kind, labels = documented[m.name]
        assert kind == m.type.value, m.name
        expected = ", ".join(f"`{label}`" for label in m.labelnames) or "-"
        assert labels == expected, m.name


def test_dashboard_queries_only_catalogued_metrics() -> None:
    dashboard = json.loads((REPO / "docs" / "grafana" / "kv_offload.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert exprs
    suffixes = {
        MetricType.COUNTER: ("_total",),
        MetricType.GAUGE: ("",),
        MetricType.HISTOGRAM: ("_bucket", "_sum", "_count"),
    }
    for expr in exprs:
        for name in re.findall(r"vllm:[a-z_:]+", expr):
            base = next(
                (m for m in CATALOG for suffix in suffixes[m.type] if name == m.name + suffix),
                None,
            )
            assert base is not None, f"{name} in {expr!r} is not an exposed series"
