"""RPC handlers of ``hicache.v1.HiCache`` over one :class:`hicache.cache.HiCache`.

Hot path: Match runs inline on the event loop (a radix walk: ~20 us for 8k tokens; page keys are only
hashed when the store is asked or the caller wants them); L3 lookups, prefetch, L2 -> L1 loads and page
streams run on a worker thread. Match and Allocate may still block the loop briefly, on backups in flight
(allocation under pressure, ``write_back`` evictions) or on a full L3 write queue
(``writeback_when_full: block``). Every handler first validates (:mod:`.validation`), then acts, so a
call rejected for its input changes nothing; one refused for room may have evicted unlocked pages
first. Every RPC counts against ``serve.max_concurrency`` (RESOURCE_EXHAUSTED beyond it) and is timed
into ``hicache_rpc_seconds`` (:mod:`.rpc`).

Deadlines: gRPC cancels a handler whose deadline passed; Prefetch cuts its wait for the L3 run to the
time remaining, while ReadPages and WritePages wait as the prefetch policy says. A Match cancelled while
its worker still runs keeps its id: the request opens when the worker finishes and is released by the
client's Release (a Release that comes while the Match is still opening the id waits for it, then
releases what it opened; while it waits it takes no room under ``serve.max_concurrency``) or by idle
expiry, counted from when the request opened. At shutdown (:meth:`HiCacheServicer.release_all`) such a
Match is waited for and what it opened is released. A Match without a request_id cancelled at any point
releases what it opened (only its reply could name the id the node made up). A reply lost in transit after the
handler returned is not seen here: such a request waits for the client's Release (the Python clients name
every id they open and release it when a reply is lost) or idle expiry. A Match that
repeats exactly the one that opened its id, before any other call on the id, gets that Match's reply
again instead of ALREADY_EXISTS: clients resend a Match whose reply was lost (:mod:`.requests`). A MatchStream
counts against ``serve.max_concurrency`` per message, not for its life, and the requests it opened that are
still open when it ends (the client closed it, or went away) are released then.

Tenants (:mod:`.auth`). Every caller is a :class:`~hicache.service.auth.Principal`: with auth off or one
``serve.auth_token``, one that may do everything; with ``serve.auth_tokens_file``, each token acts for its
tenants only. The tenant a call acts for is its ``namespace.tenant`` (the node's ``model.tenant`` when
empty). Match, MatchStream, Pin, ReadPages and WritePages for a tenant the token may not act for end with
PERMISSION_DENIED (a MatchStream message: that reply) before the cache is touched. Request ids are per token
(one token's Allocate / Commit / Prefetch / Release never reaches another's requests: NOT_FOUND, as an
unknown id), and so are pins (Unpin, ListPins: only the pins made for the token's tenants). WatchEvents
sends a token limited to some tenants only their pages' events, numbered 1, 2, 3, ... for that subscriber
(gap-free, as the hub numbers them for one that sees everything). Clear by a token limited to some tenants
drops only those tenants' pages; a Clear of every tenant's pages, and Flush (it waits on every tenant's
writes), need an admin token. Attach maps the whole L1 pool (every tenant's pages): tokens for every tenant
only. Stats and GetPoolInfo are node-wide figures any token may read.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import numpy as np

from hicache.cache import CacheFullError, HiCache, LoadResult, PinInfo, Request
from hicache.cache_types import MultiHandle
from hicache.config import ServeConfig
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.auth import EVERYONE, Authenticator, Principal
from hicache.service.decode import Undecodable
from hicache.service.events import EventHub
from hicache.service.hostid import host_id
from hicache.service.metrics_http import ServiceMetrics
from hicache.service.pages import gather_pages, scatter_pages
from hicache.service.requests import DEFAULT_REQUEST_TTL_S, Entry, RequestTable
from hicache.service.rpc import ALWAYS_ADMITTED, UNBOUNDED, Ctx, busy_message, log, status_of, streaming, unary
from hicache.service.shared_pool import SharedPool
from hicache.service.validation import (
    NamespaceResolver,
    ServiceError,
    invalid,
    page_count,
    page_indices,
    precondition,
    shown,
    token_bytes,
)

DEFAULT_EVENT_QUEUE = 4096
MAX_EVENT_QUEUE = 1 << 20
PAGE_CHUNK_BYTES = 4 << 20  # ReadPages: at most this much page data per message (at least one page)
DEADLINE_MARGIN_S = 0.02
PROGRESS_POLL_S = 0.01  # Prefetch with stream_progress: how often the fetch is checked for its end
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


def _within_deadline(wait: float | None, context: Ctx) -> float | None:
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


def _open_request(entry: Entry, request_id: str) -> Request:
    """The entry's request, taken under ``entry.lock``: NOT_FOUND when a Release (or expiry) won the race
    since the entry was looked up."""
    req = entry.request
    assert req is not None
    if req.released:
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"request_id {request_id!r}: released")
    return req


def denied(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED, message)


async def tenant_events(events: AsyncIterator[pb.Event], digests: set[bytes]) -> AsyncIterator[pb.Event]:
    """The hub's ``events`` cut to the runs of the namespaces ``digests``, numbered for this subscriber: each
    event kept gets the next number (1, 2, 3, ...), a snapshot the number of the last event sent before it, so
    the stream is as gap-free as the hub's and says nothing of the events left out (not even how many)."""
    n = 0
    async for ev in events:
        runs = [r for r in ev.runs if r.namespace_digest in digests]
        if ev.kind == pb.Event.SNAPSHOT:
            yield pb.Event(sequence=n, kind=ev.kind, runs=runs, server_id=ev.server_id,
                           snapshot_continues=ev.snapshot_continues)
        elif runs:
            n += 1
            yield pb.Event(sequence=n, kind=ev.kind, runs=runs, server_id=ev.server_id)


