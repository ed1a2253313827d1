"""``hicache.v1.Router`` over grpc.aio: the servicer, the server, and its Prometheus metrics.

``RouterServer(config, rconfig).start()`` builds a :class:`~hicache.router.core.Router`, one
:class:`~hicache.router.node_feed.NodeFeed` per node, and a gRPC server with the Router service, the standard
health service (``""``: SERVING while up; ``hicache.v1.Router``: SERVING while at least one node is
routable) and reflection; optional bearer tokens (every call but health's, checked before its request is read:
:class:`~hicache.service.auth.AuthInterceptor`), TLS/mTLS and ``/metrics`` (on ``router.metrics_host``,
loopback by default, behind ``router.metrics_token`` when set, over HTTPS with the router's certificate with
``router.metrics_tls``).

Tenants: with ``router.auth_tokens_file`` (the node's tokens-file format, :func:`~hicache.service.auth.
load_tokens_file`) each token routes only for its tenants: a Route naming another tenant (``namespace.tenant``;
the router's ``model.tenant`` when empty) ends with PERMISSION_DENIED before anything is scored or counted.
Route ids are then per token: the id a Route returns carries a tag only the router can make for that token
(an HMAC under a key drawn at start), and a Complete of an id without the caller's tag is answered as an
unknown id (``known`` false), changing nothing; a Route's ``request_id`` is the caller's token's too (one
token's retry never replays another's route). ListNodes is router-wide (node loads and index sizes, no
tenant's data): any token. ``router.auth_token`` alone is one token for every tenant. Everything runs on one event
loop, so the index, loads and breakers need no locks; a scrape of ``/metrics`` (served from its own threads)
does its bookkeeping on that loop too (:class:`RouterMetrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import signal
import threading
import time
from typing import Any, TypeAlias

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hicache.config import HiCacheConfig
from hicache.metrics import ScrapeHook
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.breaker import status_from_number
from hicache.router.config import RouterConfig
from hicache.router.core import MAX_ID_BYTES, NoNodeError, RequestIdConflict, RouteDecision, Router
from hicache.router.kv_event_feed import EngineFeed
from hicache.router.node_feed import NodeFeed
from hicache.service.auth import Authenticator, AuthInterceptor, Principal, caller, server_credentials
from hicache.service.decode import DecodeGuard
from hicache.service.metrics_http import RPC_BUCKETS, MetricsServer
from hicache.service.validation import NamespaceResolver, ServiceError, shown, token_bytes

log = logging.getLogger("hicache.router")
SYNC_WAIT_S = 1.0  # a scrape waits this long at most for its bookkeeping on the router's event loop
SERVICE_NAME = rpb.DESCRIPTOR.services_by_name["Router"].full_name
Ctx: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
APPROX_REASONS = ("ttl", "capacity", "node_down", "withdrawn")  # why predicted pages are forgotten (the label)


class RouterMetrics:
    """The router's Prometheus metrics. At each scrape (before the registry reads them) routes past their TTL
    are expired -- an idle router must not report them in flight -- and the counters kept as running totals
    (expired routes, resyncs) are brought up to date. That bookkeeping touches the router's state, so it runs
    on the router's event loop once :meth:`attach` named it (the scrape's thread waits for it, at most
    :data:`SYNC_WAIT_S`); this also keeps two scrapes at once from adding one total twice."""

    def __init__(self, router: Router, registry: CollectorRegistry) -> None:
        r = registry
        self._router = router
        self._loop: asyncio.AbstractEventLoop | None = None
        self._seen: dict[str, int] = {}  # running totals already added to the counters, by key
        self._seen_lock = threading.Lock()  # scrapes without a loop attached may run at once
        r.register(ScrapeHook(self._sync))  # type: ignore[arg-type]  # counters up to the running totals
        self.routes = Counter("hicache_router_routes", "Requests routed, by node and reason", ["node", "reason"],
                              registry=r)
        self.route_seconds = Histogram("hicache_router_route_seconds", "Route decision time", registry=r,
                                       buckets=RPC_BUCKETS)
        self.request_pages = Counter("hicache_router_request_pages", "Full pages of routed requests", registry=r)
        self.prefix_pages = Counter("hicache_router_prefix_pages", "Pages of routed requests the chosen node "
                                    "held, by tier", ["tier"], registry=r)
        self.completed = Counter("hicache_router_completed", "Complete calls, by the status code reported for the "
                                 "routed request (a repeat of one already taken not counted again)", ["code"],
                                 registry=r)
        self.index_keys = Gauge("hicache_router_index_keys", "Distinct page keys in the index", registry=r)
        self.index_keys.set_function(lambda: len(router.index))
        self.inflight = Gauge("hicache_router_inflight", "Routes not completed yet", registry=r)
        self.inflight.set_function(lambda: len(router.inflight))
        self.unanswered = Counter("hicache_router_routes_unanswered", "Routes decided after the call's "
                                  "deadline: refused with DEADLINE_EXCEEDED, not counted in flight",
                                  registry=r)
        self.replayed = Counter("hicache_router_routes_replayed", "Route calls answered with the route already "
                                "made for their request_id (a retry after a lost reply): nothing counted again",
                                registry=r)
        self.expired = Counter("hicache_router_routes_expired", "Routes dropped at the TTL (never completed)",
                               registry=r)
        self.node_up = Gauge("hicache_router_node_connected", "Event stream in sync, by node", ["node"], registry=r)
        self.breaker_open = Gauge("hicache_router_breaker_open", "Breaker not closed (open, or half-open on "
                                  "probation), by node", ["node"], registry=r)
        self.resyncs = Counter("hicache_router_resyncs", "Snapshots applied after the first, by node", ["node"],
                               registry=r)
        self.approx_forgotten = Counter("hicache_router_approx_forgotten_pages", "Approximate index: predicted "
                                        "pages forgotten, by why (ttl, capacity, node_down, withdrawn)",
                                        ["reason"], registry=r)
        if router.approx is not None:  # every reason's series from the start, so the first increase() counts
            for reason in APPROX_REASONS:
                self.approx_forgotten.labels(reason)
        self.engine_batches = Counter("hicache_router_engine_batches", "Engines followed through their KV events "
                                      "(router.kv_events): event batches applied, by node", ["node"], registry=r)
        self.engine_refused = Counter("hicache_router_engine_blocks_refused", "Engine KV events: blocks not "
                                      "indexed, by node and why (block_size, lora, orphan: parent unknown, "
                                      "malformed)", ["node", "reason"], registry=r)
        self.engine_gaps = Counter("hicache_router_engine_gaps", "Engine KV events: sequence gaps, by node and "
                                   "outcome (replayed, lost)", ["node", "outcome"], registry=r)
        self.engine_restarts = Counter("hicache_router_engine_restarts", "Engine KV events: sequence went back "
                                       "(an engine restart), its blocks forgotten, by node", ["node"], registry=r)
        for name, eb in router.engines.items():
            self.engine_batches.labels(name)
            self.engine_restarts.labels(name)
            for reason in eb.refused:
                self.engine_refused.labels(name, reason)
            for outcome in eb.gaps:
                self.engine_gaps.labels(name, outcome)
        for name in router.nodes:
            self._per_node(router, name)

    def _per_node(self, router: Router, name: str) -> None:
        st = router.nodes[name]
        if router.approx is None:  # no event streams with the approximate index: no series to alert on
            self.node_up.labels(name).set_function(lambda: float(st.connected))
        self.breaker_open.labels(name).set_function(lambda: float(st.breaker.state != "closed"))

    def _add(self, key: str, total: int, counter: Any) -> None:
        """Increase ``counter`` by what ``total`` (a running total) gained since the last scrape."""
        seen = self._seen.get(key, 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[key] = total

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Do each scrape's bookkeeping on ``loop``, the one the router runs on."""
        self._loop = loop

    def _sync(self) -> None:
        """The scrape hook (any thread): :meth:`_update` on the router's loop, or here when none is attached."""
        loop = self._loop
        if loop is None or _running_loop() is loop:
            self._update()
            return
        done = threading.Event()

        def update() -> None:
            try:
                self._update()
            finally:
                done.set()

        try:
            loop.call_soon_threadsafe(update)
        except RuntimeError:  # the loop is closed: the router is gone, the last figures stand
            return
        if not done.wait(SYNC_WAIT_S):
            log.warning("metrics: the router's event loop did not answer within %.1f s; scraped as it was",
                        SYNC_WAIT_S)

    def _update(self) -> None:
        router = self._router
        with self._seen_lock:
            router.inflight.expire()
            self._add("expired", router.inflight.expired, self.expired)
            ax = router.approx
            if ax is not None:
                ax.expire()
                totals = (ax.expired, ax.evicted, ax.dropped, ax.withdrawn)
                for reason, total in zip(APPROX_REASONS, totals, strict=True):
                    self._add(f"approx/{reason}", total, self.approx_forgotten.labels(reason))
            for name in router.nodes:
                self._add(f"resyncs/{name}", max(0, router.index.feed(name).snapshots - 1),
                          self.resyncs.labels(name))
            for name, eb in router.engines.items():
                self._add(f"engine/{name}", eb.batches, self.engine_batches.labels(name))
                self._add(f"engine-restarts/{name}", eb.restarts, self.engine_restarts.labels(name))
                for reason, n in eb.refused.items():
                    self._add(f"engine-refused/{name}/{reason}", n, self.engine_refused.labels(name, reason))
                for outcome, n in eb.gaps.items():
                    self._add(f"engine-gaps/{name}/{outcome}", n, self.engine_gaps.labels(name, outcome))


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def decision_pb(d: RouteDecision, page_size: int) -> rpb.RouteResponse:
    scores = []
    for name, s in d.scores.items():
        sc = s.score
        scores.append(rpb.NodeScore(
            node=name, l1_pages=s.l1_pages, l2_pages=s.l2_pages, in_flight=s.in_flight, queue_depth=s.queue_depth,
            prefix_score=sc.prefix_score if sc else 0.0, load=sc.load if sc else float(max(s.in_flight,
                                                                                           s.queue_depth)),
            cost=sc.cost if sc else 0.0, eligible=sc is not None, why_not=s.why_not))
    return rpb.RouteResponse(route_id=d.route_id, node=d.node, address=d.address, l1_pages=d.l1_pages,
                             l2_pages=d.l2_pages, num_pages=d.num_pages, page_size=page_size, policy=d.policy,
                             reason=d.reason, scores=scores, replayed=d.replayed)


