"""The router's state and decisions, without any transport: index + nodes + load + policies.

:class:`Router` is what the gRPC servicer, the node feeds and the benchmark drive::

    r = Router(hicache_config, router_config)       # namespace from hicache_config.model / .layout
    r.apply_event("gpu0", event)                      # each node's WatchEvents messages, in order
    d = r.route(token_bytes, tenant="acme")           # -> RouteDecision (node, prefix per tier, scores)
    r.complete(d.route_id, grpc.StatusCode.OK)        # the request finished on d.node

Page keys are computed with :mod:`hicache.keys` under ``Namespace(model, layout, revision, tp, tenant)``
exactly as the nodes do; a node whose own namespace digest differs (reported by the feed after
GetPoolInfo) is never routed to. Single-threaded: call it from one event loop.

With ``router.index: approximate`` no events come in: every route records the request's pages as held by
the chosen node (:class:`hicache.router.approx.ApproxIndex`), and the same scoring runs on that prediction.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import grpc

from hicache.client.types import Event
from hicache.config import HiCacheConfig
from hicache.keys import Namespace, page_keys_from_bytes
from hicache.router.approx import ApproxIndex
from hicache.router.breaker import CircuitBreaker
from hicache.router.config import NodeSpec, RouterConfig, check_approx_capacity
from hicache.router.index import NO_MATCH, Applied, KVIndex
from hicache.router.load import InflightTracker, QueueDepth
from hicache.router.scoring import Candidate, RoutingPolicy, Score, create_policy, policy_names
from hicache.service.validation import MAX_ID_BYTES, shown

if TYPE_CHECKING:
    from hicache.router.kv_events import EngineBlocks

log = logging.getLogger("hicache.router")
LISTED = 8  # items an error message lists, at most: gRPC sends it in a trailer that clients cap (8 KiB)


def _fingerprint(keys: Sequence[bytes], token_bytes: bytes, page_size: int, policy: str,
                 exclude: Sequence[str]) -> bytes:
    """What makes two Route calls the same request: tokens, policy and excluded nodes. The last page key
    already commits to every full page (keys are chained), so only it and the partial tail are hashed."""
    h = hashlib.blake2b(keys[-1] if keys else b"", digest_size=16)
    h.update(memoryview(token_bytes)[len(keys) * page_size * 4:])
    h.update(repr((len(token_bytes), policy, sorted(exclude))).encode())
    return h.digest()


def listed(items: Sequence[str]) -> str:
    """``items`` joined for an error message: the first :data:`LISTED`, then how many more there are."""
    more = f", ... ({len(items) - LISTED} more)" if len(items) > LISTED else ""
    return ", ".join(items[:LISTED]) + more


class NoNodeError(Exception):
    """No node can take the request (all excluded, breakers open or namespaces disagreeing)."""


NO_NODE = "no node can take the request"  # how a NoNodeError's message starts (clients tell it from a lost link)


class RequestIdConflict(Exception):
    """A Route named a request id that is in flight for another request."""


@dataclass
class NodeState:
    """What the router keeps per node besides the index: breaker, reported queue depth, feed status."""

    spec: NodeSpec
    breaker: CircuitBreaker
    queue: QueueDepth
    connected: bool = False  # event stream open and in sync
    namespace_ok: bool | None = None  # None until the node's namespace was checked
    routed: int = 0  # requests routed there (peeks not counted)
    last_error: str = ""  # the latest error reported for the node ("" before any)


class NodeView(NamedTuple):
    """One node as :meth:`Router.views` reports it (what ListNodes answers)."""

    name: str
    address: str
    connected: bool  # event stream in sync
    server_id: str  # the node's run id from its last snapshot ("" before any)
    event_sequence: int  # last event applied
    resyncs: int  # snapshots applied after the first
    l1_pages: int  # pages indexed on the node's L1
    l2_pages: int  # pages indexed on its L2
    in_flight: int  # requests routed there and not completed
    queue_depth: int  # the depth the node last reported (0 once stale)
    breaker: str  # closed | open | half_open
    routed: int
    namespace_ok: bool  # False only once the node's namespace was found to differ
    last_error: str


class ScoredNode(NamedTuple):
    """One node's standing in a :class:`RouteDecision`: its prefix of the request, load and score."""

    score: Score | None  # None when not eligible
    l1_pages: int
    l2_pages: int
    in_flight: int
    queue_depth: int
    why_not: str  # "" when eligible


