# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""In-memory reference secondary tier (type ``"example"``): a worked example and a test double."""

from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager

__all__ = ["ExampleSecondaryTierManager"]
