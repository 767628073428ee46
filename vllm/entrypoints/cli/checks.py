# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Checks of ``run``'s options against the machine: directories, free space, output files.

Each check runs before the first engine step and returns None or one message that names the
value, the reason and the fix (``config.build_run_config`` refuses the option with it): a
problem found here costs the user a second, not the baseline run they waited for. A new check
is a function here returning ``str | None``, called from ``config._machine_problems``.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

from vllm.entrypoints.cli.report.text import format_bytes

SHM_DIR = "/dev/shm"
"""Where the CPU tier's shared region lives (the config's default ``shared_region_dir``)."""

METRICS_ADDRESS = "127.0.0.1"
"""Where ``--metrics-port`` listens: loopback only (the metrics reveal the workload's shape)."""

STDOUT = "-"
"""``--json -``: the JSON document goes to stdout (the human report to stderr)."""


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe


def fs_root_problem(root: Path) -> str | None:
    """Why the fs tier could not keep its files under ``root``, or None.

    The tier creates ``root`` itself; this probes the nearest directory that exists by creating
    (and removing) a temporary file in it, which also catches what permission bits do not show
    to root: read-only mounts and pseudo-filesystems such as ``/proc``.
    """
    fix = "choose a writable directory with --fs-root, or run without the fs tier (--no-fs)"
    probe = _nearest_existing(root)
    if not probe.is_dir():
        return f"--fs-root {root}: {probe} exists and is not a directory: {fix}"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".vllm-kv-offload-probe-"):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        return f"--fs-root {root}: cannot create files in {probe} ({reason}): {fix}"
    return None


def fs_max_bytes_problem(max_bytes: int, block_file_bytes: int) -> str | None:
    """Why ``--fs-max-bytes`` cannot hold a single block file, or None."""
    if max_bytes >= block_file_bytes:
        return None
    return (
        f"--fs-max-bytes {max_bytes} ({format_bytes(max_bytes)}) is smaller than one block file "
        f"({block_file_bytes} bytes with this geometry: a 4 KiB header and one offloaded block): "
        f"raise --fs-max-bytes to at least {block_file_bytes}, or pass --no-fs"
    )


def shm_problem(region_bytes: int, directory: str = SHM_DIR) -> str | None:
    """Why the CPU tier's shared region of ``region_bytes`` would not fit in ``directory``."""
    fix = f"lower --cpu-bytes or enlarge {directory} (in Docker: docker run --shm-size=...)"
    try:
        st = os.statvfs(directory)
    except OSError as e:
        reason = e.strerror or str(e)
        return f"--cpu-bytes: the CPU tier lives in {directory}, which is unusable ({reason})"
    available = st.f_bavail * st.f_frsize
    if region_bytes <= available:
        return None
    return (
        f"--cpu-bytes: the CPU tier needs {region_bytes} bytes ({format_bytes(region_bytes)}) "
        f"in {directory}, which has {format_bytes(available)} free: {fix}"
    )


def output_file_problem(flag: str, path: Path) -> str | None:
    """Why ``path`` cannot be written, or None (``-`` is stdout and always fine)."""
    if str(path) == STDOUT:
        return None
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        return f"{flag} {path}: is a directory: name a file in it, e.g. {path / 'report'}"
    if not parent.is_dir():
        return f"{flag} {path}: directory {parent} does not exist: create it or name another file"
    if not os.access(parent, os.W_OK):
        return f"{flag} {path}: directory {parent} is not writable: name a file elsewhere"
    return None


def plot_format_problem(path: Path) -> str | None:
    """Why matplotlib could not write ``path`` in the format its suffix names, or None.

    Imports matplotlib (only when ``--plot`` is given): the formats it writes depend on its
    version and backends, so they are asked, not listed here.
    """
    if str(path) == STDOUT:
        return "--plot -: a plot is binary, name a file such as run.png"
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = path.suffix[1:].lower()
    if suffix in formats:
        return None
    named = f"suffix .{suffix}" if suffix else "no suffix"
    return (
        f"--plot {path}: {named}, and the format is taken from the suffix: use one of "
        f"{', '.join('.' + f for f in formats)} (e.g. {path.with_suffix('.png').name})"
    )


def metrics_port_problem(port: int, address: str = METRICS_ADDRESS) -> str | None:
    """Why the metrics server could not listen on ``address:port``, or None.

    Probed by binding a socket the way the server will (``SO_REUSEADDR``, so a port left in
    ``TIME_WAIT`` by an earlier run is fine and one another process listens on is not), then
    closing it at once.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as e:
            reason = e.strerror or str(e)
            return (
                f"--metrics-port {port}: cannot listen on {address}:{port} ({reason}): choose "
                "another port, or leave --metrics-port out"
            )
    return None
