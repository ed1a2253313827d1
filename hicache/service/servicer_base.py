"""What every handler of ``hicache.v1.HiCache`` shares: :class:`ServicerBase`, the node's state and plumbing.

The handlers themselves are mixins of this base (:mod:`.request_rpcs`, :mod:`.node_rpcs`,
:mod:`.page_rpcs`), composed into :class:`hicache.service.servicer.HiCacheServicer`. The base holds:

* admission (``_admit`` / ``_done``, what :mod:`.rpc`'s ``@unary`` / ``@streaming`` call): every RPC but
  those of ``UNBOUNDED`` counts in ``inflight`` against ``serve.max_concurrency`` and is timed into
  ``hicache_rpc_seconds`` and counted by status code into ``hicache_rpcs_total``;
* the caller (``_who``): a :class:`~hicache.service.auth.Principal`, :data:`~hicache.service.auth.EVERYONE`
  unless ``serve.auth_tokens_file`` scopes tokens; the namespace a call names, refused with
  PERMISSION_DENIED for a tenant the token may not act for (``_ns``);
* one :class:`~hicache.service.requests.RequestTable` per token scope (``_table``): request ids are per
  token, and :attr:`ServicerBase.table` is EVERYONE's;
* idle expiry (:meth:`ServicerBase.expire_idle`) and shutdown (:meth:`ServicerBase.release_all`), and the
  background tasks (releases running on their own) that shutdown waits for.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from hicache.cache import HiCache, LoadResult, Request
from hicache.config import ServeConfig
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.auth import EVERYONE, Authenticator, Principal, caller
from hicache.service.events import EventHub
from hicache.service.metrics_http import ServiceMetrics
from hicache.service.requests import DEFAULT_REQUEST_TTL_S, Entry, RequestTable
from hicache.service.rpc import ALWAYS_ADMITTED, UNBOUNDED, Ctx
from hicache.service.shared_pool import SharedPool
from hicache.service.validation import NamespaceResolver, ServiceError, shown

DEADLINE_MARGIN_S = 0.02
T = TypeVar("T")


async def blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` on a worker thread. If the RPC is cancelled meanwhile (deadline, client gone), wait
    for ``fn`` to finish before letting the cancellation through: cache bookkeeping never keeps running
    after the handler has let go of the request's lock."""
    fut = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
            break
        except asyncio.CancelledError:
            if fut.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


def within_deadline(wait: float | None, context: Ctx) -> float | None:
    """``wait`` seconds (None: no bound) cut to what the call's deadline leaves, less a margin to reply. A
    bound longer than any thread can wait (``threading.TIMEOUT_MAX``, ~292 years; e.g. Flush's
    ``timeout_s=1e300``) is no bound."""
    if wait is not None and wait >= threading.TIMEOUT_MAX:
        wait = None
    left = context.time_remaining()
    if left is not None and left >= threading.TIMEOUT_MAX:  # a client's deadline centuries away
        left = None
    if left is None:
        return wait
    left = max(0.0, left - DEADLINE_MARGIN_S)
    return left if wait is None else min(wait, left)


def open_request(entry: Entry, request_id: str) -> Request:
    """The entry's request, taken under ``entry.lock``: NOT_FOUND when a Release (or expiry) won the race
    since the entry was looked up."""
    req = entry.request
    assert req is not None
    if req.released:
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request_id {request_id!r}: released")
    return req


def denied(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED, message)


