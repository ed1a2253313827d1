"""The approximate index driven through :class:`~hicache.router.core.Router`, the way the servicer drives it:
routes (tenants, peeks, excluded nodes, every policy), completions with any status code, the router's own
outcomes, withdrawn routes, ListNodes, scrapes and time passing, checked against a model of what should be
predicted.

The model keeps, per node, every page of every route sent there with the time it was last routed, and
forgets a node's pages when its breaker trips, pages past the TTL, and the pages the latest route added
when it is withdrawn. The router must predict exactly that while no page was evicted for capacity (a subset
of it after), keep every prediction prefix-closed, predict nothing on an open breaker, report it in
ListNodes and score it in every decision, and account for every page it forgets once in the metrics.
"""

from __future__ import annotations

import grpc
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from prometheus_client import CollectorRegistry
from router_helpers import PS, Clock, node_config, router_config, tokens

from hicache.keys import page_keys_from_bytes
from hicache.router import Router
from hicache.router.core import NoNodeError
from hicache.router.server import APPROX_REASONS, RouterMetrics

NODES = ("a", "b", "c")
CODES = (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED)
COOLDOWN = 5.0


class ApproxRouterMachine(RuleBasedStateMachine):
    @initialize(cap=st.integers(1, 40), ttl=st.sampled_from([3.0, 10.0, 60.0]), failures=st.integers(1, 3))
    def setup(self, cap: int, ttl: float, failures: int) -> None:
        self.clock = Clock()
        self.ttl = ttl
        self.r = Router(node_config(), router_config(
            list(NODES), index="approximate", approx_ttl_s=ttl, approx_capacity_tokens=cap * PS,
            breaker_failures=failures, breaker_cooldown_s=COOLDOWN, breaker_max_cooldown_s=4 * COOLDOWN,
            route_ttl_s=2 * ttl))
        assert self.r.approx is not None
        self.ax = self.r.approx
        self.ax.clock = self.clock
        self.r.inflight._clock = self.clock
        for s in self.r.nodes.values():
            s.breaker._clock = self.clock
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.r, self.registry)
        self.model: dict[str, dict[bytes, float]] = {n: {} for n in NODES}  # node -> key -> last routed
        self.parent: dict[bytes, bytes | None] = {}
        self.inserted = 0  # pages predicted anew, ever: each is held or forgotten once
        self.live: list[str] = []  # route ids not completed nor withdrawn
        self.started: dict[str, float] = {}  # route id -> when it was routed
        self.latest: tuple[str, str, set[bytes]] = ("", "", set())  # route id, node, keys it added (model)

    # ------------------------------------------------------------------ helpers
    def _alive(self, node: str) -> dict[bytes, float]:
        cutoff = self.clock.t - self.ttl
        return {k: t for k, t in self.model[node].items() if t > cutoff}

    def _expire_model(self) -> None:
        for n in NODES:
            self.model[n] = self._alive(n)

    def _trips(self) -> dict[str, int]:
        return {n: s.breaker.trips for n, s in self.r.nodes.items()}

    def _after_outcome(self, before: dict[str, int]) -> None:
        for n, trips in self._trips().items():
            if trips != before[n]:  # the breaker opened: the node may be back empty
                self.model[n] = {}

    def _held(self, node: str) -> set[bytes]:
        return set(self.r.index.feed(node).pages)

    # ------------------------------------------------------------------ rules
    @rule(doc=st.integers(0, 3), q=st.integers(0, 3), q_pages=st.integers(0, 3), doc_pages=st.integers(0, 5),
          tenant=st.sampled_from(["", "", "acme", "zeta"]), peek=st.booleans(),
          exclude=st.sets(st.sampled_from(NODES), max_size=3),
          policy=st.sampled_from(["", "cache_aware", "round_robin", "least_load"]), odd=st.integers(0, PS - 1))
    def route(self, doc: int, q: int, q_pages: int, doc_pages: int, tenant: str, peek: bool, exclude: set[str],
              policy: str, odd: int) -> None:
        toks = np.concatenate([tokens(doc, doc_pages), tokens(100 + q, q_pages), tokens(7, 1)[:odd]])
        tb = toks.astype("<u4").tobytes()
        keys = page_keys_from_bytes(self.r.namespace(tenant).digest, tb, PS)
        for i, k in enumerate(keys):
            self.parent[k] = keys[i - 1] if i else None
        alive = {n: self._alive(n) for n in NODES}
        before = {n: self._held(n) & set(alive[n]) for n in NODES}  # what the route's own sweep leaves
        self._expire_model()
        exact = self.ax.evicted == 0
        try:
            d = self.r.route(tb, tenant, policy, sorted(exclude), peek)
        except NoNodeError:
            assert all(n in exclude or not self.r.nodes[n].breaker.allow() for n in NODES)
            return
        assert d.num_pages == len(keys)
        for n, s in d.scores.items():  # every node is scored on what is predicted there now (past the TTL: not)
            lead = 0
            while lead < len(keys) and keys[lead] in self.model[n]:
                lead += 1
            assert s.l2_pages == 0 and (s.l1_pages == lead if exact else s.l1_pages <= lead), (n, s, lead)
        assert d.node not in exclude and self.r.nodes[d.node].breaker.allow()
        if peek:
            assert d.route_id == ""
            return
        added = set(keys) - set(self.model[d.node])
        for k in keys:
            self.model[d.node][k] = self.clock.t
        self.inserted += len(set(keys) - before[d.node])
        self.live.append(d.route_id)
        self.started[d.route_id] = self.clock.t
        self.latest = (d.route_id, d.node, added)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), code=st.sampled_from(CODES))
    def complete(self, i: int, code: grpc.StatusCode) -> None:
        rid = self.live.pop(i % len(self.live))
        before = self._trips()
        self.r.complete(rid, code)
        self._after_outcome(before)

    @rule(node=st.sampled_from(NODES), code=st.sampled_from(CODES))
    def node_outcome(self, node: str, code: grpc.StatusCode) -> None:
        """The router's own call to the node (or a client's report) ended with ``code``."""
        before = self._trips()
        self.r.record(node, code)
        self._after_outcome(before)

    @precondition(lambda self: self.live)
    @rule(latest=st.booleans(), i=st.integers(0, 50))
    def withdraw(self, latest: bool, i: int) -> None:
        rid = self.live[-1] if latest else self.live[i % len(self.live)]
        self.live.remove(rid)
        if not self.r.withdraw(rid):  # past route_ttl_s: already dropped from flight, nothing to take back
            assert self.clock.t >= self.started[rid] + self.r.rconfig.route_ttl_s
            return
        if rid == self.latest[0]:
            _, node, added = self.latest
            for k in added:
                self.model[node].pop(k, None)
        assert not self.r.withdraw(rid)  # once only

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 10.0, COOLDOWN, 60.0]))
    def tick(self, dt: float) -> None:
        self.clock.t += dt

    @rule()
    def list_nodes(self) -> None:
        self._expire_model()
        exact = self.ax.evicted == 0
        for v in self.r.views():
            assert (v.l1_pages, v.l2_pages, v.connected) == (len(self._held(v.name)), 0, False)
            if exact:
                assert v.l1_pages == len(self.model[v.name])

    @rule()
    def scrape(self) -> None:
        self._expire_model()  # a scrape sweeps too
        list(self.registry.collect())  # the hook runs per collection; totals are added once
        ax = self.ax
        for reason, total in zip(APPROX_REASONS, (ax.expired, ax.evicted, ax.dropped, ax.withdrawn), strict=True):
            got = self.registry.get_sample_value("hicache_router_approx_forgotten_pages_total", {"reason": reason})
            assert got == total, (reason, got, total)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def predictions_agree(self) -> None:
        if not hasattr(self, "ax"):
            return
        ax = self.ax
        ax.check()
        held_all: set[bytes] = set()
        for n in NODES:
            held = self._held(n)
            held_all |= held
            assert len(held) == ax.pages(n)
            for k in held:
                p = self.parent[k]
                assert p is None or p in held, f"{n}: a predicted page whose parent is not predicted"
            modelled = set(self.model[n])  # both swept of pages past the TTL at the same points
            assert held <= modelled, f"{n}: predicts pages no live route sent there"
            if ax.evicted == 0:
                assert held == modelled, f"{n}: forgot pages within the TTL and the capacity"
            if self.r.nodes[n].breaker.state == "open":
                assert not held, f"{n}: predicts pages behind an open breaker"
        assert len(self.r.index) == len(held_all)
        held_total = sum(ax.pages(n) for n in NODES)
        assert self.inserted == held_total + ax.expired + ax.evicted + ax.dropped + ax.withdrawn


ApproxRouterMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestApproxRouter = ApproxRouterMachine.TestCase
