# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Multi-tier offloading: a CPU primary tier fronting write-through secondary tiers.

``manager`` (``TieringOffloadingManager``, and upstream's path of the primary tier) drives
``primary`` (``CPUPrimaryTierOffloadingManager``) and the tiers; ``tier_jobs`` is the jobs'
lifecycle (promotions queued by lookup, jobs submitted, tier reports checked and applied);
``base`` is the interface a tier implements (``SecondaryTierManager``, ``TierJob``,
``JobResult``); ``factory``, ``spec`` and ``stats`` its registry, the spec and the per-tier
counters. Tiers: ``example`` (in memory, the template), ``fs`` and ``redis``;
``async_lookup``, ``tier_plumbing``, ``block_format``, ``run_identity`` and ``secret_files`` are
what they share.
"""
