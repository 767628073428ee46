# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""The ``vllm-kv-offload`` command: ``run`` (the main job) and ``bench``.

Modules, each importing only those below it (no cycle):

- ``main``: the parser, the subcommand, exit codes and signals.
- ``run``: the command's sequence (header, baseline, offloaded run, report, files).
- ``fleet`` -> ``fleet_instance``: ``--engines N``, the router and the instances' processes.
- ``engine_run``: one engine run in this process and what it measured; ``clients``: the
  workload's concurrent clients; ``metrics_server``: ``--metrics-port``.
- ``config``: what the options become, one config per layer (workload, engine, tiers, fleet,
  output), built once; ``checks``: the options against the machine; ``fs_clear``.
- ``options``, ``option_values``: the option table and the values' parsers.
- ``report/``: the report's data (``figures``), judgement (``verdict``) and renderings
  (``text``, ``json_doc``, ``plot``); ``progress``, ``interrupt``, ``workloads``, ``bench``.

Adding an option: a row in its group of ``options.py``, a field in the layer config of
``config.py`` it configures and the builder line that fills it (and a key in ``_settings`` if
the report echoes it), a row in ``docs/cli.md``. Adding a report line: the figure as a field of
``report/figures.py``, filled in ``engine_run.fill_result`` (and added up for a fleet in
``RunResult.sum_of``), shown by a ``yield`` in ``report/text.py`` and a key in
``report/json_doc.py``.
"""
