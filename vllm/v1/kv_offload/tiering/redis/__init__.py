# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Redis secondary tier (type ``"redis"``): blocks shared through a Redis server or cluster.

Modules: ``config`` (tier kwargs), ``client`` (client settings, zero-copy values, error kinds),
``direct_io`` (``GET`` replies received straight into rows, streamed ``SET`` rounds), ``health``
(circuit breaker, health thread), ``transfer`` (pipelined stores and verified loads), ``manager``
(``RedisSecondaryTier``). Values use the shared ``tiering.block_format``. See
``docs/redis_tier.md``.
"""
