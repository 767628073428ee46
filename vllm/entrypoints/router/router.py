# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""``Router``: a fleet front end's routing, with its own bookkeeping and figures.

It hashes a prompt the way the instances do (chained prefix hashes of ``hash_block_size``-token
pieces, ``vllm.v1.core.kv_cache_utils``) when the policy needs them, asks the policy, and keeps
per instance what it routed there, what is still waiting for a first token and the prompt
blocks of what is still in flight (``InstanceLoad``); nothing it uses comes from inside an
instance but the events the instances publish (through the policy's ``EventFeed``) and the
costs they measured of themselves (``on_measured_costs``: their load guards' estimates, which
they publish as metrics).
``RouterStats`` are what the report and the metrics show.

Threading: the front end's event loop only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from vllm.distributed.kv_events import ExternalBlockHash
from vllm.entrypoints.router.measured_costs import MeasuredCosts
from vllm.entrypoints.router.policies import (
    Decision,
    InstanceLoad,
    KVAware,
    RouteRequest,
    RoutingPolicy,
)
from vllm.entrypoints.router.prefix_index import Place
from vllm.v1.core.kv_cache_utils import BlockHash, BlockHasher, get_request_block_hasher
from vllm.v1.request import Request


@dataclass
class RouterStats:
    """The router's own figures (cumulative).

    Attributes:
        policy: the policy's name.
        decisions: requests routed, per instance.
        expected_cached_tokens: per ``Place`` name, the prompt tokens the chosen instances were
            expected to serve from there (kv-aware only; the index's view).
        expected_computed_tokens: prompt tokens the chosen instances were expected to compute.
        chosen_cost_sum: kv-aware: the chosen instances' costs added up.
        guard_exclusions: kv-aware: candidates the load-balance guard excluded.
        last_costs: kv-aware: the last decision's cost per instance (None: excluded).
        measured: per instance, the last costs it reported measuring (None: none yet; the
            policy's defaults score it).
    """

    policy: str
    decisions: list[int]
    expected_cached_tokens: dict[str, int] = field(
        default_factory=lambda: {p.name: 0 for p in Place}
    )
    expected_computed_tokens: int = 0
    chosen_cost_sum: float = 0.0
    guard_exclusions: int = 0
    last_costs: tuple[float | None, ...] = ()
    measured: list[MeasuredCosts | None] = field(default_factory=list)


def prompt_block_hashes(prompt: list[int], hasher: BlockHasher) -> list[BlockHash]:
    """The chained hashes of the prompt's full pieces, as an engine computes them."""
    return hasher(Request("route", prompt, 1))


class Router:
    """Routes requests with ``policy`` (see the module docstring).

    Args:
        policy: the routing policy.
        hash_block_size: tokens per hashed piece (the instances' ``hash_block_size``).
        prompt_hasher: the prompt's hashes as the instances name their blocks; default: this
            project's chained hashing of ``hash_block_size``-token pieces. Instances that hash
            otherwise (real vLLM: its hash function, seed and integer hashes) need theirs here.
    """

    def __init__(
        self,
        policy: RoutingPolicy,
        hash_block_size: int = 16,
        prompt_hasher: Callable[[list[int]], Sequence[ExternalBlockHash]] | None = None,
    ) -> None:
        self.policy = policy
        self.hash_block_size = hash_block_size
        if prompt_hasher is None:
            block_hasher = get_request_block_hasher(hash_block_size)
            prompt_hasher = partial(prompt_block_hashes, hasher=block_hasher)
        self._prompt_hasher = prompt_hasher
        n = policy.num_instances
        self.loads = [InstanceLoad() for _ in range(n)]
        self.stats = RouterStats(policy=policy.name, decisions=[0] * n, measured=[None] * n)
        # request id -> (instance, tokens counted in its queue until the first token).
        self._open: dict[str, tuple[int, int]] = {}
        # request id -> its prompt's hashes counted in its instance's InstanceLoad.blocks.
        self._blocks: dict[str, Sequence[ExternalBlockHash]] = {}

    def route(self, request_id: str, session_id: str, prompt: list[int]) -> Decision:
        """Choose the instance for a request and count it there."""
        hashes = self._prompt_hasher(prompt) if self.policy.needs_hashes else ()
        decision = self.policy.choose(
            RouteRequest(request_id, session_id, len(prompt), hashes), self.loads
        )
        i = decision.instance
        load = self.loads[i]
        load.routed += 1
        load.in_flight += 1
        load.queued_tokens += decision.expected_computed
        self._open[request_id] = (i, decision.expected_computed)
        if hashes:
            load.blocks.update(hashes)
            self._blocks[request_id] = hashes
        stats = self.stats
        stats.decisions[i] += 1
        stats.expected_computed_tokens += decision.expected_computed
        if decision.match is not None:
            for place in Place:
                stats.expected_cached_tokens[place.name] += decision.match.tokens[place]
        if decision.costs:
            chosen = decision.costs[i]
            stats.chosen_cost_sum += chosen or 0.0
            stats.guard_exclusions += sum(1 for c in decision.costs if c is None)
            stats.last_costs = decision.costs
        return decision

    def on_measured_costs(self, instance: int, measured: MeasuredCosts) -> None:
        """``instance`` reported what it measured of its own costs: kv-aware scores it with
        them from now on."""
        self.stats.measured[instance] = measured
        if isinstance(self.policy, KVAware):
            self.policy.set_costs(instance, measured.costs())

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill is over: its tokens leave its instance's queue."""
        entry = self._open.get(request_id)
        if entry is not None and entry[1]:
            i, tokens = entry
            self.loads[i].queued_tokens -= tokens
            self._open[request_id] = (i, 0)

    def on_finished(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted)."""
        self.on_first_token(request_id)
        entry = self._open.pop(request_id, None)
        if entry is not None:
            load = self.loads[entry[0]]
            load.in_flight -= 1
            blocks = load.blocks
            # Counts that reach zero go, so the map stays the size of what is in flight.
            for h in self._blocks.pop(request_id, ()):
                n = blocks[h] - 1
                if n:
                    blocks[h] = n
                else:
                    del blocks[h]
