# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The report of ``vllm-kv-offload run``, in three layers that import downwards only.

- ``figures.py``: the data model (what the runs measured; derived figures such as hit rates).
- ``verdict.py``: the judgement (the verdict and its reasons, why nothing was saved).
- ``text.py``, ``json_doc.py``, ``plot.py``: the renderings (the 80-column text, the ``--json``
  document, the ``--plot`` figure), each reading the two layers above.

Nothing here talks to an engine: ``cli/engine_run.py`` and ``cli/fleet.py`` fill the figures.
"""
