# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Small helpers shared across the package: ``class_registry`` (classes by name, imported on
first use), ``closing`` (``with obj:`` releases ``obj``) and ``field_checks`` (a config's lower
bounds on its counts)."""
