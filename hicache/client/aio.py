"""asyncio client of the node service: the calls of :class:`hicache.client.HiCacheClient` (all but
``attach_info``), awaited; ``match_stream`` can also pipeline.

One channel multiplexes any number of concurrent calls (HTTP/2 streams), so a scheduler can keep many
Match calls in flight from one event loop:

    async with AsyncHiCacheClient("127.0.0.1:50051") as c:
        results = await asyncio.gather(*(c.match(t, peek=True) for t in prompts))

As with the blocking client, a Match that opens a request under no caller-given ``request_id`` goes out
under an id the client made up, and when it fails after the node may have opened the request (its
deadline passed, the connection dropped, the caller's task was cancelled) the client releases the id in
a background task: see :meth:`AsyncHiCacheClient.match`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import TypeVar

import grpc
import numpy as np

from hicache.client import _common as core
from hicache.client._common import (
    ABANDON_CLOSE_WAIT_S,
    ABANDON_RELEASE_TIMEOUT_S,
    CallError,
    ClientBase,
    Tokens,
    Unary,
    log,
    may_have_opened,
)
from hicache.client.attach import AttachedPool, attach_pool
from hicache.client.types import (
    ClearResult,
    CommitResult,
    Event,
    FlushResult,
    MatchResult,
    PinInfo,
    PoolInfo,
    PrefetchProgress,
    Stats,
)
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

R = TypeVar("R")


class AsyncHiCacheClient(ClientBase):
    """asyncio mirror of :class:`~hicache.client.HiCacheClient`: the same arguments, calls (all but
    ``attach_info``), deadlines, retries and status codes (as ``grpc.aio.AioRpcError``), awaited;
    ``prefetch`` and ``watch_events`` are async iterators. Use it from one event loop.

    A Match the client named the request of (the caller gave no ``request_id``) and that failed after the
    node may have opened it is closed by a background task (see :meth:`match`); :meth:`close` waits a
    little for those closings.
    """

    _grpc = grpc.aio
    channel: grpc.aio.Channel

    async def _unary(self, call: Unary[R], timeout_s: float | None) -> R:
        """One unary call, tried again on UNAVAILABLE as :class:`RetryPolicy` says."""
        return await core.run_async(self.stub, call, self._deadline(timeout_s), self._md, self.retry)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel connects (``TimeoutError`` after ``timeout_s``)."""
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def close(self) -> None:
        """Close the channel; calls still active on it are cancelled. First waits (up to
        ``ABANDON_CLOSE_WAIT_S``) for the closings of requests a failed Match may have opened (see
        :meth:`match`)."""
        if self._abandoning:
            await asyncio.wait(list(self._abandoning), timeout=ABANDON_CLOSE_WAIT_S)
        await self.channel.close()

    def _abandon_later(self, req: pb.MatchRequest) -> None:
        """Close, in a background task, the request a failed Match under a client-made id may have opened
        (:meth:`_abandon`)."""
        task = asyncio.ensure_future(self._abandon(req))
        self._abandoning.add(task)
        task.add_done_callback(self._abandoning.discard)

    async def _abandon(self, req: pb.MatchRequest) -> None:
        """As :meth:`HiCacheClient._abandon <hicache.client.HiCacheClient._abandon>`: best effort, release
        ``req.request_id`` (the node waits for a Match still opening it, then releases what it opened)."""
        rid = req.request_id
        try:
            await self.release(rid, timeout_s=ABANDON_RELEASE_TIMEOUT_S)
            log.debug("match %s: released the request its lost reply named", rid)
        except Exception as e:  # NOT_FOUND: the Match opened nothing; otherwise the node's idle expiry closes it
            log.debug("match %s: no request released: %s", rid, e)

    async def __aenter__(self) -> AsyncHiCacheClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
                    skip_l3: bool = False, peek: bool = False, return_keys: bool = False,
                    timeout_s: float | None = None) -> MatchResult:
        """As :meth:`HiCacheClient.match`: the longest cached prefix; opens a request unless ``peek``.

        With no ``request_id`` (and not ``peek``) the client makes one up and sends it (the reply names
        it); a call that then fails in a way that may have left the request open on the node (a deadline,
        a lost connection, the caller's task cancelled) has the id released by a background task, and
        the error or cancellation reaches the caller at once, as it would without that. A ``request_id``
        the caller names is the caller's to release.
        """
        call = core.match_call(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        try:
            return await self._unary(call, timeout_s)
        except BaseException:
            if call.abandon:
                self._abandon_later(call.request)
            raise

    def match_stream(self, pipelined: bool = False) -> AsyncMatchStream:
        """A MatchStream session: ``await s.match(...)`` like :meth:`match` (refusals raise
        :class:`CallError`); ``await s.close()`` ends it. Calls on one session run one at a time, unless
        ``pipelined``: then any number may be in flight (replies are matched to calls by order), at a
        little more cost per call. A call cancelled while waiting loses only its own reply (see
        :class:`AsyncMatchStream`)."""
        return AsyncMatchStream(self, pipelined)

    async def prefetch(self, request_id: str, *, stream_progress: bool = False, progress_interval_ms: int = 0,
                       timeout_s: float | None = None) -> AsyncIterator[PrefetchProgress]:
        """As :meth:`HiCacheClient.prefetch`: progress messages (when asked), then the ``done`` one."""
        req = core.prefetch_request(request_id, stream_progress, progress_interval_ms)
        async for m in self.stub.Prefetch(req, timeout=self._deadline(timeout_s), metadata=self._md):
            yield core.prefetch_progress(m)

    async def allocate(self, request_id: str, num_pages: int, timeout_s: float | None = None) -> np.ndarray:
        """As :meth:`HiCacheClient.allocate`: L1 pages (int64) owned by the open request."""
        return await self._unary(core.allocate_call(request_id, num_pages), timeout_s)

    async def commit(self, request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray,
                     timeout_s: float | None = None) -> CommitResult:
        """As :meth:`HiCacheClient.commit`: insert the request's pages (the request stays open)."""
        return await self._unary(core.commit_call(request_id, tokens, device_indices), timeout_s)

    async def release(self, request_id: str, timeout_s: float | None = None) -> None:
        """As :meth:`HiCacheClient.release`: close the request."""
        await self._unary(core.release_call(request_id), timeout_s)

    async def stats(self, timeout_s: float | None = None) -> Stats:
        """As :meth:`HiCacheClient.stats`: the node's pools, hit counters, L3 counters and pins."""
        return await self._unary(core.stats_call(), timeout_s)

    async def flush(self, timeout_s: float | None = None) -> FlushResult:
        """As :meth:`HiCacheClient.flush`: wait for the node's backups and queued L3 writes."""
        return await self._unary(core.flush_call(), timeout_s)

    async def clear(self, timeout_s: float | None = None) -> ClearResult:
        """As :meth:`HiCacheClient.clear`: drop every unheld, unpinned L1 and L2 page on the node."""
        return await self._unary(core.clear_call(), timeout_s)

    async def pin(self, tokens: Tokens, *, tenant: str = "", timeout_s: float | None = None) -> PinInfo:
        """As :meth:`HiCacheClient.pin`: keep the cached prefix of ``tokens`` until :meth:`unpin`."""
        return await self._unary(core.pin_call(tokens, tenant), timeout_s)

    async def unpin(self, pin_id: int, timeout_s: float | None = None) -> PinInfo:
        """End pin ``pin_id`` (NOT_FOUND when there is no such pin)."""
        return await self._unary(core.unpin_call(pin_id), timeout_s)

    async def pins(self, timeout_s: float | None = None) -> list[PinInfo]:
        """The pins the node holds, oldest first."""
        return await self._unary(core.pins_call(), timeout_s)

    async def pool_info(self, timeout_s: float | None = None) -> PoolInfo:
        """As :meth:`HiCacheClient.pool_info`: KV layout and L1 pool geometry, no handle."""
        return await self._unary(core.pool_info_call(), timeout_s)

    async def attach(self, timeout_s: float | None = None) -> AttachedPool:
        """As :meth:`HiCacheClient.attach`: map the node's shared L1 pool into this process (same host)."""
        return attach_pool(await self._unary(core.attach_call(), timeout_s))

    async def watch_events(self, max_queue: int = 0, timeout_s: float | None = None) -> AsyncIterator[Event]:
        """As :meth:`HiCacheClient.watch_events`: a snapshot, then every event (no deadline by default)."""
        call = self.stub.WatchEvents(pb.WatchEventsRequest(max_queue=max_queue), timeout=timeout_s,
                                     metadata=self._md)
        try:
            async for m in call:
                yield Event.from_pb(m)
        finally:
            call.cancel()

    async def read_pages(self, tokens: Tokens, *, tenant: str = "", max_pages: int = 0,
                         timeout_s: float | None = None) -> tuple[list[bytes], bytes]:
        """As :meth:`HiCacheClient.read_pages`: page keys and page-first bytes of the cached prefix."""
        out = core.PagesRead()
        async for chunk in self.stub.ReadPages(core.read_pages_request(tokens, tenant, max_pages),
                                               timeout=self._deadline(timeout_s), metadata=self._md):
            out.add(chunk)
        return out.result()

    async def write_pages(self, tokens: Tokens, data: bytes | memoryview, *, first_page: int = 0,
                          tenant: str = "", chunk_bytes: int = 4 << 20,
                          timeout_s: float | None = None) -> CommitResult:
        """As :meth:`HiCacheClient.write_pages`: send page bytes for the node to commit."""
        msgs = core.write_pages_messages(tokens, data, first_page, tenant, chunk_bytes)
        r = await self.stub.WritePages(iter(msgs), timeout=self._deadline(timeout_s), metadata=self._md)
        return CommitResult.from_pb(r)


class AsyncMatchStream:
    """Matches over one MatchStream call: one at a time (write, read), or pipelined (a reader task hands
    replies to the waiting calls in order).

    A call cancelled once its request is out (``asyncio.wait_for`` timing out) loses only its own reply:
    the write, and unpipelined the read of the reply, run to their end regardless (cancelling them midway
    would make gRPC cancel the whole stream), the reply is dropped, and later calls get theirs. A call
    cancelled before its turn to write sends nothing. A cancelled Match that was not a peek may still have
    opened its request on the node: one under an id the client made up (the caller gave none) is released
    by the client when its reply comes (or, if the stream ends first, as :meth:`AsyncHiCacheClient.match`
    does); one whose ``request_id`` the caller named is the caller's to release.

    Once the stream is over (the node or the connection went away, ``close``, a fault in this client while
    reading it) every waiting and later call raises at once: the stream's ``grpc.aio.AioRpcError``, or
    :class:`CallError` with UNAVAILABLE (the stream ended), FAILED_PRECONDITION (closed), the status
    the call ended with, or INTERNAL (a fault here; the fault is its ``__cause__``). Open a new session to
    go on.
    """

    def __init__(self, client: AsyncHiCacheClient, pipelined: bool = False) -> None:
        self._client = client
        self._call = client.stub.MatchStream(metadata=client._md)
        self._pipelined = pipelined
        # calls whose request is written (or being written) and whose reply has not come, in order, each
        # with its request when the client made up its id (the client's to release if the call is lost)
        self._pending: collections.deque[tuple[asyncio.Future[pb.MatchResponse], pb.MatchRequest | None]] = \
            collections.deque()
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None  # set once the stream is over: what every call raises
        self._closed: CallError | None = None  # set by close: what later calls raise

    async def _error(self, e: BaseException | None) -> BaseException:
        """What calls raise once the stream is over, from what ended it (``None``: the stream ended)."""
        if isinstance(e, grpc.RpcError | CallError):
            return e
        with contextlib.suppress(Exception):
            if self._call.done():  # a write or read refused because the call had ended: say how it ended
                code = await self._call.code()
                if code != grpc.StatusCode.OK:
                    return CallError(code, await self._call.details())
        if e is None:
            return CallError(grpc.StatusCode.UNAVAILABLE, "match stream ended")
        err = CallError(grpc.StatusCode.INTERNAL, f"match stream failed: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err

    def _fail(self, err: BaseException) -> None:
        """The stream is over: fail every waiting call (and, through ``_failure``, every later one)."""
        if self._failure is None:
            self._failure = err
            self._call.cancel()  # no-op when the call has ended; else frees the node's side of it
        while self._pending:
            f, owned = self._pending.popleft()
            if not f.done():
                f.set_exception(self._failure)
            if owned is not None and may_have_opened(self._failure):  # written: the node may have opened it
                self._client._abandon_later(owned)

    def _unclaimed(self, owned: pb.MatchRequest | None, m: pb.MatchResponse) -> None:
        """The reply of a call that was cancelled meanwhile: release the request it opened under an id the
        client made up (nobody else knows that id)."""
        if owned is not None and not m.HasField("error"):
            self._client._abandon_later(owned)

    async def _read(self) -> None:
        """Pipelined: hand each reply to the oldest pending call (dropped when that call was cancelled)."""
        err: Exception | None = None
        try:
            async for m in self._call:
                f, owned = self._pending.popleft()  # IndexError (a reply nobody asked for) fails the session
                if not f.done():
                    f.set_result(m)
                else:
                    self._unclaimed(owned, m)
        except Exception as e:
            err = e
        except BaseException as e:  # the reader itself was cancelled (loop shutting down), or interrupted
            self._fail(CallError(grpc.StatusCode.CANCELLED, f"match stream: reader stopped ({type(e).__name__})"))
            raise
        self._fail(await self._error(err))

    async def _send(self, req: pb.MatchRequest, fut: asyncio.Future[pb.MatchResponse], owned: bool) -> None:
        """Write ``req`` in turn; unpipelined, also read its reply into ``fut`` (pipelined: the reader
        does). Runs shielded from the caller's cancellation. ``owned``: the client made up the id."""
        async with self._write_lock:
            if fut.done():
                return  # the call was cancelled before its turn: nothing is sent
            err = self._closed or self._failure
            if err is not None:
                fut.set_exception(err)
                return
            if self._pipelined and self._reader is None:
                self._reader = asyncio.create_task(self._read())
            self._pending.append((fut, req if owned else None))
            try:
                await self._call.write(req)
                if self._pipelined:
                    return
                m = await self._call.read()
            except Exception as e:  # gRPC has ended the call
                self._fail(await self._error(e))
                return
            except BaseException as e:
                task = asyncio.current_task()
                if isinstance(e, asyncio.CancelledError) and task is not None and not task.cancelling():
                    # Not this task: gRPC raises CancelledError from a call cancelled in this process
                    # (the client closed, the stream cancelled by another task). The stream is over;
                    # the waiting call gets that as its error rather than a cancellation of its own.
                    self._fail(await self._error(e))
                    return
                # this task was cancelled (loop shutting down) or interrupted: gRPC cancels the call
                self._fail(CallError(grpc.StatusCode.CANCELLED, "match stream: cancelled while writing"))
                raise
            if m is grpc.aio.EOF:
                self._fail(await self._error(None))
                return
            self._pending.popleft()
            if not fut.done():  # done: the call was cancelled meanwhile; its reply is dropped
                fut.set_result(m)
            else:
                self._unclaimed(req if owned else None, m)

    async def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
                    skip_l3: bool = False, peek: bool = False, return_keys: bool = False) -> MatchResult:
        """As :meth:`HiCacheClient.match`, over the stream; a refusal raises :class:`CallError`. With no
        ``request_id`` (not a peek) the client makes one up, and releases it if the call is cancelled or
        the stream fails before the reply reaches the caller (see :class:`AsyncMatchStream`)."""
        call = core.match_call(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        req, owned = call.request, call.owned
        fut: asyncio.Future[pb.MatchResponse] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.shield(self._send(req, fut, owned))
            m = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # the reply had come as the cancellation landed: nobody takes it now
                self._unclaimed(req if owned else None, fut.result())
            fut.cancel()  # not written yet: it never will be; written: its reply is dropped when it comes
            raise
        return core.stream_match_result(m)

    async def close(self) -> None:
        """End the request side of the stream; when pipelined, wait for the replies still due. Later
        calls raise :class:`CallError` (FAILED_PRECONDITION)."""
        async with self._write_lock:
            if self._closed is None:
                self._closed = CallError(grpc.StatusCode.FAILED_PRECONDITION, "match stream closed")
                if self._failure is None:
                    await self._call.done_writing()
        if self._reader is not None:
            await asyncio.wait([self._reader])

    async def __aenter__(self) -> AsyncMatchStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if e is None:
            await self.close()
        else:
            self._call.cancel()
