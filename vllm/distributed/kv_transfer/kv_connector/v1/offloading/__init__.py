# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The offloading connector: moves KV blocks between the GPU and an ``OffloadingManager``'s tiers.

Modules: ``common`` (metadata exchanged between the halves), ``scheduler`` (scheduler side,
drives the manager) with its parts ``request_state`` (what is tracked per request), ``jobs``
(the transfer jobs in flight: worker reports, fences, resets) and ``metrics`` (statistics),
``worker`` (worker side, drives the transfer handlers) and ``offloading_connector`` (the facade
with vLLM's KV connector v1 method names).
"""
