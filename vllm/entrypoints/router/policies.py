# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vllm-kv-offload project
"""Routing policies of a fleet's front end: which instance serves a request.

* ``round-robin``: request ``k`` (in arrival order) goes to instance ``k % N``; a session moves
  between instances from turn to turn.
* ``session``: a session stays on the instance its first turn went to (the least loaded then,
  by requests routed); what affinity routers do.
* ``kv-aware``: the instance whose expected cost is lowest (``docs/fleet.md``):

      cost_i = computed_i + sum over places p of tokens_{i,p} * load_cost_p
               + queue_weight * queued_i

  with ``tokens_{i,p}`` the prompt's prefix instance ``i`` would serve from place ``p``
  (``PrefixIndex.match``: its GPU cache, CPU tier, local storage, and the shared store, which
  counts for every instance; the GPU cache also holds the blocks of the requests in flight
  there, ``InstanceLoad.blocks``, which no event may have announced yet), ``computed_i`` the
  rest of the prompt, ``load_cost_p`` the cost of loading one token from ``p`` in units of
  computing one (``RoutingCosts``; per instance, from what it measured of itself once it
  has: ``measured_costs.MeasuredCosts``, ``KVAware.set_costs``), and ``queued_i`` the tokens
  instance ``i`` still has to prefill for requests already routed to it and not yet answered
  (the router's own count).
  A **load-balance guard** keeps every instance within its share: an instance that would then
  hold more than ``(1 + slack)`` times its fair share of the requests routed so far (this one
  included), plus one request, is not a candidate (``KVAware.cap``); ties go to the lower index.

Policies are told what the router knows (``RouteRequest``, the instances' ``InstanceLoad``) and
return a ``Decision``. Threading: called on the front end's event loop only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from typing_extensions import override

from vllm.distributed.kv_events import ExternalBlockHash
from vllm.entrypoints.router.prefix_index import Place, PrefixMatch

ROUTING_POLICIES = ("round-robin", "session", "kv-aware")
"""The names ``--routing`` takes."""
DEFAULT_SLACK = 0.2
"""The load-balance guard's default: no instance takes more than 1.2x its share (plus one)."""