class RouteDecision(NamedTuple):
    """Where :meth:`Router.route` sends a request, and why."""

    route_id: str  # "" when peek; pass it to Router.complete
    node: str
    address: str
    l1_pages: int  # prefix on the chosen node's L1
    l2_pages: int  # continued on its L2
    num_pages: int  # full pages of the request
    policy: str  # the policy that chose
    reason: str  # the policy's why: prefix | balance | hot_spot | round_robin | least_load (built-ins)
    scores: dict[str, ScoredNode]  # every node, configuration order
    replayed: bool = False  # the route already made for the request's id, returned again as it was decided


class Completion(NamedTuple):
    """What :meth:`Router.complete_call` made of a Complete."""

    node: str | None  # the route's node (None: unknown id, or one past twice its TTL)
    late: bool  # the route was past its TTL: its load had ended already, only the breaker heard of it
    repeat: bool  # the route was completed already (a retried Complete): nothing changed


class Router:
    """The router's state: the nodes, their page index, load and breakers; decides where requests go.

    Not thread-safe: call it from one event loop.
    """

    def __init__(self, config: HiCacheConfig, rconfig: RouterConfig) -> None:
        self.config = config
        self.rconfig = rconfig
        self.ns = config.namespace()
        self.page_size = self.ns.page_size
        self.index = KVIndex(self.page_size, rconfig.verify_keys)
        self.approx: ApproxIndex | None = None  # set with router.index: approximate
        # approximate: the latest route's id, node and the pages it newly predicted (what withdraw takes back)
        self._latest: tuple[str, str, list[bytes]] = ("", "", [])
        if rconfig.index == "approximate":
            check_approx_capacity(rconfig, self.page_size)
            self.approx = ApproxIndex(self.index, rconfig.approx_ttl_s,
                                      rconfig.approx_capacity_tokens // self.page_size)
        self.inflight = InflightTracker(rconfig.route_ttl_s)
        self.nodes: dict[str, NodeState] = {}
        for spec in rconfig.nodes:
            self.add_node(spec)
        self.policies: dict[str, RoutingPolicy] = {n: create_policy(n, rconfig.scoring) for n in policy_names()}
        self._tenants: dict[str, Namespace] = {}
        # engines followed through their KV events (router.kv_events) instead of a node's WatchEvents
        self.engines: dict[str, EngineBlocks] = {}
        if rconfig.kv_events:
            from hicache.router.kv_events import EngineBlocks  # msgpack: only when engines are followed

            self.engines = {name: EngineBlocks(self.index, name, self.ns.digest, self.page_size)
                            for name in rconfig.kv_events}

    def add_node(self, spec: NodeSpec) -> NodeState:
        """Start tracking a node (disconnected, breaker closed); ``ValueError`` when the name is taken."""
        if spec.name in self.nodes:
            raise ValueError(f"node {spec.name!r}: already known")
        rc = self.rconfig
        st = NodeState(spec, CircuitBreaker(rc.breaker_failures, rc.breaker_cooldown_s, rc.breaker_max_cooldown_s),
                       QueueDepth(stale_after_s=3 * rc.stats_interval_s + 1.0))
        self.nodes[spec.name] = st
        return st

    def namespace(self, tenant: str) -> Namespace:
        """The router's namespace (``tenant`` "") or that tenant's, as the nodes key its pages."""
        if not tenant:
            return self.ns
        ns = self._tenants.get(tenant)
        if ns is None:
            if len(self._tenants) > 4096:
                self._tenants.clear()
            ns = self._tenants[tenant] = self.ns.with_tenant(tenant)
        return ns

    # ------------------------------------------------------------------ feed side
    def apply_event(self, node: str, ev: Event) -> Applied:
        """One message of ``node``'s event stream; RESYNC means: reconnect for a fresh snapshot.
        ``RuntimeError`` with the approximate index, which must not mix predictions with reported state."""
        if self.approx is not None:
            raise RuntimeError("router.index is approximate: node events are not applied")
        st = self.nodes[node]
        res = self.index.apply(node, ev)
        feed = self.index.feed(node)
        st.connected = feed.synced
        if res is Applied.RESYNC:
            log.warning("node %s: event stream out of sequence (server %s, last %d, got %s %d): resync",
                        node, feed.server_id, feed.sequence, ev.kind, ev.sequence)
        return res

    def disconnected(self, node: str, error: str = "") -> None:
        """The node's event stream ended: forget its pages until the next snapshot."""
        st = self.nodes[node]
        st.connected = False
        if error:
            st.last_error = error
        self.index.drop(node)

    def set_namespace_digest(self, node: str, digest: bytes, describe: str = "") -> bool:
        """Record the node's default namespace digest; False (and never routed to) when it is not ours."""
        st = self.nodes[node]
        ok = digest == self.ns.digest
        if not ok and st.namespace_ok is not False:
            st.last_error = (f"namespace mismatch: node serves {describe or digest.hex()[:16]}, router expects "
                             f"{self.describe_namespace()}")
            log.error("node %s: %s", node, st.last_error)
        st.namespace_ok = ok
        return ok

    def describe_namespace(self) -> str:
        """The router's namespace in words (model, revision, layout, TP, tenant), for logs and ListNodes."""
        ns = self.ns
        return (f"model={ns.model} revision={ns.revision} layout={ns.layout.describe()} "
                f"tp={ns.tp_rank}/{ns.tp_size} tenant={ns.tenant!r}")

    def report_queue(self, node: str, depth: int) -> None:
        """Record the queue depth ``node`` reported (trusted until it goes stale); ``KeyError``: unknown."""
        self.nodes[node].queue.report(depth)

    def record(self, node: str, code: grpc.StatusCode, error: str = "") -> None:
        """Outcome of a call on ``node`` (router's own or a client's): feeds its breaker."""
        st = self.nodes[node]
        trips = st.breaker.trips
        st.breaker.record(code)
        if error:
            st.last_error = error
        self._forget_if_opened(node, trips)

    def _forget_if_opened(self, node: str, trips: int) -> None:
        """Approximate index: a node whose breaker opened (or reopened from half-open) since it had tripped
        ``trips`` times may come back empty; stop predicting its pages. Told by the trip count, not by the
        state: a cooldown shorter than the time since the trip already reads half-open."""
        if self.approx is not None and self.nodes[node].breaker.trips != trips:
            self.approx.drop(node)

    # ------------------------------------------------------------------ decisions
    def route(self, token_bytes: bytes, tenant: str = "", policy: str = "", exclude: Sequence[str] = (),
              peek: bool = False, request_id: str = "") -> RouteDecision:
        """Choose a node for the request (uint32 LE ``token_bytes``); counts it in flight unless ``peek``.

        ``request_id`` (not with ``peek``): the client's name for the request, unique per tenant among its
        routes in flight. While the route made under it is in flight, a repeat of the same request (tokens,
        policy, excluded nodes) returns that decision again, ``replayed`` and counting nothing: a client
        whose reply was lost retries without a second route staying in flight until the TTL. The same id
        with another request raises :class:`RequestIdConflict`; after Complete, withdrawal or the TTL the
        id routes anew.

        ``ValueError`` for an unknown policy or node name, or an id over ``MAX_ID_BYTES``;
        :class:`NoNodeError` when nothing is eligible. Their messages quote at most a few names, each cut
        short (:func:`listed`, ``shown``): a client's strings, or a long node list, echoed whole would make
        the refusal too long for the client to read.
        """
        self.inflight.expire()  # a route past its TTL no longer counts, nor answers to its request's id
        key: tuple[str, str] | None = None
        keys: list[bytes] | None = None
        if request_id and not peek:
            if len(request_id.encode()) > MAX_ID_BYTES:
                raise ValueError(f"request_id: longer than {MAX_ID_BYTES} bytes")
            key = (tenant, request_id)
            seen = self.inflight.named(key)
            if seen is not None:
                _, (mark, decision) = seen
                keys = page_keys_from_bytes(self.namespace(tenant).digest, token_bytes, self.page_size)
                if mark != _fingerprint(keys, token_bytes, self.page_size, policy, exclude):
                    raise RequestIdConflict(f"request_id {shown(request_id)} is in flight for another request "
                                            "(other tokens, policy or excluded nodes); Complete its route first")
                return decision._replace(replayed=True)  # type: ignore[no-any-return]
        pol = self.policies.get(policy or self.rconfig.policy)
        if pol is None:
            raise ValueError(f"policy: unknown {shown(policy)}; known: {policy_names()}")
        unknown = list(dict.fromkeys(n for n in exclude if n not in self.nodes))
        if unknown:
            names = [shown(n) for n in unknown[:LISTED]] + unknown[LISTED:]  # listed() shows the first few only
            raise ValueError(f"exclude_nodes: unknown node(s) {listed(names)}; known: {listed(list(self.nodes))}")
        if self.approx is not None:
            self.approx.expire()
        ns = self.namespace(tenant)
        keys = page_keys_from_bytes(ns.digest, token_bytes, self.page_size)
        matches = self.index.match(keys)
        if tenant and self.engines:  # an engine's prefix cache has no tenants: match it with the base keys
            base = self.index.match(page_keys_from_bytes(self.ns.digest, token_bytes, self.page_size))
            for name in self.engines:
                matches[name] = base.get(name, NO_MATCH)
        cands: list[Candidate] = []
        scored: dict[str, ScoredNode] = {}
        skip = set(exclude)
        for name, st in self.nodes.items():
            m = matches.get(name, NO_MATCH)
            c = Candidate(name, m.l1_pages, m.l2_pages, self.inflight.count(name), st.queue.value)
            why = ("excluded" if name in skip else "namespace mismatch" if st.namespace_ok is False
                   else "breaker open" if not st.breaker.allow() else "")
            scored[name] = ScoredNode(None, c.l1_pages, c.l2_pages, c.in_flight, c.queue_depth, why)
            if not why:
                cands.append(c)
        if not cands:
            raise NoNodeError(f"{NO_NODE}: " + (listed(
                [f"{n}: {s.why_not}" for n, s in scored.items()]) if scored else "no nodes configured"))
        d = pol.choose(cands, len(keys))
        for c, s in zip(cands, d.scores, strict=True):
            scored[c.node] = scored[c.node]._replace(score=s)
        chosen = cands[d.chosen]
        st = self.nodes[chosen.node]
        rid = ""
        if not peek:
            rid = self.inflight.start(chosen.node)
            st.routed += 1
            if self.approx is not None:
                self._latest = (rid, chosen.node, self.approx.record(chosen.node, keys))
        decision = RouteDecision(rid, chosen.node, st.spec.address, chosen.l1_pages, chosen.l2_pages, len(keys),
                                 pol.name, d.reason, scored)
        if key is not None:
            self.inflight.name(rid, key, (_fingerprint(keys, token_bytes, self.page_size, policy, exclude), decision))
        return decision

    def complete(self, route_id: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> str | None:
        """The routed request finished with ``code`` on its node; returns the node (None: unknown id, or
        one past twice its TTL). A route past its TTL no longer counts in flight, but its completion, up to
        another TTL later, still tells the node's breaker how the call went (a slow call that failed)."""
        return self.complete_call(route_id, code).node

    def complete_route(self, route_id: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> tuple[str | None, bool]:
        """:meth:`complete`, and whether the route was past its TTL (late: its load had ended already)."""
        c = self.complete_call(route_id, code)
        return c.node, c.late

    def complete_call(self, route_id: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> Completion:
        """:meth:`complete` as a :class:`Completion`. A repeat of a completion taken less than a TTL ago (a
        client retrying after the reply was lost) names the node again and changes nothing: the breaker
        heard the call once."""
        self.inflight.expire()  # a route past its TTL is gone, whether or not a Route call swept it yet
        r = self.inflight.finish(route_id)
        late = r is None
        if r is None:
            r = self.inflight.finish_late(route_id)
            if r is None:
                done = self.inflight.finished(route_id)
                return Completion(done.node if done is not None else None, False, done is not None)
        breaker = self.nodes[r.node].breaker
        trips = breaker.trips
        breaker.record(code, started=r.started)
        self._forget_if_opened(r.node, trips)
        return Completion(r.node, late, False)

    def withdraw(self, route_id: str) -> bool:
        """Take back a route whose answer never reached its client (decided after the call's deadline): it
        stops counting in flight and as routed to its node, and no breaker hears of it. With the approximate
        index, the pages it newly predicted are forgotten when it is the latest route (withdraw right after
        deciding); an earlier route's stay predicted. False: unknown id."""
        r = self.inflight.finish(route_id, remember=False)
        if r is None:
            return False
        self.nodes[r.node].routed -= 1
        rid, node, new = self._latest
        if rid == route_id and self.approx is not None:
            self._latest = ("", "", [])
            self.approx.forget(node, new)
        return True

    # ------------------------------------------------------------------ views
    def views(self) -> list[NodeView]:
        """Every node's state, in the order the nodes were added (configuration order); predictions past
        their TTL are forgotten first, so an idle router does not report them."""
        if self.approx is not None:
            self.approx.expire()
        out = []
        for name, st in self.nodes.items():
            feed = self.index.feed(name)
            l1, l2 = self.index.tier_pages(name)
            out.append(NodeView(name, st.spec.address, st.connected, feed.server_id, feed.sequence,
                                max(0, feed.snapshots - 1), l1, l2, self.inflight.count(name), st.queue.value,
                                st.breaker.state, st.routed, st.namespace_ok is not False, st.last_error))
        return out

    def routable(self) -> bool:
        """Whether some node could take a request now (the health check): its breaker allows it and its
        namespace is not known to differ, whether or not its event stream is in sync."""
        return any(st.namespace_ok is not False and st.breaker.allow() for st in self.nodes.values())
