"""Standalone implementation of vLLM's KV-cache offload subsystem.

The import name mirrors vLLM's in-tree paths so that the modules read like the upstream ones they
replace; this package neither imports nor requires upstream vLLM.
"""

__version__ = "0.1.0"
