# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The ``vllm-kv-offload`` command: ``run`` (the main job) and ``bench``."""
