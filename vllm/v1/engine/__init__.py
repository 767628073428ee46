# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The engine core: a step loop over a scheduler, GPU block pools and a model (the transformer of
``model_executor`` or a hash stand-in).

It drives the offloading connector exactly as vLLM's scheduler and workers do, so the whole
offload stack can be run, tested and measured end to end (see ``core.EngineCore``).
"""
