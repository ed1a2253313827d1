"""Routing policies: which node serves a request, given each node's cached prefix and load.

Policies are registered by name (``@register_policy("name")``) and built with
``create_policy(name, params)``; each gets the eligible candidates (breaker closed, not excluded,
namespace agreeing) and returns a :class:`Decision` with a :class:`Score` per candidate.

``cache_aware`` (default) minimises ``cost = (1 - prefix_score) + load_weight * load`` where
``prefix_score = (l1_pages + l2_weight * l2_pages) / num_pages`` is the share of the request the node
need not recompute and ``load = max(in_flight, queue_depth)``: one queued request is worth
``load_weight`` of a full prefill (0.1: a full hit wins until its node has 10 more requests in flight).
A prefix below ``min_prefix_score`` of the request counts as none (SGLang's cache threshold): a shared
system prompt alone must not pull every new document set of a tenant onto the node that has it; such
requests go by load, which spreads new prefixes over the cluster.
Hot-spot protection: when the chosen node's load exceeds the least loaded candidate's by at least
``balance_abs_threshold`` *and* is above ``balance_rel_threshold`` times it, the choice is restricted
to candidates within ``balance_abs_threshold`` of the least loaded (the best cost among them wins, so
the popular prefix gets copied to a second node instead of queueing on one).

``round_robin`` and ``least_load`` ignore the cache (baselines). Every policy breaks ties by rotation,
never by list order, so equal nodes share the traffic.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hicache.registry import Registry

EPS = 1e-9


@dataclass(frozen=True)
class ScoringParams:
    load_weight: float = 0.1  # cost of one queued request, in full prefills
    l2_weight: float = 0.9  # an L2 page's worth relative to an L1 page (it must be loaded first)
    min_prefix_score: float = 0.2  # shorter prefixes (share of the request) count as no prefix
    balance_abs_threshold: float = 8.0  # hot spot: best load - min load >= this ...
    balance_rel_threshold: float = 1.5  # ... and best load > this * min load

    def __post_init__(self) -> None:
        if self.load_weight < 0:
            raise ValueError(f"load_weight: must be >= 0, got {self.load_weight}")
        if not 0 <= self.l2_weight <= 1:
            raise ValueError(f"l2_weight: must be in [0, 1], got {self.l2_weight}")
        if not 0 <= self.min_prefix_score <= 1:
            raise ValueError(f"min_prefix_score: must be in [0, 1], got {self.min_prefix_score}")
        if self.balance_abs_threshold <= 0:
            raise ValueError(f"balance_abs_threshold: must be > 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"balance_rel_threshold: must be >= 1, got {self.balance_rel_threshold}")


class Candidate(NamedTuple):
    node: str
    l1_pages: int  # request prefix on the node's L1
    l2_pages: int  # continued on its L2
    in_flight: int  # requests the router sent there, not completed
    queue_depth: int  # open requests the node reported (0 when stale)

    @property
    def load(self) -> float:
        return float(max(self.in_flight, self.queue_depth))


class Score(NamedTuple):
    node: str
    prefix_score: float  # (l1 + l2_weight * l2) / num_pages
    load: float  # max(in_flight, queue_depth)
    cost: float  # lower is better


class Decision(NamedTuple):
    chosen: int  # index into the candidates
    reason: str  # prefix | balance | hot_spot | round_robin | least_load
    scores: list[Score]  # one per candidate, same order


class RoutingPolicy(ABC):
    """Chooses one of ``candidates`` (never empty) for a request of ``num_pages`` full pages.

    Policies may keep state (rotation counters) and are called from one thread.
    """

    name = ""

    def __init__(self, params: ScoringParams) -> None:
        self.params = params
        self._turn = itertools.count()

    def prefix_score(self, c: Candidate, num_pages: int) -> float:
        if num_pages <= 0:
            return 0.0
        return (c.l1_pages + self.params.l2_weight * c.l2_pages) / num_pages

    def pick(self, costs: Sequence[float], among: Sequence[int] | None = None) -> int:
        """Index of the lowest cost (restricted to ``among``); ties rotate."""
        idx = list(range(len(costs))) if among is None else list(among)
        best = min(costs[i] for i in idx)
        ties = [i for i in idx if costs[i] <= best + EPS]
        return ties[next(self._turn) % len(ties)]

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate], num_pages: int) -> Decision: ...


POLICIES: Registry[type[RoutingPolicy]] = Registry("routing policy", unique=True)


def register_policy(name: str) -> Callable[[type[RoutingPolicy]], type[RoutingPolicy]]:
    def deco(cls: type[RoutingPolicy]) -> type[RoutingPolicy]:
        POLICIES.add(name, cls)
        cls.name = name
        return cls

    return deco


def policy_names() -> list[str]:
    return POLICIES.names()


def create_policy(name: str, params: ScoringParams | None = None) -> RoutingPolicy:
    return POLICIES.get(name)(params or ScoringParams())


@register_policy("cache_aware")
class CacheAware(RoutingPolicy):
    def choose(self, candidates: Sequence[Candidate], num_pages: int) -> Decision:
        p = self.params
        prefix = [self.prefix_score(c, num_pages) for c in candidates]
        loads = [c.load for c in candidates]
        useful = [s if s >= p.min_prefix_score else 0.0 for s in prefix]
        costs = [(1.0 - s) + p.load_weight * ld for s, ld in zip(useful, loads, strict=True)]
        scores = [Score(c.node, s, ld, cost) for c, s, ld, cost in zip(candidates, prefix, loads, costs, strict=True)]
        best = self.pick(costs)
        low = min(loads)
        if loads[best] - low >= p.balance_abs_threshold and loads[best] > p.balance_rel_threshold * low:
            near = [i for i, ld in enumerate(loads) if ld - low < p.balance_abs_threshold]
            return Decision(self.pick(costs, near), "hot_spot", scores)
        return Decision(best, "prefix" if useful[best] > 0 else "balance", scores)


@register_policy("round_robin")
class RoundRobin(RoutingPolicy):
    def choose(self, candidates: Sequence[Candidate], num_pages: int) -> Decision:
        scores = [Score(c.node, self.prefix_score(c, num_pages), c.load, 0.0) for c in candidates]
        return Decision(next(self._turn) % len(candidates), "round_robin", scores)


@register_policy("least_load")
class LeastLoad(RoutingPolicy):
    def choose(self, candidates: Sequence[Candidate], num_pages: int) -> Decision:
        loads = [c.load for c in candidates]
        scores = [Score(c.node, self.prefix_score(c, num_pages), ld, ld) for c, ld in zip(candidates, loads,
                                                                                           strict=True)]
        return Decision(self.pick(loads), "least_load", scores)
