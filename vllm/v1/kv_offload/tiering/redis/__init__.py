# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Redis secondary tier (type ``"redis"``): blocks shared through a Redis server or cluster.

Modules: ``config`` (tier kwargs), ``redaction`` (credentials masked in what the tier prints),
``client`` (clients, the router, error kinds), ``direct_io`` (the tier's own connections: ``GET``
replies received straight into rows, streamed ``SET`` rounds), ``health`` (circuit breaker,
refused commands, health thread), ``transfer`` (pipelined stores and verified loads),
``local_view`` (blocks known to be on the server: lookups answered at once), ``manager``
(``RedisSecondaryTier``), ``probe`` (checking a config's server before a run). Values use the
shared ``tiering.block_format``. See ``docs/redis_tier.md``.
"""