PrefixMatcher = Callable[
    [Sequence[ExternalBlockHash], int, Sequence[Container[ExternalBlockHash]] | None],
    list[PrefixMatch],
]
"""The prefix lookup kv-aware routing scores with (``EventFeed.match``, ``PrefixIndex.match``):
the prompt's hashes, the hashed piece's tokens, and per instance the pieces known to be in its
GPU besides what its events announced."""


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request when it routes it.

    Attributes:
        request_id: the request's id.
        session_id: the conversation it belongs to.
        prompt_len: prompt tokens.
        block_hashes: the prompt's chained hashes per ``hash_block_size`` piece (empty for
            policies that do not look at them).
    """

    request_id: str
    session_id: str
    prompt_len: int
    block_hashes: Sequence[ExternalBlockHash] = ()


@dataclass
class InstanceLoad:
    """The router's count of one instance's work (its own bookkeeping, not the instance's).

    Attributes:
        routed: requests routed to it so far.
        in_flight: routed and not finished.
        queued_tokens: prompt tokens it is expected to compute for requests routed to it that
            have not produced their first token yet.
        blocks: the hashed pieces of the prompts in flight there (kv-aware: counted once per
            request). Their blocks are in its GPU pool, computed or about to be, and pinned
            until the request ends, whether or not its events announced them yet: a request
            that shares such a prefix and arrives meanwhile finds it there.
    """

    routed: int = 0
    in_flight: int = 0
    queued_tokens: int = 0
    blocks: Counter[ExternalBlockHash] = field(default_factory=Counter)


@dataclass(frozen=True)
class Decision:
    """A routing decision.

    Attributes:
        instance: where the request goes.
        costs: kv-aware: every instance's cost (None for an instance the guard excluded);
            empty for the other policies.
        match: kv-aware: what the chosen instance is expected to serve of the prefix.
        expected_computed: the prompt tokens the chosen instance is expected to compute (the
            whole prompt for policies that do not look at the index).
    """

    instance: int
    costs: tuple[float | None, ...] = ()
    match: PrefixMatch | None = None
    expected_computed: int = 0


@dataclass(frozen=True)
class RoutingCosts:
    """The cost of loading one token from each place, in units of computing one token.

    Attributes:
        load_cost: per ``Place``; 0 for the GPU cache (nothing moves).
        queue_weight: what one prompt token queued ahead on an instance (routed there, no
            first token yet) costs a new request there, in the same units: it waits for it
            but shares the steps' batches, so less than computing it.
    """

    load_cost: Mapping[Place, float] = field(
        default_factory=lambda: {
            Place.GPU: 0.0,
            Place.CPU: 0.05,
            Place.LOCAL_STORAGE: 0.15,
            Place.SHARED_STORAGE: 0.25,
        }
    )
    queue_weight: float = 0.25

    @classmethod
    def from_throughputs(
        cls,
        prefill_tokens_per_s: float,
        bytes_per_token: float,
        load_bytes_per_s: Mapping[Place, float],
    ) -> RoutingCosts:
        """Costs from throughputs: loading a token from ``p`` costs
        ``bytes_per_token / load_bytes_per_s[p]`` seconds, computing one
        ``1 / prefill_tokens_per_s``; places not given keep the defaults."""
        if prefill_tokens_per_s <= 0 or bytes_per_token <= 0:
            raise ValueError("throughputs and bytes per token must be positive")
        for place, bps in load_bytes_per_s.items():
            if bps <= 0:
                raise ValueError(f"load throughput of {place.name} must be positive, got {bps}")
        return cls.from_seconds(
            1 / prefill_tokens_per_s,
            {place: bytes_per_token / bps for place, bps in load_bytes_per_s.items()},
        )

    @classmethod
    def from_seconds(
        cls, compute_s_per_token: float, load_s_per_token: Mapping[Place, float]
    ) -> RoutingCosts:
        """Costs from times per token: ``load_cost_p = load_s_per_token[p] /
        compute_s_per_token``; places not given keep the defaults, the GPU costs 0.

        Raises:
            ValueError: a time that is not positive (a load may take 0 s).
        """
        if compute_s_per_token <= 0:
            raise ValueError(f"compute time per token must be positive, got {compute_s_per_token}")
        costs = dict(cls().load_cost)
        for place, seconds in load_s_per_token.items():
            if seconds < 0:
                raise ValueError(f"load time of {place.name} must be >= 0, got {seconds}")
            costs[place] = seconds / compute_s_per_token
        costs[Place.GPU] = 0.0
        return cls(costs, cls.queue_weight)


class RoutingPolicy(ABC):
    """Chooses an instance for each request (see the module docstring).

    Args:
        num_instances: instances ``0 .. num_instances - 1``.
    """

    name: ClassVar[str]

    def __init__(self, num_instances: int) -> None:
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances = num_instances

    @property
    def needs_hashes(self) -> bool:
        """Whether ``choose`` reads ``RouteRequest.block_hashes`` (the router hashes prompts
        only then)."""
        return False

    @abstractmethod
    def choose(self, request: RouteRequest, loads: Sequence[InstanceLoad]) -> Decision:
        """The instance for ``request``, given each instance's load."""


class RoundRobin(RoutingPolicy):
    """Request ``k`` to instance ``k % N`` (arrival order)."""

    name = "round-robin"

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self._next = 0

    @override
    def choose(self, request: RouteRequest, loads: Sequence[InstanceLoad]) -> Decision:
        instance = self._next
        self._next = (self._next + 1) % self.num_instances
        return Decision(instance, expected_computed=request.prompt_len)


class SessionAffinity(RoutingPolicy):
    """A session's turns all go where its first turn went (the least-routed instance then)."""

    name = "session"

    def __init__(self, num_instances: int) -> None:
        super().__init__(num_instances)
        self._homes: dict[str, int] = {}

    @override
    def choose(self, request: RouteRequest, loads: Sequence[InstanceLoad]) -> Decision:
        home = self._homes.get(request.session_id)
        if home is None:
            home = min(range(self.num_instances), key=lambda i: (loads[i].routed, i))
            self._homes[request.session_id] = home
        return Decision(home, expected_computed=request.prompt_len)


class KVAware(RoutingPolicy):
    """The cheapest instance by expected cost, within the load-balance guard.

    Args:
        num_instances: instances.
        match: the prefix lookup (``EventFeed.match``: the index fed by the instances' events),
            given each instance's ``InstanceLoad.blocks`` as blocks on its GPU.
        hash_block_size: tokens per hashed piece of ``RouteRequest.block_hashes``.
        costs: load cost per place, for every instance until ``set_costs`` gives it its own.
        slack: the guard's slack (>= 0, see ``cap``).
    """

    name = "kv-aware"

    def __init__(
        self,
        num_instances: int,
        match: PrefixMatcher,
        hash_block_size: int,
        costs: RoutingCosts | None = None,
        slack: float = DEFAULT_SLACK,
    ) -> None:
        super().__init__(num_instances)
        if slack < 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self._match = match
        self.hash_block_size = hash_block_size
        self.costs = costs or RoutingCosts()
        self.instance_costs: list[RoutingCosts] = [self.costs] * num_instances
        self.slack = slack

    @property
    @override
    def needs_hashes(self) -> bool:
        return True

    def set_costs(self, instance: int, costs: RoutingCosts) -> None:
        """Score ``instance`` with ``costs`` from now on (what it measured of itself)."""
        self.instance_costs[instance] = costs

    def cap(self, loads: Sequence[InstanceLoad]) -> float:
        """The most requests an instance may hold after taking this one: ``(1 + slack)`` times
        the fair share of the requests routed so far plus this one, plus one request. The
        least-routed instance always stays a candidate (it holds at most the fair share)."""
        total = sum(load.routed for load in loads)
        return (1 + self.slack) * (total + 1) / self.num_instances + 1

    @override
    def choose(self, request: RouteRequest, loads: Sequence[InstanceLoad]) -> Decision:
        matches = self._match(
            request.block_hashes, self.hash_block_size, [load.blocks for load in loads]
        )
        cap = self.cap(loads)
        costs: list[float | None] = []
        best: int | None = None
        best_cost = 0.0
        for i, (m, load) in enumerate(zip(matches, loads, strict=True)):
            if load.routed + 1 > cap:
                costs.append(None)
                continue
            own = self.instance_costs[i]
            cached = min(m.cached, request.prompt_len)
            cost = request.prompt_len - cached + own.queue_weight * load.queued_tokens
            cost += sum(n * own.load_cost[Place(p)] for p, n in enumerate(m.tokens) if n)
            costs.append(cost)
            if best is None or cost < best_cost:
                best, best_cost = i, cost
        assert best is not None, "the guard excluded every instance"
        chosen = matches[best]
        return Decision(
            best,
            costs=tuple(costs),
            match=chosen,
            expected_computed=request.prompt_len - min(chosen.cached, request.prompt_len),
        )


def make_policy(
    name: str,
    num_instances: int,
    match: PrefixMatcher | None = None,
    hash_block_size: int = 16,
    costs: RoutingCosts | None = None,
    slack: float = DEFAULT_SLACK,
) -> RoutingPolicy:
    """The policy ``name`` (one of ``ROUTING_POLICIES``); kv-aware needs ``match``."""
    if name == RoundRobin.name:
        return RoundRobin(num_instances)
    if name == SessionAffinity.name:
        return SessionAffinity(num_instances)
    if name == KVAware.name:
        if match is None:
            raise ValueError("kv-aware routing needs the prefix index of the instances' events")
        return KVAware(num_instances, match, hash_block_size, costs, slack)
    raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(ROUTING_POLICIES)}")
