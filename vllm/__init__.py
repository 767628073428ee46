# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Standalone implementation of vLLM's KV-cache offload subsystem.

The import name mirrors vLLM's in-tree paths so that the modules read like the upstream ones they
replace; this package neither imports nor requires upstream vLLM. Both install a top-level
``vllm`` package, so they cannot share an environment: installing one over the other overwrites
the files they both have (``vllm/__init__.py``, ``vllm/_custom_ops.py``, ``vllm/v1/kv_offload/...``)
and leaves a tree that is neither, and uninstalling either removes files the other needs. Importing
this package in an environment where upstream vLLM (the distribution ``vllm``) is installed
therefore fails at once, with the fix, instead of failing later somewhere unrelated.
"""

__version__ = "0.1.0"


def _refuse_upstream_vllm() -> None:
    """Raise ``ImportError`` if upstream vLLM is installed in this environment.

    One metadata lookup (a few milliseconds, next to torch's second or so).
    """
    from importlib import metadata

    try:
        upstream = metadata.distribution("vllm")
    except metadata.PackageNotFoundError:
        return
    raise ImportError(
        f"upstream vLLM {upstream.version} is installed in this environment, and "
        "vllm-kv-offload installs the same top-level 'vllm' package: the two overwrite each "
        "other's files. Use a separate virtual environment for each (in this one: "
        "pip uninstall -y vllm vllm-kv-offload, then reinstall the one you want)."
    )


_refuse_upstream_vllm()
