"""The request lifecycle RPCs of ``hicache.v1.HiCache``: Match, MatchStream, Prefetch, Allocate, Commit, Release.

A Match opens a request under an id (the client's, or one made up here and named in the reply) in the
caller's :class:`~hicache.service.requests.RequestTable`; Prefetch, Allocate and Commit act on it and
Release closes it. Ids are per token: another token's id is NOT_FOUND, as an unknown one. A ``peek`` Match
opens nothing. Match runs inline on the event loop unless it asks L3 or loads (a radix walk; page keys are
hashed only when the store is asked or the caller wants them); L3 lookups, prefetch and L2 -> L1 loads run
on a worker thread (:func:`~hicache.service.servicer_base.blocking`). Allocate refuses (RESOURCE_EXHAUSTED)
before evicting anything when the pages cannot be freed; Commit's pages must extend the request's prefix
with pages it owns.

Deadlines: gRPC cancels a handler whose deadline passed; Prefetch cuts its wait for the L3 run to the time
remaining. A Match cancelled while its worker still runs keeps its id: the request opens when the worker
finishes and is released by the client's Release (a Release that comes while the Match is still opening the
id waits for it, then releases what it opened; while it waits it takes no room under
``serve.max_concurrency``) or by idle expiry, counted from when the request opened. At shutdown
(:meth:`~hicache.service.servicer_base.ServicerBase.release_all`) such a Match is waited for and what it
opened is released. A Match without a request_id cancelled at any point releases what it opened (only its
reply could name the id the node made up). A reply lost in transit after the handler returned is not seen
here: such a request waits for the client's Release (the Python clients name every id they open and
release it when a reply is lost) or idle expiry. A Match that repeats exactly the one that opened its id,
before any other call on the id, gets that Match's reply again instead of ALREADY_EXISTS: clients resend a
Match whose reply was lost (:mod:`.requests`).

A MatchStream counts against ``serve.max_concurrency`` per message, not for its life (a message beyond the
bound gets a RESOURCE_EXHAUSTED reply and the stream goes on); a message refused for its input or for room
gets its error as its reply. The requests it opened that are still open when it ends (the client closed
it, or went away) are released then.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np

from hicache.cache import CacheFullError, Request
from hicache.cache_types import MultiHandle
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.service.auth import EVERYONE, Principal
from hicache.service.decode import Undecodable
from hicache.service.requests import Entry, RequestTable
from hicache.service.rpc import Ctx, busy_message, log, status_of, streaming, unary
from hicache.service.servicer_base import ServicerBase, blocking, open_request, within_deadline
from hicache.service.validation import ServiceError, invalid, page_count, page_indices, precondition, shown, token_bytes

PROGRESS_POLL_S = 0.01  # Prefetch with stream_progress: how often the fetch is checked for its end


class RequestRpcs(ServicerBase):
    """Match, MatchStream, Prefetch, Allocate, Commit and Release (see the module docstring)."""

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

    @streaming
    async def Prefetch(self, request: pb.PrefetchRequest, context: Ctx) -> AsyncIterator[pb.PrefetchProgress]:
        entry = self._table(self._who(context)).get(request.request_id)
        interval = (request.progress_interval_ms or 20) / 1000.0
        async with entry.lock:
            req = open_request(entry, request.request_id)
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
        return within_deadline(wait, context)

    @unary
    async def Allocate(self, request: pb.AllocateRequest, context: Ctx) -> pb.AllocateResponse:
        entry = self._table(self._who(context)).get(request.request_id)
        # 0 pages (a prompt found whole on L1: nothing new to compute) gives none, as HiCache.alloc does
        n = page_count(request.num_pages, self.max_pages, minimum=0)
        if n == 0:
            return pb.AllocateResponse()
        cache = self.cache
        free, evictable = cache.device_headroom()
        if n > free + evictable:  # pages of backups in flight free up once they end: wait for them
            free, evictable = await blocking(cache.device_headroom, True)
        if n > free + evictable:  # refuse before evicting anything: a rejected call changes nothing
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"L1: need {n} pages, {free} free and at most {evictable} evictable "
                               "(the rest is locked by requests in flight)")
        async with entry.lock:
            pages = cache.alloc(open_request(entry, request.request_id), n)
        return pb.AllocateResponse(device_indices=pages.tolist())

    @unary
    async def Commit(self, request: pb.CommitRequest, context: Ctx) -> pb.CommitResponse:
        entry = self._table(self._who(context)).get(request.request_id)
        tb = token_bytes(request.tokens, request.token_ids, self.max_tokens)
        dev = page_indices(request.device_indices, self.num_pages)
        async with entry.lock:
            req = open_request(entry, request.request_id)
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