class ServicerBase(pb_grpc.HiCacheServicer):
    def __init__(self, cache: HiCache, serve: ServeConfig, metrics: ServiceMetrics, hub: EventHub,
                 shared: SharedPool | None, request_ttl_s: float = DEFAULT_REQUEST_TTL_S,
                 auth: Authenticator | None = None) -> None:
        self.cache = cache
        self.serve = serve
        self.metrics = metrics
        self.hub = hub
        self.shared = shared
        self.resolver = NamespaceResolver(cache.ns)
        # who calls: None when every caller is EVERYONE (auth off, or serve.auth_token alone)
        self.auth = auth if auth is not None and auth.scoped else None
        self.request_ttl_s = request_ttl_s
        self.table = RequestTable(request_ttl_s)  # the requests of EVERYONE (all of them without a tokens file)
        self._tables: dict[str, RequestTable] = {"": self.table}  # by Principal.scope
        self._pin_tenants: dict[int, str] = {}  # pin id -> the tenant it was made for (Pin)
        # releases running on their own: of requests whose Match reply was lost (_orphaned), and those of
        # Releases waiting for the Match that opens their id (Release)
        self._background: set[asyncio.Task[Any]] = set()
        self.page_size = cache.page_size
        self.num_pages = cache.device_pool.num_pages
        self.max_tokens = serve.max_request_tokens
        self.max_pages = max(1, self.max_tokens // self.page_size)
        self.inflight = 0
        self._hist = {m: metrics.rpc_seconds.labels(m) for m in pb.DESCRIPTOR.services_by_name["HiCache"]
                      .methods_by_name}
        self._counts: dict[tuple[str, str], Any] = {}
        metrics.rpc_inflight.set_function(lambda: self.inflight)
        metrics.open_requests.set_function(lambda: self.open_requests)
        metrics.event_subscribers.set_function(lambda: hub.subscribers)
        metrics.event_queue.set_function(lambda: hub.queued)
        metrics.event_sequence.set_function(lambda: hub.sequence)

    def _admit(self, name: str) -> bool:
        """Whether a call of ``name`` may start (see :mod:`.rpc`); counts it in ``inflight`` if bounded."""
        if name in UNBOUNDED:
            return True
        if name not in ALWAYS_ADMITTED and self.inflight >= self.serve.max_concurrency:
            self.metrics.rpc_rejected.inc()
            return False
        self.inflight += 1
        return True

    def _done(self, name: str, code: str, t0: float) -> None:
        if name not in UNBOUNDED:
            self.inflight -= 1
        self._hist[name].observe(time.perf_counter() - t0)
        c = self._counts.get((name, code))
        if c is None:
            c = self._counts[(name, code)] = self.metrics.rpc_total.labels(name, code)
        c.inc()

    @property
    def open_requests(self) -> int:
        return sum(len(t) for t in self._tables.values())

    def _who(self, context: Ctx) -> Principal:
        """The caller (see the module docstring)."""
        return caller(self.auth, context.invocation_metadata())

    def _table(self, who: Principal) -> RequestTable:
        """The table of the caller's requests: ids are per token."""
        t = self._tables.get(who.scope)
        if t is None:
            t = self._tables[who.scope] = RequestTable(self.request_ttl_s)
        return t

    def _ns(self, ref: pb.NamespaceRef, who: Principal = EVERYONE) -> Any:
        ns = self.resolver.resolve(ref.tenant, ref.model, ref.revision, ref.layout)
        if not who.may_act_for(ns.tenant):
            raise denied(f"namespace.tenant {shown(ns.tenant)}: this token may not act for that tenant")
        return ns

    def _load(self, req: Request) -> LoadResult:
        load = self.cache.load_back(req, layer_wise=False)  # the reply comes once every layer is on L1
        self.cache.count_match(req)  # a Match that loads counts once its load is under way (not when refused)
        load.wait()
        return load

    async def expire_idle(self) -> int:
        """Release requests idle past the TTL (a client that went away); returns how many."""
        old = [e for t in self._tables.values() for e in t.expired()]
        if old:
            # The entries have left the table: their releases run to the end even if this caller (the
            # expiry loop, cancelled at shutdown) is cancelled, and release_all waits for them.
            await asyncio.shield(self._in_background(self._release_expired(old)))
        return len(old)

    async def _release_expired(self, entries: list[Entry]) -> None:
        for e in entries:
            assert e.request is not None
            await blocking(self.cache.release, e.request)
        self.metrics.expired_requests.inc(len(entries))

    async def release_all(self, wait_s: float | None = None) -> int:
        """Shutdown: release every open request; returns how many. A Match still opening its id (its call
        cancelled, its worker in an L3 lookup or a load) is waited for, up to ``wait_s`` (default
        ``serve.shutdown_grace_s``), and what it opened is released too; so are the releases still running
        on their own (a Release waiting for such a Match, a lost reply's request): once this returns, nothing
        is left open and no release is under way, unless a Match outlived the wait."""
        end = time.monotonic() + (self.serve.shutdown_grace_s if wait_s is None else wait_s)
        entries = [e for t in self._tables.values() for e in t.drain()]
        opening = [asyncio.ensure_future(e.settled.wait()) for e in entries if e.request is None]
        if opening:
            await asyncio.wait(opening, timeout=max(0.0, end - time.monotonic()))
            for w in opening:
                w.cancel()
        n = 0
        for e in entries:
            if e.request is not None and not e.request.released:
                await blocking(self.cache.release, e.request)
                n += 1
        if self._background:
            await asyncio.wait(list(self._background), timeout=max(0.0, end - time.monotonic()))
        return n

    def _in_background(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` in a task that outlives the call that started it, until :meth:`release_all` waits
        for it at shutdown."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