class HiCacheServicer(pb_grpc.HiCacheServicer):
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

    # ------------------------------------------------------------------ plumbing
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
        """The caller (see the module docstring); the interceptor has let only known tokens through."""
        if self.auth is None:
            return EVERYONE
        who = self.auth.principal(context.invocation_metadata())
        if who is None:  # pragma: no cover - AuthInterceptor refuses such a call before any handler
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return who

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

    @staticmethod
    def _admin(who: Principal, what: str) -> None:
        if not who.admin:
            raise denied(f"{what} acts on every tenant's pages: it needs an admin token")

    def _load(self, req: Request) -> LoadResult:
        load = self.cache.load_back(req, layer_wise=False)  # the reply comes once every layer is on L1
        self.cache.count_match(req)  # a Match that loads counts once its load is under way (not when refused)
        load.wait()
        return load

    def _prefetch_wait(self, req: Request, context: Ctx) -> float | None:
        """How long finishing the request's prefetch may wait: the policy's bound, cut to the deadline."""
        task = req.prefetch
        s = self.cache.config.storage
        wait: float | None
        if task is None or s.prefetch_policy == "best_effort":
            wait = 0.0
        elif s.prefetch_policy == "wait_complete":
            wait = None
        else:
            wait = s.prefetch_timeout(task.num_pages * self.page_size)
        return _within_deadline(wait, context)

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

    # ------------------------------------------------------------------ Match
    @unary
    async def Match(self, request: pb.MatchRequest, context: Ctx) -> pb.MatchResponse:
        who = self._who(context)
        table = self._table(who)
        if request.request_id or request.peek:
            return await self._match(request, table=table, who=who)
        # Only the reply names an id made up here: if the call is cancelled (deadline, client gone) once the
        # request opened (waiting for L1 pages another request loads), nobody could ever Release it.
        made_up = uuid.uuid4().hex
        try:
            return await self._match(request, made_up, table, who)
        except asyncio.CancelledError:
            self._orphaned(table, made_up)
            raise

    def _orphaned(self, table: RequestTable, rid: str) -> None:
        """(Event loop.) Release the request open under ``rid``, an id whose Match reply never reached its
        caller; nothing when it is not open (the Match failed, or its cancellation released it)."""
        entry = table.take_open(rid)
        if entry is None:
            return
        self._in_background(self._release(entry))

    async def MatchStream(self, request_iterator: AsyncIterator[pb.MatchRequest],
                          context: Ctx) -> AsyncIterator[pb.MatchResponse]:
        # Not wrapped by @streaming (one generator layer less per message on the hot path). The stream itself
        # is UNBOUNDED: each message counts in `inflight` while it is handled, as a Match call would.
        self._admit("MatchStream")
        who = self._who(context)
        table = self._table(who)
        opened: dict[str, Entry] = {}  # what this stream's Matches opened: released when it ends
        hist = self._hist["Match"]
        pc = time.perf_counter
        limit = self.serve.max_concurrency
        t_open = pc()
        status = "OK"
        try:
            async for request in request_iterator:
                if self.inflight >= limit:
                    self.metrics.rpc_rejected.inc()
                    yield pb.MatchResponse(error=pb.Error(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                                          message=busy_message(limit)))
                    continue
                t0 = pc()
                self.inflight += 1
                try:
                    if isinstance(request, Undecodable):
                        raise invalid(request.message)
                    resp = await self._match(request, table=table, who=who, opened=opened)
                except (ServiceError, CacheFullError) as e:
                    code, msg = status_of(e)
                    resp = pb.MatchResponse(error=pb.Error(code=code.value[0], message=msg))
                finally:
                    self.inflight -= 1
                hist.observe(pc() - t0)
                yield resp
        except asyncio.CancelledError:
            status = "CANCELLED"
            raise
        except Exception as e:  # a bug, not a refusal: end the stream with INTERNAL, as @streaming does
            if isinstance(e, grpc.aio.AbortError):
                raise
            log.exception("MatchStream failed")
            status = "INTERNAL"
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")
        finally:
            self._done("MatchStream", status, t_open)
            for entry in opened.values():  # still open, under the id this stream opened it with
                if table.take_entry(entry):
                    self._in_background(self._release(entry))

    async def _match(self, request: pb.MatchRequest, made_up: str | None = None, table: RequestTable | None = None,
                     who: Principal = EVERYONE, opened: dict[str, Entry] | None = None) -> pb.MatchResponse:
        """A Match by ``who``, opening its request in ``table`` (the caller's; default EVERYONE's) and noting it
        in ``opened`` (a MatchStream's) when given."""
        table = self.table if table is None else table
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        ns = self._ns(request.namespace, who)
        l3 = not request.skip_l3 and self.cache.storage is not None
        if request.peek:
            if request.request_id or request.load:
                raise invalid("peek: opens no request, so request_id and load must be unset")
            tokens = np.frombuffer(tb, dtype="<u4")
            if l3:
                req = await blocking(self._peek, tokens, ns, l3, request.return_keys)
            else:
                req = self._peek(tokens, ns, False, request.return_keys)
            return self._match_response(req, "", request.return_keys)
        if request.request_id:
            again = await self._repeat(request, table)
            if again is not None:
                return again
        rid = request.request_id or made_up or uuid.uuid4().hex
        entry = table.reserve(rid)
        if opened is not None:
            opened[rid] = entry
        if request.request_id:
            entry.opening = request
        try:
            if l3 or request.load:
                req = await blocking(self._open, entry, tb, ns, l3, request.load, request.return_keys)
            else:
                req = self._open(entry, tb, ns, False, False, request.return_keys)
        except asyncio.CancelledError:
            # The worker finished first (``blocking``). If it failed (the cancellation landed just as it
            # did), nothing opened: free the id. Otherwise the request is open under `rid`: the caller
            # named it and can Release it (or expiry will); an id made up here nobody can: release it now.
            if entry.request is None:
                table.drop(rid)
            elif not request.request_id:
                self._orphaned(table, rid)
            raise
        except BaseException:
            table.drop(rid)
            raise
        finally:
            entry.settled.set()  # wakes a repeat of this Match (see _repeat), or a Release, waiting for it
        entry.last_used = time.monotonic()  # idle from now on, however long the Match took to open it
        loading = [h for h in req.pending if not h.done()]
        if loading:  # L1 pages another request is still loading from L2: reply once they hold their data
            try:
                await blocking(MultiHandle(loading).wait)
            except asyncio.CancelledError:
                if not request.request_id:  # an id made up here: no reply will name it
                    self._orphaned(table, rid)
                raise
            entry.last_used = time.monotonic()
        return self._match_response(req, rid, request.return_keys)

    async def _repeat(self, request: pb.MatchRequest, table: RequestTable | None = None) -> pb.MatchResponse | None:
        """The reply to a Match that repeats exactly the one that opened its id, with no other call on the
        id since (a client resending after the reply was lost): built from the open request as the first
        reply was, once that Match has opened it. ``None`` when ``request`` is no such repeat (or the first
        attempt failed meanwhile): the Match then goes on as usual (opens the id, or ALREADY_EXISTS)."""
        rid = request.request_id
        while True:
            entry = (self.table if table is None else table).repeat(rid, request)
            if entry is None:
                return None
            if entry.request is not None:
                break
            await entry.settled.wait()  # the first attempt is still opening it (L3 lookup, load)
        req = entry.request
        loading = [h for h in req.pending if not h.done()]
        if loading:
            await blocking(MultiHandle(loading).wait)
        return self._match_response(req, rid, request.return_keys)

    def _peek(self, tokens: np.ndarray, ns: Any, l3: bool, keys: bool) -> Request:
        return self.cache.peek(tokens, ns, l3=l3, keys=keys)  # serves nothing: not a lookup nor a hit

    def _open(self, entry: Entry, tb: bytes, ns: Any, l3: bool, load: bool, keys: bool) -> Request:
        # Page keys are hashed here only when the store is asked or the caller wants them; otherwise
        # commit hashes them (once) when the request's pages enter the tree.
        req = self.cache.match(np.frombuffer(tb, dtype="<u4"), ns, l3=l3, keys=keys, defer_count=load)
        if load:
            try:
                self._load(req)
            except BaseException:
                self.cache.release(req)
                raise
        entry.request = req
        return req

    def _match_response(self, req: Request, rid: str, keys: bool) -> pb.MatchResponse:
        resp = pb.MatchResponse(
            request_id=rid, l1_pages=len(req.device_indices),
            l2_pages=max(0, req.l1_pages + req.l2_pages - len(req.device_indices)) if rid else req.l2_pages,
            l3_pages=req.l3_pages, page_size=self.page_size, num_pages=req.num_pages,
            device_indices=req.device_indices.tolist() if rid else (),
        )
        if keys:
            resp.page_keys.extend(req.keys)
        return resp

    # ------------------------------------------------------------------ Prefetch
    @streaming
    async def Prefetch(self, request: pb.PrefetchRequest, context: Ctx) -> AsyncIterator[pb.PrefetchProgress]:
        entry = self._table(self._who(context)).get(request.request_id)
        interval = (request.progress_interval_ms or 20) / 1000.0
        async with entry.lock:
            req = _open_request(entry, request.request_id)
            total = await blocking(self.cache.prefetch, req) if self.cache.storage is not None else 0
            task = req.prefetch
            if task is not None:
                wait = self._prefetch_wait(req, context)
                if request.stream_progress:
                    end = None if wait is None else time.monotonic() + wait
                    next_msg = time.monotonic()
                    while not task.done() and (end is None or time.monotonic() < end):
                        now = time.monotonic()
                        if now >= next_msg:
                            yield pb.PrefetchProgress(pages_total=total, pages_done=task.completed)
                            next_msg = now + interval
                        # wake at least every PROGRESS_POLL_S: the wait ends when the fetch does, whatever
                        # the interval
                        step = min(next_msg - time.monotonic(), PROGRESS_POLL_S)
                        if end is not None:
                            step = min(step, end - time.monotonic())
                        await asyncio.sleep(max(0.0, step))
                    wait = 0.0
                await blocking(task.finish, wait)
            load = await blocking(self._load, req)
            entry.last_used = time.monotonic()
        yield pb.PrefetchProgress(pages_total=total, pages_done=load.l3_pages, done=True,
                                  device_indices=load.device_indices.tolist(), loaded_l2_pages=load.l2_pages,
                                  loaded_l3_pages=load.l3_pages)

    # ------------------------------------------------------------------ Allocate / Commit / Release
    @unary
    async def Allocate(self, request: pb.AllocateRequest, context: Ctx) -> pb.AllocateResponse:
        entry = self._table(self._who(context)).get(request.request_id)
        # 0 pages (a prompt found whole on L1: nothing new to compute) gives none, as HiCache.alloc does
        n = page_count(request.num_pages, self.max_pages, minimum=0)
        if n == 0:
            return pb.AllocateResponse()
        cache = self.cache
        free, evictable = cache.device_headroom()  # at most this much can be freed
        if n > free + evictable:  # pages of backups in flight free up once they end: wait for them
            free, evictable = await blocking(cache.device_headroom, True)
        if n > free + evictable:  # refuse before evicting anything: a rejected call changes nothing
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"L1: need {n} pages, {free} free and at most {evictable} evictable "
                               "(the rest is locked by requests in flight)")
        async with entry.lock:
            pages = cache.alloc(_open_request(entry, request.request_id), n)
        return pb.AllocateResponse(device_indices=pages.tolist())

    @unary
    async def Commit(self, request: pb.CommitRequest, context: Ctx) -> pb.CommitResponse:
        entry = self._table(self._who(context)).get(request.request_id)
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        dev = page_indices(request.device_indices, self.num_pages)
        async with entry.lock:
            req = _open_request(entry, request.request_id)
            self._check_commit(req, tb, dev)
            res = self.cache.commit(req, np.frombuffer(tb, dtype="<u4"), dev)
            entry.last_used = time.monotonic()
            return pb.CommitResponse(new_pages=res.new_pages, reused_pages=res.reused_pages,
                                     backed_up_pages=res.backed_up_pages,
                                     device_indices=req.device_indices.tolist())

    def _check_commit(self, req: Request, tb: bytes, dev: np.ndarray) -> None:
        stride = self.page_size * 4
        n = len(tb) // stride
        if len(dev) != n:
            raise invalid(f"device_indices: {len(dev)} pages given, the tokens have {n} full pages "
                          f"(page size {self.page_size})")
        full = tb[: n * stride]
        if full[: len(req.token_bytes)] != req.token_bytes[: len(full)] or n < len(req.device_indices):
            raise precondition("tokens: do not extend the request's matched prefix")
        task = req.prefetch  # an L3 fetch a Prefetch cut short left running: its pages are for these tokens
        if task is not None and n < req.prefetch_start + task.num_pages:
            raise precondition(f"tokens: {n} full pages, but the request's prefetch (cut short: call Prefetch "
                               f"to finish it) fetches pages up to {req.prefetch_start + task.num_pages}")
        prefix = req.device_indices
        if not np.array_equal(dev[: len(prefix)], prefix):
            raise precondition(f"device_indices: must start with the request's {len(prefix)} prefix pages "
                               "(from Match / Prefetch)")
        new = dev[len(prefix):]
        owned = np.concatenate(req.owned_device) if req.owned_device else np.empty(0, dtype=np.int64)
        mine = np.isin(new, owned)
        if not mine.all():
            raise precondition(f"device_indices: page {int(new[~mine][0])} is not owned by this request "
                               "(allocate pages with Allocate)")

    @unary
    async def Release(self, request: pb.ReleaseRequest, context: Ctx) -> pb.ReleaseResponse:
        table = self._table(self._who(context))
        pending = table.pending(request.request_id)
        if pending is not None:
            # Its Match is still opening it (an L3 lookup, a load): most often a client whose Match reply was
            # lost. Release it as soon as it is open -- in a task of its own, shielded, so a Release cut short
            # still does. Waiting here takes no room under serve.max_concurrency: the Match it waits for
            # holds its own.
            task = self._in_background(self._release_when_open(table, pending))
            self.inflight -= 1
            try:
                released = await asyncio.shield(task)
            finally:
                self.inflight += 1
            if not released:
                raise ServiceError(grpc.StatusCode.NOT_FOUND,
                                   f"request_id {shown(request.request_id)}: its Match opened nothing, or "
                                   "another call released it meanwhile")
            return pb.ReleaseResponse()
        entry = table.pop(request.request_id)
        # shielded: the id has left the table, so a release cut short by the caller's deadline or
        # cancellation would leave the request's locks and pins for good
        await asyncio.shield(self._release(entry))
        return pb.ReleaseResponse()

    async def _release_when_open(self, table: RequestTable, entry: Entry) -> bool:
        """Wait for the Match opening ``entry`` to end, then release what it opened; False when there is
        nothing to release (the Match failed, or another call -- a Release, or shutdown -- took the id
        meanwhile). Never raises for that: when its Release was cut short nobody would retrieve the error."""
        await entry.settled.wait()
        if not table.take_entry(entry):
            return False
        await self._release(entry)
        return True

    def _in_background(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run ``coro`` in a task that outlives the call that started it, until :meth:`release_all` waits
        for it at shutdown."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _release(self, entry: Entry) -> None:
        async with entry.lock:
            req = entry.request
            assert req is not None
            if req.released:
                return
            if req.prefetch is not None:
                await blocking(self.cache.release, req)
            else:
                self.cache.release(req)

    # ------------------------------------------------------------------ Stats / events / pool
    @unary
    async def Stats(self, request: pb.StatsRequest, context: Ctx) -> pb.StatsResponse:
        st = self.cache.stats()
        reg = self.cache.metrics.registry

        def val(name: str, **labels: str) -> int:
            v = reg.get_sample_value(name, labels or None)
            return int(v or 0)

        storage = st.get("storage")
        return pb.StatsResponse(
            l1_pages_total=st["l1_pages_total"], l1_pages_used=st["l1_pages_used"],
            l1_pages_cached=st["l1_pages_cached"], l1_pages_locked=st["l1_pages_locked"],
            l2_pages_total=st["l2_pages_total"], l2_pages_used=st["l2_pages_used"],
            l2_pages_cached=st["l2_pages_cached"], writeback_queue_pages=st["writeback_queue_pages"],
            lookups=val("hicache_lookups_total"), lookup_tokens=val("hicache_lookup_tokens_total"),
            hit_tokens_l1=val("hicache_hit_tokens_total", tier="l1"),
            hit_tokens_l2=val("hicache_hit_tokens_total", tier="l2"),
            hit_tokens_l3=val("hicache_hit_tokens_total", tier="l3"),
            open_requests=self.open_requests, event_sequence=self.hub.sequence,
            storage_pages_written=storage.sets if storage else 0, storage_pages_read=storage.gets if storage else 0,
            storage_errors=storage.errors if storage else 0,
            storage_corrupt_pages=storage.corrupt_pages if storage else 0,
            storage_bytes_written=storage.bytes_written if storage else 0,
            storage_stored_bytes_written=storage.stored_bytes_written if storage else 0,
            pins=st["pins"], pinned_l1_pages=st["pinned_l1_pages"], pinned_l2_pages=st["pinned_l2_pages"],
        )

    @unary
    async def Flush(self, request: pb.FlushRequest, context: Ctx) -> pb.FlushResponse:
        self._admin(self._who(context), "Flush")
        t = request.timeout_s
        if not math.isfinite(t) or t < 0:
            raise invalid(f"timeout_s: must be a finite number >= 0, got {t}")
        report = await blocking(self.cache.flush, _within_deadline(t if t > 0 else None, context))
        if report is None:
            return pb.FlushResponse(has_storage=False, complete=True)
        return pb.FlushResponse(has_storage=True, written_pages=report.written_pages,
                                failed_pages=report.failed_pages, dropped_pages=report.dropped_pages,
                                pending_pages=report.pending_pages, complete=report.complete)

    # ------------------------------------------------------------------ pins
    @staticmethod
    def _pin_pb(info: PinInfo) -> pb.PinInfo:
        return pb.PinInfo(pin_id=info.pin_id, l1_pages=info.l1_pages, l2_pages=info.l2_pages,
                          namespace=info.namespace)

    @unary
    async def Pin(self, request: pb.PinRequest, context: Ctx) -> pb.PinInfo:
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        ns = self._ns(request.namespace, self._who(context))
        try:
            info = self.cache.pin(np.frombuffer(tb, dtype="<u4"), ns)
        except ValueError as e:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, str(e)) from None
        self._pin_tenants[info.pin_id] = ns.tenant
        return self._pin_pb(info)

    def _pin_visible(self, who: Principal, pin_id: int) -> bool:
        """Whether the caller may see (and end) pin ``pin_id``: one made for a tenant it acts for."""
        if who.every_tenant:
            return True
        tenant = self._pin_tenants.get(pin_id)
        return tenant is not None and who.may_act_for(tenant)

    @unary
    async def Unpin(self, request: pb.UnpinRequest, context: Ctx) -> pb.PinInfo:
        try:
            if not self._pin_visible(self._who(context), request.pin_id):
                raise KeyError(request.pin_id)  # another tenant's pin: as if there were none
            info = self.cache.unpin(request.pin_id)
        except KeyError:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"pin_id: no pin {request.pin_id}") from None
        self._pin_tenants.pop(request.pin_id, None)
        return self._pin_pb(info)

    @unary
    async def ListPins(self, request: pb.ListPinsRequest, context: Ctx) -> pb.ListPinsResponse:
        who = self._who(context)
        return pb.ListPinsResponse(pins=[self._pin_pb(p) for p in self.cache.pins()
                                         if self._pin_visible(who, p.pin_id)])

    @unary
    async def Clear(self, request: pb.ClearRequest, context: Ctx) -> pb.ClearResponse:
        who = self._who(context)
        if who.tenants is None:  # every tenant's pages: node-wide
            self._admin(who, "Clear")
            l1, l2 = await blocking(self.cache.clear)
        else:  # a token limited to some tenants clears theirs alone
            l1, l2 = await blocking(self.cache.clear, [self.cache.ns.with_tenant(t) for t in who.tenants])
        return pb.ClearResponse(l1_pages=l1, l2_pages=l2)

    @streaming
    async def WatchEvents(self, request: pb.WatchEventsRequest, context: Ctx) -> AsyncIterator[pb.Event]:
        who = self._who(context)
        if request.max_queue > MAX_EVENT_QUEUE:
            raise invalid(f"max_queue: at most {MAX_EVENT_QUEUE}")
        events = self.hub.stream(self.cache.snapshot, request.max_queue or DEFAULT_EVENT_QUEUE)
        if who.tenants is None:
            async for ev in events:
                yield ev
            return
        async for ev in tenant_events(events, {self.cache.ns.with_tenant(t).digest for t in who.tenants}):
            yield ev

    def pool_info(self) -> pb.PoolInfo:
        lay = self.cache.layout
        ns = self.cache.ns
        return pb.PoolInfo(
            layout=pb.KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim,
                               dtype=lay.dtype, page_size=lay.page_size, attention=lay.attention,
                               describe=lay.describe(), bytes_per_page=lay.bytes_per_page),
            num_pages=self.num_pages, device=str(self.cache.device_pool.device), model=ns.model,
            revision=ns.revision, tp_rank=ns.tp_rank, tp_size=ns.tp_size, namespace_digest=ns.digest,
            host_pid=os.getpid(), hostname=socket.gethostname(), host_id=host_id(),
        )

    @unary
    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context: Ctx) -> pb.PoolInfo:
        return self.pool_info()

    @unary
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.PoolInfo:
        if not self._who(context).every_tenant:
            raise denied("attach: the shared L1 pool holds every tenant's pages: it needs a token for every "
                         "tenant")
        if self.shared is None:
            raise precondition("attach: this server's L1 pool is not shared (serve.shared_pool is false)")
        info = self.pool_info()
        self.shared.fill(info)
        return info

    # ------------------------------------------------------------------ remote peers: page bytes
    @streaming
    async def ReadPages(self, request: pb.ReadPagesRequest, context: Ctx) -> AsyncIterator[pb.PageChunk]:
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        ns = self._ns(request.namespace, self._who(context))
        # counted as a lookup once its load is under way (_load): a ReadPages refused for room counts nothing
        req = await blocking(functools.partial(self.cache.match, defer_count=True), np.frombuffer(tb, dtype="<u4"),
                             ns)
        try:
            if self.cache.storage is not None:
                await blocking(self.cache.prefetch, req)
            load = await blocking(self._load, req)
            dev = load.device_indices
            if request.max_pages:
                dev = dev[: request.max_pages]
            bpp = self.cache.layout.bytes_per_page
            per = max(1, min(PAGE_CHUNK_BYTES, self.serve.max_message_bytes // 2) // bpp)
            total = len(dev)
            for lo in range(0, total, per):
                chunk = dev[lo: lo + per]
                data = await blocking(gather_pages, self.cache.device_pool, chunk)
                yield pb.PageChunk(first_page=lo, num_pages=len(chunk), page_keys=req.keys[lo: lo + len(chunk)],
                                   data=data, total_pages=total)
        finally:
            self.cache.release(req)  # quick; runs even when the peer went away mid-stream

    @unary
    async def WritePages(self, request_iterator: AsyncIterator[pb.WritePagesChunk],
                         context: Ctx) -> pb.CommitResponse:
        header: pb.WritePagesHeader | None = None
        buf = bytearray()
        limit = 0
        tb = b""
        bpp = self.cache.layout.bytes_per_page
        async for msg in request_iterator:
            if isinstance(msg, Undecodable):
                raise invalid(msg.message)
            part = msg.WhichOneof("part")
            if header is None:
                if part != "header":
                    raise invalid("write pages: the first message must carry the header")
                header = msg.header
                # the tenant first: a token refused for it gets PERMISSION_DENIED before its data is read
                tenant = header.namespace.tenant or self.cache.ns.tenant
                if not self._who(context).may_act_for(tenant):
                    raise denied(f"namespace.tenant {shown(tenant)}: this token may not act for that tenant")
                tb = token_bytes(header.tokens, header.token_ids, self.max_tokens)
                n = len(tb) // (self.page_size * 4)
                if header.first_page >= n:
                    raise invalid(f"header.first_page: {header.first_page} but the tokens have {n} full pages")
                limit = (n - header.first_page) * bpp
                continue
            if part != "data":
                raise invalid("write pages: only the first message may carry a header")
            if len(buf) + len(msg.data) > limit:
                raise invalid(f"data: more than the {limit} bytes of pages {header.first_page}.. of the tokens")
            buf += msg.data
        if header is None:
            raise invalid("write pages: empty stream")
        if len(buf) != limit:
            raise invalid(f"data: {len(buf)} bytes, pages {header.first_page}.. need {limit}")
        ns = self._ns(header.namespace, self._who(context))
        return await blocking(self._write_pages, tb, ns, header.first_page, bytes(buf))

    def _write_pages(self, tb: bytes, ns: Any, first: int, data: bytes) -> pb.CommitResponse:
        cache = self.cache
        tokens = np.frombuffer(tb, dtype="<u4")
        req = cache.match(tokens, ns, l3=False, keys=False, count=False)  # a peer's pages, not a lookup
        try:
            if req.l1_pages + req.l2_pages < first:  # refused before any L2 -> L1 load moves pages
                raise precondition(f"header.first_page: pages before {first} must be cached here; "
                                   f"this node has the first {req.l1_pages + req.l2_pages}")
            have = len(self._load(req).device_indices)
            if have < first:
                raise precondition(f"header.first_page: pages before {first} must be cached here; "
                                   f"this node has the first {have}")
            n = req.num_pages
            bpp = cache.layout.bytes_per_page
            res = None
            new = np.empty(0, dtype=np.int64)
            if n > have:
                new = cache.alloc(req, n - have)
                scatter_pages(cache.device_pool, new, data[(have - first) * bpp:])
            res = cache.commit(req, tokens, np.concatenate([req.device_indices, new]))
            return pb.CommitResponse(new_pages=res.new_pages, reused_pages=res.reused_pages,
                                     backed_up_pages=res.backed_up_pages, device_indices=req.device_indices.tolist())
        finally:
            cache.release(req)

