"""asyncio client of the node service: the calls of :class:`hicache.client.HiCacheClient` (all but
``attach_info``), awaited; ``match_stream`` can also pipeline.

One channel multiplexes any number of concurrent calls (HTTP/2 streams), so a scheduler can keep many
Match calls in flight from one event loop:

    async with AsyncHiCacheClient("127.0.0.1:50051") as c:
        results = await asyncio.gather(*(c.match(t, peek=True) for t in prompts))
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from hicache.client._common import (
    DEFAULT_TIMEOUT_S,
    CallError,
    ChannelSettings,
    RetryPolicy,
    Tokens,
    check_reply,
    commit_request,
    encode_tokens,
    match_request,
    ns_ref,
    retryable,
    write_pages_messages,
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
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc

R = TypeVar("R")


class AsyncHiCacheClient:
    def __init__(self, target: str, *, token: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, root_certificates: str = "", client_cert: str = "",
                 client_key: str = "", tls: bool = False, max_message_bytes: int = 64 << 20) -> None:
        self.settings = ChannelSettings(target, token, root_certificates, client_cert, client_key, tls,
                                        max_message_bytes)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        creds = self.settings.credentials()
        opts = self.settings.options()
        self.channel = (grpc.aio.secure_channel(target, creds, options=opts) if creds is not None
                        else grpc.aio.insecure_channel(target, options=opts))
        self.stub = pb_grpc.HiCacheStub(self.channel)
        self._md = self.settings.metadata()

    async def _call(self, method: Callable[..., Awaitable[R]], request: Any, timeout_s: float | None) -> R:
        budget = self.timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + budget
        attempt = 0
        while True:
            try:
                return await method(request, timeout=max(0.001, end - time.monotonic()), metadata=self._md)
            except grpc.aio.AioRpcError as e:
                attempt += 1
                if not retryable(e) or attempt >= self.retry.attempts:
                    raise
                pause = self.retry.delay(attempt - 1)
                if time.monotonic() + pause >= end:
                    raise
                await asyncio.sleep(pause)

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncHiCacheClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
                    skip_l3: bool = False, peek: bool = False, return_keys: bool = False,
                    timeout_s: float | None = None) -> MatchResult:
        req = match_request(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        return MatchResult.from_pb(await self._call(self.stub.Match, req, timeout_s))

    def match_stream(self, pipelined: bool = False) -> AsyncMatchStream:
        """A MatchStream session: ``await s.match(...)`` like :meth:`match` (refusals raise
        :class:`CallError`); ``await s.close()`` ends it. Calls on one session run one at a time, unless
        ``pipelined``: then any number may be in flight (replies are matched to calls by order), at a
        little more cost per call."""
        return AsyncMatchStream(self, pipelined)

    async def prefetch(self, request_id: str, *, stream_progress: bool = False, progress_interval_ms: int = 0,
                       timeout_s: float | None = None) -> AsyncIterator[PrefetchProgress]:
        req = pb.PrefetchRequest(request_id=request_id, stream_progress=stream_progress,
                                 progress_interval_ms=progress_interval_ms)
        call = self.stub.Prefetch(req, timeout=self.timeout_s if timeout_s is None else timeout_s, metadata=self._md)
        async for m in call:
            yield PrefetchProgress.from_pb(m)

    async def allocate(self, request_id: str, num_pages: int, timeout_s: float | None = None) -> np.ndarray:
        r = await self._call(self.stub.Allocate, pb.AllocateRequest(request_id=request_id, num_pages=num_pages),
                             timeout_s)
        return np.asarray(r.device_indices, dtype=np.int64)

    async def commit(self, request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray,
                     timeout_s: float | None = None) -> CommitResult:
        r = await self._call(self.stub.Commit, commit_request(request_id, tokens, device_indices), timeout_s)
        return CommitResult.from_pb(r)

    async def release(self, request_id: str, timeout_s: float | None = None) -> None:
        await self._call(self.stub.Release, pb.ReleaseRequest(request_id=request_id), timeout_s)

    async def stats(self, timeout_s: float | None = None) -> Stats:
        return Stats.from_pb(await self._call(self.stub.Stats, pb.StatsRequest(), timeout_s))

    async def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Wait (up to the call's deadline) until the node's backups in flight and queued L3 writes are
        done; ``complete`` says everything reached the store."""
        return FlushResult.from_pb(await self._call(self.stub.Flush, pb.FlushRequest(), timeout_s))

    async def clear(self, timeout_s: float | None = None) -> ClearResult:
        """Drop every L1 and L2 page on the node that no request holds and no pin keeps (L3 untouched)."""
        return ClearResult.from_pb(await self._call(self.stub.Clear, pb.ClearRequest(), timeout_s))

    async def pin(self, tokens: Tokens, *, tenant: str = "", timeout_s: float | None = None) -> PinInfo:
        """Keep the cached prefix of ``tokens`` on its tiers on the node until :meth:`unpin` (pins what is
        cached now; NOT_FOUND when nothing is, RESOURCE_EXHAUSTED past the node's pinned-page bound)."""
        req = pb.PinRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens))
        return PinInfo.from_pb(await self._call(self.stub.Pin, req, timeout_s))

    async def unpin(self, pin_id: int, timeout_s: float | None = None) -> PinInfo:
        """End pin ``pin_id`` (NOT_FOUND when there is no such pin)."""
        return PinInfo.from_pb(await self._call(self.stub.Unpin, pb.UnpinRequest(pin_id=pin_id), timeout_s))

    async def pins(self, timeout_s: float | None = None) -> list[PinInfo]:
        """The pins the node holds, oldest first."""
        resp = await self._call(self.stub.ListPins, pb.ListPinsRequest(), timeout_s)
        return [PinInfo.from_pb(p) for p in resp.pins]

    async def pool_info(self, timeout_s: float | None = None) -> PoolInfo:
        return PoolInfo.from_pb(await self._call(self.stub.GetPoolInfo, pb.GetPoolInfoRequest(), timeout_s))

    async def attach(self, timeout_s: float | None = None) -> AttachedPool:
        info = PoolInfo.from_pb(await self._call(self.stub.Attach, pb.AttachRequest(), timeout_s))
        return attach_pool(info)

    async def watch_events(self, max_queue: int = 0, timeout_s: float | None = None) -> AsyncIterator[Event]:
        call = self.stub.WatchEvents(pb.WatchEventsRequest(max_queue=max_queue), timeout=timeout_s,
                                     metadata=self._md)
        try:
            async for m in call:
                yield Event.from_pb(m)
        finally:
            call.cancel()

    async def read_pages(self, tokens: Tokens, *, tenant: str = "", max_pages: int = 0,
                         timeout_s: float | None = None) -> tuple[list[bytes], bytes]:
        req = pb.ReadPagesRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens), max_pages=max_pages)
        keys: list[bytes] = []
        parts: list[bytes] = []
        call = self.stub.ReadPages(req, timeout=self.timeout_s if timeout_s is None else timeout_s,
                                   metadata=self._md)
        async for chunk in call:
            keys.extend(chunk.page_keys)
            parts.append(chunk.data)
        return keys, b"".join(parts)

    async def write_pages(self, tokens: Tokens, data: bytes | memoryview, *, first_page: int = 0,
                          tenant: str = "", chunk_bytes: int = 4 << 20,
                          timeout_s: float | None = None) -> CommitResult:
        msgs = write_pages_messages(tokens, data, first_page, tenant, chunk_bytes)
        r = await self.stub.WritePages(iter(msgs), timeout=self.timeout_s if timeout_s is None else timeout_s,
                                       metadata=self._md)
        return CommitResult.from_pb(r)


