# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""A fleet's front-end router: routing policies, and the prefix index it keeps from the KV events
the instances publish (``docs/fleet.md``)."""