ROUTE_TAG_CHARS = 16  # hex characters of a route id's tag (tokens file only): 64 bits of an HMAC-SHA256


class RouterServicer(rpb_grpc.RouterServicer):
    def __init__(self, router: Router, metrics: RouterMetrics, auth: Authenticator | None = None) -> None:
        self.router = router
        self.metrics = metrics
        self.resolver = NamespaceResolver(router.ns)
        # who calls: None when every caller is EVERYONE (auth off, or router.auth_token alone)
        self.auth = auth if auth is not None and auth.scoped else None
        self._tag_key = secrets.token_bytes(32)

    def _who(self, context: Ctx) -> Principal:
        return caller(self.auth, context.invocation_metadata())

    def _tag(self, who: Principal, route_id: str) -> str:
        mac = hmac.new(self._tag_key, f"{who.scope}\0{route_id}".encode(), hashlib.sha256)
        return mac.hexdigest()[:ROUTE_TAG_CHARS]

    def _request_id(self, who: Principal, request_id: str) -> str:
        """The router's name for a client's ``request_id``: per token with a tokens file (as the node's
        request ids), so one token never replays, nor completes, a route another token named."""
        if self.auth is None or not request_id:
            return request_id
        if len(request_id.encode()) > MAX_ID_BYTES:  # the client's id is what the limit is about
            raise ValueError(f"request_id: longer than {MAX_ID_BYTES} bytes")
        return hashlib.sha256(f"{who.scope}\0{request_id}".encode()).hexdigest()  # within MAX_ID_BYTES

    def _own_route(self, who: Principal, route_id: str) -> str | None:
        """The router's id of ``route_id`` as a Route returned it to ``who`` (tokens file: tagged for that
        token), or None when it is no such id."""
        if self.auth is None:
            return route_id
        rid, sep, tag = route_id.rpartition(".")
        if not sep or not hmac.compare_digest(tag.encode(), self._tag(who, rid).encode()):
            return None
        return rid

    async def Route(self, request: rpb.RouteRequest, context: Ctx) -> rpb.RouteResponse:
        t0 = time.perf_counter()
        r = self.router
        who = self._who(context)
        try:
            tb = token_bytes(request.tokens, request.token_ids, r.rconfig.max_request_tokens)
            ref = request.namespace
            ns = self.resolver.resolve(ref.tenant, ref.model, ref.revision, ref.layout)
            if not who.may_act_for(ns.tenant):
                raise ServiceError(grpc.StatusCode.PERMISSION_DENIED, f"namespace.tenant {shown(ns.tenant)}: "
                                   "this token may not route for that tenant")
            left = context.time_remaining()
            if left is not None and left <= 0:  # no one waits for the answer: route nothing, count nothing
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before routing")
            d = r.route(tb, ns.tenant, request.policy, list(request.exclude_nodes), request.peek,
                        self._request_id(who, request.request_id))
        except ServiceError as e:
            await context.abort(e.code, e.message)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestIdConflict as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e).replace(
                shown(self._request_id(who, request.request_id)), shown(request.request_id)))
        except NoNodeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        m = self.metrics
        m.route_seconds.observe(time.perf_counter() - t0)
        if d.replayed:  # a retry of a route already made and counted: it stays in flight for its Complete
            m.replayed.inc()
            return self._reply(who, d)
        if d.route_id:
            left = context.time_remaining()
            # Decided after the client's deadline: the client has given up and never learns the route id, so
            # the route must not count in flight until route_ttl_s. (A reply lost in transit, or a call the
            # client cancels while it is decided, still does: the server is not told of either.)
            if left is not None and left <= 0:
                if r.withdraw(d.route_id):
                    m.unanswered.inc()
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed while routing")
        if not request.peek:
            m.routes.labels(d.node, d.reason).inc()
            m.request_pages.inc(d.num_pages)
            m.prefix_pages.labels("l1").inc(d.l1_pages)
            m.prefix_pages.labels("l2").inc(d.l2_pages)
        return self._reply(who, d)

    def _reply(self, who: Principal, d: RouteDecision) -> rpb.RouteResponse:
        resp = decision_pb(d, self.router.page_size)
        if self.auth is not None and d.route_id:
            resp.route_id = f"{d.route_id}.{self._tag(who, d.route_id)}"
        return resp

    async def Complete(self, request: rpb.CompleteRequest, context: Ctx) -> rpb.CompleteResponse:
        code = status_from_number(request.status_code)
        rid = self._own_route(self._who(context), request.route_id)
        if rid is None:  # not a route this token made: as an unknown id, nothing changes
            return rpb.CompleteResponse()
        c = self.router.complete_call(rid, code)
        if not c.repeat:
            self.metrics.completed.labels(code.name).inc()
        return rpb.CompleteResponse(known=c.node is not None, node=c.node or "", late=c.late, repeated=c.repeat)

    async def ListNodes(self, request: rpb.ListNodesRequest, context: Ctx) -> rpb.ListNodesResponse:
        r = self.router
        r.inflight.expire()
        nodes = [rpb.NodeInfo(name=v.name, address=v.address, connected=v.connected, server_id=v.server_id,
                              event_sequence=v.event_sequence, resyncs=v.resyncs, l1_pages=v.l1_pages,
                              l2_pages=v.l2_pages, in_flight=v.in_flight, queue_depth=v.queue_depth,
                              breaker=v.breaker, routed=v.routed, namespace_ok=v.namespace_ok,
                              last_error=v.last_error) for v in r.views()]
        return rpb.ListNodesResponse(nodes=nodes, namespace=r.describe_namespace(), index=r.rconfig.index)


