# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The package's one logger helper, as in vLLM: every module calls ``init_logger(__name__)``.

Loggers live under the ``vllm`` namespace, so one configuration (the command's ``-v``/``-vv``
in ``vllm/entrypoints/cli/main.py``) reaches them all. The library itself installs no handler and
sets no level: an embedding application keeps control of its logging.
"""

import logging

__all__ = ["init_logger"]


def init_logger(name: str) -> logging.Logger:
    """Return the logger of module ``name`` (pass ``__name__``)."""
    return logging.getLogger(name)
