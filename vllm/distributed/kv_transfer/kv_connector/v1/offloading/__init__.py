# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The offloading connector: moves KV blocks between the GPU and an ``OffloadingManager``'s tiers.

Modules: ``offloading_connector`` (``OffloadingConnector``, the ``KVConnectorBase_V1`` the engine
builds), ``common`` (metadata exchanged between the halves), ``scheduler`` (scheduler side,
drives the manager) with its parts ``request_state`` (what is tracked per request),
``transfer_jobs`` (the transfer jobs in flight: worker reports, fences, resets),
``engine_checks`` (refusals of engine calls), ``groups`` (full-attention and sliding-window
groups), ``events`` (KV events), ``metrics`` / ``stats_collector`` / ``metric_catalog`` /
``prometheus`` (statistics), and ``worker`` (worker side, drives the transfer handlers).
"""