class RouterServer:
    def __init__(self, config: HiCacheConfig, rconfig: RouterConfig) -> None:
        if not rconfig.nodes:
            raise ValueError("router.nodes: at least one node (NAME=host:port) is needed")
        self.config = config
        self.rconfig = rconfig
        self.router = Router(config, rconfig)
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.router, self.registry)
        # the approximate index opens no stream and polls nothing: the nodes need not be hicache nodes
        self.feeds: list[NodeFeed | EngineFeed] = []
        if self.router.approx is None:
            for spec in rconfig.nodes:
                endpoint = rconfig.kv_events.get(spec.name)
                self.feeds.append(NodeFeed(self.router, spec) if endpoint is None else EngineFeed(
                    self.router, spec, endpoint, rconfig.kv_events_replay.get(spec.name, ""), rconfig.kv_events_topic))
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: MetricsServer | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._stopped = False

    async def start(self) -> None:
        rc = self.rconfig
        self.metrics.attach(asyncio.get_running_loop())
        # authentication first: a call without the token is refused before anything reads its request
        interceptors: list[grpc.aio.ServerInterceptor] = []
        auth = Authenticator.for_serve(rc.auth_token, rc.auth_tokens_file, "router")
        if auth is not None:
            interceptors.append(AuthInterceptor(auth))
        interceptors.append(DecodeGuard())
        # a Route of max_request_tokens token ids must fit (int64 ids: up to ~10 bytes each on the wire)
        max_msg = max(4 << 20, 10 * rc.max_request_tokens + (64 << 10))
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_msg)])
        rpb_grpc.add_RouterServicer_to_server(RouterServicer(self.router, self.metrics, auth), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
            self.server)
        addr = f"{rc.host}:{rc.port}"
        if rc.tls_cert:
            self.port = self.server.add_secure_port(addr, server_credentials(rc.tls_cert, rc.tls_key,
                                                                             rc.tls_client_ca))
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"route: cannot bind {addr}")
        if rc.metrics_port:
            self._metrics_http = MetricsServer(self.registry, rc.metrics_host, rc.metrics_port, token=rc.metrics_token,
                                               certfile=rc.tls_cert if rc.metrics_tls else "",
                                               keyfile=rc.tls_key if rc.metrics_tls else "")
            self.metrics_port = self._metrics_http.port
        for f in self.feeds:
            f.start()
        await self.server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self._health_task = asyncio.create_task(self._health_loop())
        log.info("hicache route: %d nodes, policy %s, %s index, namespace %s", len(rc.nodes), rc.policy, rc.index,
                 self.router.describe_namespace())

    @property
    def metrics_url(self) -> str:
        """Where ``/metrics`` is served ("": nowhere)."""
        return self._metrics_http.url if self._metrics_http is not None else ""

    async def _health_loop(self) -> None:
        last: bool | None = None
        while True:
            ok = self.router.routable()
            if ok != last:
                await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING if ok
                                      else health_pb2.HealthCheckResponse.NOT_SERVING)
                last = ok
            await asyncio.sleep(0.5)

    async def wait_synced(self, timeout_s: float = 10.0) -> None:
        """Wait until every node's event stream is in sync (tests, scripted starts); at once with the
        approximate index, which follows no stream."""
        if self.router.approx is not None:
            return
        end = time.monotonic() + timeout_s
        while not all(st.connected for st in self.router.nodes.values()):
            if time.monotonic() > end:
                raise TimeoutError("nodes not in sync: " + ", ".join(
                    f"{v.name} ({v.last_error or 'connecting'})" for v in self.router.views() if not v.connected))
            await asyncio.sleep(0.02)

    async def stop(self, grace_s: float | None = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.server.stop(self.rconfig.shutdown_grace_s if grace_s is None else grace_s)
        for f in self.feeds:
            await f.close()
        if self._metrics_http is not None:
            self._metrics_http.close()


async def serve_until_signal(config: HiCacheConfig, rconfig: RouterConfig, announce: bool = True) -> None:
    server = RouterServer(config, rconfig)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        extra = f" metrics {server.metrics_url}" if server.metrics_url else ""
        print(f"hicache route: listening on {rconfig.host}:{server.port}{extra}", flush=True)
    await stop.wait()
    await server.stop()


def run(config: HiCacheConfig, rconfig: RouterConfig) -> int:
    import uvloop

    uvloop.run(serve_until_signal(config, rconfig))
    return 0

