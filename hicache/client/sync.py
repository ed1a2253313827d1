"""Blocking client of the node service.

    with HiCacheClient("127.0.0.1:50051") as c:
        m = c.match(tokens, request_id="r1")            # MatchResult; L1 prefix locked for "r1"
        pages = c.allocate("r1", n_new_pages)            # np.int64 L1 pages owned by "r1"
        ...                                              # compute KV into them (c.attach() maps the pool)
        c.commit("r1", tokens, np.concatenate([m.device_indices, pages]))
        c.release("r1")

Unary calls, ``prefetch``, ``read_pages`` and ``write_pages`` have a deadline (``timeout_s``, default
10 s); ``watch_events`` and ``match_stream`` have none by default. Unary calls that fail with UNAVAILABLE
are retried with exponential backoff (:class:`RetryPolicy`). Errors surface as ``grpc.RpcError`` with
the server's status code and message; a refusal inside a ``match_stream`` session raises
:class:`~hicache.client.CallError` with the same code and message.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from hicache.client._common import (
    DEFAULT_TIMEOUT_S,
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


class HiCacheClient:
    def __init__(self, target: str, *, token: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, root_certificates: str = "", client_cert: str = "",
                 client_key: str = "", tls: bool = False, max_message_bytes: int = 64 << 20) -> None:
        self.settings = ChannelSettings(target, token, root_certificates, client_cert, client_key, tls,
                                        max_message_bytes)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        creds = self.settings.credentials()
        opts = self.settings.options()
        self.channel = (grpc.secure_channel(target, creds, options=opts) if creds is not None
                        else grpc.insecure_channel(target, options=opts))
        self.stub = pb_grpc.HiCacheStub(self.channel)
        self._md = self.settings.metadata()

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: Callable[..., R], request: Any, timeout_s: float | None) -> R:
        budget = self.timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + budget
        attempt = 0
        while True:
            try:
                return method(request, timeout=max(0.001, end - time.monotonic()), metadata=self._md)
            except grpc.RpcError as e:
                attempt += 1
                if not retryable(e) or attempt >= self.retry.attempts:
                    raise
                pause = self.retry.delay(attempt - 1)
                if time.monotonic() + pause >= end:
                    raise
                time.sleep(pause)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects (``grpc.FutureTimeoutError`` after ``timeout_s``)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ request API
    def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
              skip_l3: bool = False, peek: bool = False, return_keys: bool = False,
              timeout_s: float | None = None) -> MatchResult:
        """Longest cached prefix; opens a request (the returned ``request_id``) unless ``peek``."""
        req = match_request(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        return MatchResult.from_pb(self._call(self.stub.Match, req, timeout_s))

    def match_stream(self) -> MatchStream:
        """A MatchStream session (one call in flight at a time from this blocking client)."""
        return MatchStream(self)

    def prefetch(self, request_id: str, *, stream_progress: bool = False, progress_interval_ms: int = 0,
                 timeout_s: float | None = None) -> Iterator[PrefetchProgress]:
        """L3 -> L2 -> L1 for the request; yields progress (when asked) and a last ``done`` message."""
        req = pb.PrefetchRequest(request_id=request_id, stream_progress=stream_progress,
                                 progress_interval_ms=progress_interval_ms)
        for m in self.stub.Prefetch(req, timeout=self.timeout_s if timeout_s is None else timeout_s,
                                    metadata=self._md):
            yield PrefetchProgress.from_pb(m)

    def allocate(self, request_id: str, num_pages: int, timeout_s: float | None = None) -> np.ndarray:
        r = self._call(self.stub.Allocate, pb.AllocateRequest(request_id=request_id, num_pages=num_pages), timeout_s)
        return np.asarray(r.device_indices, dtype=np.int64)

    def commit(self, request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray,
               timeout_s: float | None = None) -> CommitResult:
        return CommitResult.from_pb(self._call(self.stub.Commit, commit_request(request_id, tokens, device_indices),
                                               timeout_s))

    def release(self, request_id: str, timeout_s: float | None = None) -> None:
        self._call(self.stub.Release, pb.ReleaseRequest(request_id=request_id), timeout_s)

    def stats(self, timeout_s: float | None = None) -> Stats:
        return Stats.from_pb(self._call(self.stub.Stats, pb.StatsRequest(), timeout_s))

    def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Wait (up to the call's deadline) until the node's backups in flight and queued L3 writes are
        done; ``complete`` says everything reached the store."""
        return FlushResult.from_pb(self._call(self.stub.Flush, pb.FlushRequest(), timeout_s))

    def clear(self, timeout_s: float | None = None) -> ClearResult:
        """Drop every L1 and L2 page on the node that no request holds and no pin keeps (L3 untouched)."""
        return ClearResult.from_pb(self._call(self.stub.Clear, pb.ClearRequest(), timeout_s))

    def pin(self, tokens: Tokens, *, tenant: str = "", timeout_s: float | None = None) -> PinInfo:
        """Keep the cached prefix of ``tokens`` on its tiers on the node until :meth:`unpin` (pins what is
        cached now; NOT_FOUND when nothing is, RESOURCE_EXHAUSTED past the node's pinned-page bound)."""
        req = pb.PinRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens))
        return PinInfo.from_pb(self._call(self.stub.Pin, req, timeout_s))

    def unpin(self, pin_id: int, timeout_s: float | None = None) -> PinInfo:
        """End pin ``pin_id`` (NOT_FOUND when there is no such pin)."""
        return PinInfo.from_pb(self._call(self.stub.Unpin, pb.UnpinRequest(pin_id=pin_id), timeout_s))

    def pins(self, timeout_s: float | None = None) -> list[PinInfo]:
        """The pins the node holds, oldest first."""
        resp = self._call(self.stub.ListPins, pb.ListPinsRequest(), timeout_s)
        return [PinInfo.from_pb(p) for p in resp.pins]

    def pool_info(self, timeout_s: float | None = None) -> PoolInfo:
        return PoolInfo.from_pb(self._call(self.stub.GetPoolInfo, pb.GetPoolInfoRequest(), timeout_s))

    def attach_info(self, timeout_s: float | None = None) -> PoolInfo:
        return PoolInfo.from_pb(self._call(self.stub.Attach, pb.AttachRequest(), timeout_s))

    def attach(self, timeout_s: float | None = None) -> AttachedPool:
        """Map the server's L1 pool into this process (same host)."""
        return attach_pool(self.attach_info(timeout_s))

    def watch_events(self, max_queue: int = 0, timeout_s: float | None = None) -> Iterator[Event]:
        """Snapshot, then every event (no deadline unless ``timeout_s``); ``close()`` the iterator to stop."""
        call = self.stub.WatchEvents(pb.WatchEventsRequest(max_queue=max_queue), timeout=timeout_s,
                                     metadata=self._md)
        try:
            for m in call:
                yield Event.from_pb(m)
        finally:
            call.cancel()

    # ------------------------------------------------------------------ remote peers
    def read_pages(self, tokens: Tokens, *, tenant: str = "", max_pages: int = 0,
                   timeout_s: float | None = None) -> tuple[list[bytes], bytes]:
        """Page keys and canonical page-first bytes of the cached prefix of ``tokens`` (another host)."""
        req = pb.ReadPagesRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens), max_pages=max_pages)
        keys: list[bytes] = []
        parts: list[bytes] = []
        for chunk in self.stub.ReadPages(req, timeout=self.timeout_s if timeout_s is None else timeout_s,
                                         metadata=self._md):
            keys.extend(chunk.page_keys)
            parts.append(chunk.data)
        return keys, b"".join(parts)

    def write_pages(self, tokens: Tokens, data: bytes | memoryview, *, first_page: int = 0, tenant: str = "",
                    chunk_bytes: int = 4 << 20, timeout_s: float | None = None) -> CommitResult:
        """Send page bytes (pages ``first_page..`` of ``tokens``, canonical order); the server commits them."""
        msgs = write_pages_messages(tokens, data, first_page, tenant, chunk_bytes)
        r = self.stub.WritePages(iter(msgs), timeout=self.timeout_s if timeout_s is None else timeout_s,
                                 metadata=self._md)
        return CommitResult.from_pb(r)


class MatchStream:
    """Matches over one MatchStream call, one at a time; ``close()`` ends the stream."""

    _END = object()

    def __init__(self, client: HiCacheClient) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._replies = client.stub.MatchStream(iter(self._q.get, self._END), metadata=client._md)

    def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
              skip_l3: bool = False, peek: bool = False, return_keys: bool = False) -> MatchResult:
        self._q.put(match_request(tokens, request_id, tenant, load, skip_l3, peek, return_keys))
        return MatchResult.from_pb(check_reply(next(self._replies)))

    def close(self) -> None:
        self._q.put(self._END)
        for _ in self._replies:
            pass

    def __enter__(self) -> MatchStream:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if e is None:
            self.close()
        else:
            self._replies.cancel()