class AsyncMatchStream:
    """Matches over one MatchStream call: one at a time (write, read), or pipelined (a reader task hands
    replies to the waiting calls in order)."""

    def __init__(self, client: AsyncHiCacheClient, pipelined: bool = False) -> None:
        self._call = client.stub.MatchStream(metadata=client._md)
        self._pipelined = pipelined
        self._pending: collections.deque[asyncio.Future[pb.MatchResponse]] = collections.deque()
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        err: BaseException | None = None
        try:
            async for m in self._call:
                self._pending.popleft().set_result(m)
        except BaseException as e:  # the stream broke: every pending call fails with its error
            err = e
        while self._pending:
            f = self._pending.popleft()
            if not f.done():
                f.set_exception(err or CallError(grpc.StatusCode.UNAVAILABLE, "match stream ended"))

    async def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
                    skip_l3: bool = False, peek: bool = False, return_keys: bool = False) -> MatchResult:
        req = match_request(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        if not self._pipelined:
            async with self._write_lock:
                await self._call.write(req)
                m = await self._call.read()
            if m is grpc.aio.EOF:
                raise CallError(grpc.StatusCode.UNAVAILABLE, "match stream ended")
            return MatchResult.from_pb(check_reply(m))
        fut: asyncio.Future[pb.MatchResponse] = asyncio.get_running_loop().create_future()
        async with self._write_lock:
            self._pending.append(fut)
            await self._call.write(req)
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        return MatchResult.from_pb(check_reply(await fut))

    async def close(self) -> None:
        await self._call.done_writing()
        if self._reader is not None:
            await self._reader

    async def __aenter__(self) -> AsyncMatchStream:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if e is None:
            await self.close()
        else:
            self._call.cancel()
