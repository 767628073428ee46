# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""KV-cache offloading: keys, specs, managers and the tiers behind them.

At this level, shared by every medium: ``base`` (the ``OffloadingManager`` interface, keys,
transfer descriptors, events, ``TierStats``), ``mediums`` (the medium-neutral CPU descriptor),
``spec`` / ``factory`` / ``config`` (``OffloadingSpec``, its registry and configuration),
``sizes`` (the one byte-count parser) and ``metrics`` (how managers and tiers report metrics).
Packages: ``cpu`` (the CPU primary tier: scheduler side, shared region, worker-side copies),
``tiering`` (secondary tiers behind it) and ``worker`` (the medium-neutral worker side).
"""
