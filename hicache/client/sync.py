"""Blocking client of the node service.

    with HiCacheClient("127.0.0.1:50051") as c:
        m = c.match(tokens, request_id="r1")            # MatchResult; L1 prefix locked for "r1"
        pages = c.allocate("r1", n_new_pages)            # np.int64 L1 pages owned by "r1" (none for 0)
        ...                                              # compute KV into them (c.attach() maps the pool)
        c.commit("r1", tokens, np.concatenate([m.device_indices, pages]))
        c.release("r1")

Unary calls, ``prefetch``, ``read_pages`` and ``write_pages`` have a deadline (``timeout_s``, default
10 s); ``watch_events`` and ``match_stream`` have none by default. Unary calls that fail with UNAVAILABLE
are retried with exponential backoff when that is safe: always when no connection could be made, and
after a connection lost mid-call only when a repeat changes nothing (:class:`RetryPolicy` lists which
calls). Errors surface as ``grpc.RpcError`` with
the server's status code and message; a refusal inside a ``match_stream`` session raises
:class:`~hicache.client.CallError` with the same code and message.

A Match that opens a request (not a peek) always names its id: when the caller gives none, the client
makes one up (:func:`~hicache.client._common.new_request_id`), and the result carries it as before. So when
such a Match fails after the node may have opened the request (its deadline passed, the connection
dropped, the call was interrupted), the client can close it: it releases the id on the node in the
background (best effort; failures are logged at debug level) rather than leave the request and the pages
it locks open until the node's idle expiry. An id the caller named stays the caller's to release.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
import numpy as np

from hicache.client._common import (
    ABANDON_CLOSE_WAIT_S,
    ABANDON_RELEASE_TIMEOUT_S,
    DEFAULT_RECONNECT_MAX_S,
    DEFAULT_TIMEOUT_S,
    CallError,
    ChannelSettings,
    RetryPolicy,
    Tokens,
    call_sync,
    check_reply,
    commit_request,
    encode_tokens,
    log,
    match_idempotent,
    match_request,
    may_have_opened,
    never_sent,
    new_request_id,
    ns_ref,
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


class _Attempts:
    """Wraps the stub's Match for :meth:`HiCacheClient._call`: remembers whether any attempt may have
    opened the request (:func:`may_have_opened`), so that a Match failing after a retry still knows."""

    def __init__(self, method: Callable[..., pb.MatchResponse]) -> None:
        self.method = method
        self.may_have_opened = False

    def __call__(self, request: pb.MatchRequest, **kw: Any) -> pb.MatchResponse:
        try:
            return self.method(request, **kw)
        except BaseException as e:
            self.may_have_opened = self.may_have_opened or may_have_opened(e)
            raise


class HiCacheClient:
    """Blocking client of one node's ``hicache.v1.HiCache`` service, over one gRPC channel.

    ``timeout_s``: default deadline of unary calls, ``prefetch``, ``read_pages`` and ``write_pages``;
    ``retry``: backoff for unary calls failing with UNAVAILABLE (when a retry is safe: see
    :class:`RetryPolicy`); ``token``: sent as ``authorization: Bearer``;
    ``root_certificates`` / ``client_cert`` / ``client_key``: PEM file paths (TLS, mTLS); ``tls``: TLS with
    the system's roots; ``reconnect_max_s``: the longest wait between connection attempts to a node that
    went away (gRPC's own default grows to 120 s). Calls may come from several threads at once; a
    :class:`MatchStream` may not.

    A Match the client named the request of (the caller gave no ``request_id``) and that failed after the
    node may have opened it is closed on a background thread (see :meth:`match`); :meth:`close` waits a
    little for those closings.
    """

    def __init__(self, target: str, *, token: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, root_certificates: str = "", client_cert: str = "",
                 client_key: str = "", tls: bool = False, max_message_bytes: int = 64 << 20,
                 reconnect_max_s: float = DEFAULT_RECONNECT_MAX_S) -> None:
        self.settings = ChannelSettings(target, token, root_certificates, client_cert, client_key, tls,
                                        max_message_bytes, reconnect_max_s)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        creds = self.settings.credentials()
        opts = self.settings.options()
        self.channel = (grpc.secure_channel(target, creds, options=opts) if creds is not None
                        else grpc.insecure_channel(target, options=opts))
        self.stub = pb_grpc.HiCacheStub(self.channel)
        self._md = self.settings.metadata()
        self._abandoning: set[threading.Thread] = set()  # closings of requests no reply named (see match)
        self._abandoning_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: Callable[..., R], request: Any, timeout_s: float | None, *,
              idempotent: bool = False) -> R:
        """One unary call, tried again on UNAVAILABLE as :class:`RetryPolicy` says (``idempotent``: a
        repeat changes nothing, so it may follow a failure after the server took the call; by default
        a call is not)."""
        return call_sync(method, request, self.timeout_s if timeout_s is None else timeout_s, self._md, self.retry,
                         idempotent)

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects (``grpc.FutureTimeoutError`` after ``timeout_s``)."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def close(self) -> None:
        """Close the channel; calls still active on it are ended. First waits (up to
        ``ABANDON_CLOSE_WAIT_S`` in all) for the closings of requests a failed Match may have opened (see
        :meth:`match`)."""
        end = time.monotonic() + ABANDON_CLOSE_WAIT_S
        with self._abandoning_lock:
            pending = list(self._abandoning)
        for t in pending:
            t.join(max(0.0, end - time.monotonic()))
        self.channel.close()

    def _abandon_later(self, req: pb.MatchRequest) -> None:
        """Close, on a background thread, the request a failed Match under a client-made id may have
        opened (:meth:`_abandon`)."""
        t = threading.Thread(target=self._abandon, args=(req,), name="hicache-abandon", daemon=True)
        with self._abandoning_lock:
            self._abandoning.add(t)
        t.start()

    def _abandon(self, req: pb.MatchRequest) -> None:
        """Best effort: release ``req.request_id``, an id this client made up for a Match whose reply it
        never got. A Match still opening the id on the node (an L3 lookup, a load) is waited for there, and
        what it opened is released; NOT_FOUND means it opened nothing. Errors are logged at debug level,
        never raised (the node's idle expiry closes what a failed release leaves)."""
        rid = req.request_id
        try:
            self.release(rid, timeout_s=ABANDON_RELEASE_TIMEOUT_S)
            log.debug("match %s: released the request its lost reply named", rid)
        except Exception as e:
            log.debug("match %s: no request released: %s", rid, e)
        finally:
            with self._abandoning_lock:
                self._abandoning.discard(threading.current_thread())

    def __enter__(self) -> HiCacheClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ request API
    def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
              skip_l3: bool = False, peek: bool = False, return_keys: bool = False,
              timeout_s: float | None = None) -> MatchResult:
        """Longest cached prefix; opens a request (the returned ``request_id``) unless ``peek``.

        With no ``request_id`` (and not ``peek``) the client makes one up (:func:`new_request_id`) and sends
        it: the reply names it as before. Then the call is retried after a connection lost mid-call like
        any Match naming its id (the node answers the repeat with the first reply, no second request), and
        when it fails in a way that may have left the request open on the node (DEADLINE_EXCEEDED,
        CANCELLED, a connection lost, an interruption: :func:`may_have_opened`), the client releases the
        id in the background and raises the error; a refusal (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)
        opened nothing and leaves nothing to release, unless an earlier attempt of the same call may have
        (a retry refused with ALREADY_EXISTS, from a node that does not answer repeats, found the id open
        under that attempt: it is released too). A ``request_id`` the caller names is the caller's to
        release in every case.
        """
        owned = not request_id and not peek
        req = match_request(tokens, new_request_id() if owned else request_id, tenant, load, skip_l3, peek,
                            return_keys)
        if not owned:
            return MatchResult.from_pb(self._call(self.stub.Match, req, timeout_s, idempotent=match_idempotent(req)))
        attempts = _Attempts(self.stub.Match)
        try:
            return MatchResult.from_pb(self._call(attempts, req, timeout_s, idempotent=True))
        except BaseException:
            if attempts.may_have_opened:
                self._abandon_later(req)
            raise

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
        """``num_pages`` L1 pages (int64) owned by the open request, evicting unlocked pages if needed.

        0 pages give none (a prompt found whole on L1). NOT_FOUND: unknown or released id;
        INVALID_ARGUMENT: over the node's request limit;
        RESOURCE_EXHAUSTED: L1 cannot free that many (the rest is locked).
        """
        r = self._call(self.stub.Allocate, pb.AllocateRequest(request_id=request_id, num_pages=num_pages), timeout_s,
                       idempotent=False)
        return np.asarray(r.device_indices, dtype=np.int64)

    def commit(self, request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray,
               timeout_s: float | None = None) -> CommitResult:
        """Insert the request's pages; the request stays open until :meth:`release`.

        ``tokens``: the whole sequence, matched prefix included; ``device_indices``: the L1 page of each of
        its full pages, the match's prefix pages first, then pages from :meth:`allocate`. INVALID_ARGUMENT:
        a page count that differs from the tokens'; FAILED_PRECONDITION: tokens that do not extend the
        match, or a page the request does not own; NOT_FOUND: unknown or released id.
        """
        return CommitResult.from_pb(self._call(self.stub.Commit, commit_request(request_id, tokens, device_indices),
                                               timeout_s, idempotent=False))

    def release(self, request_id: str, timeout_s: float | None = None) -> None:
        """Close the request: unlock its prefix, free pages it still owns (NOT_FOUND: unknown or released).

        Retried like a read: a repeat that finds the request gone after an attempt whose reply was lost
        returns normally (that attempt released it)."""
        maybe_taken = False  # an earlier attempt may have reached the server

        def once(request: pb.ReleaseRequest, **kw: Any) -> pb.ReleaseResponse:
            nonlocal maybe_taken
            try:
                return self.stub.Release(request, **kw)
            except grpc.RpcError as e:
                if maybe_taken and e.code() == grpc.StatusCode.NOT_FOUND:
                    return pb.ReleaseResponse()
                maybe_taken = maybe_taken or not never_sent(e)
                raise

        self._call(once, pb.ReleaseRequest(request_id=request_id), timeout_s, idempotent=True)

    def stats(self, timeout_s: float | None = None) -> Stats:
        """The node's pool occupancy, hit counters, L3 counters and pins (:class:`Stats`)."""
        return Stats.from_pb(self._call(self.stub.Stats, pb.StatsRequest(), timeout_s, idempotent=True))

    def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Wait (up to the call's deadline) until the node's backups in flight and queued L3 writes are
        done; ``complete`` says everything reached the store."""
        return FlushResult.from_pb(self._call(self.stub.Flush, pb.FlushRequest(), timeout_s, idempotent=True))

    def clear(self, timeout_s: float | None = None) -> ClearResult:
        """Drop every L1 and L2 page on the node that no request holds and no pin keeps (L3 untouched)."""
        return ClearResult.from_pb(self._call(self.stub.Clear, pb.ClearRequest(), timeout_s, idempotent=False))

    def pin(self, tokens: Tokens, *, tenant: str = "", timeout_s: float | None = None) -> PinInfo:
        """Keep the cached prefix of ``tokens`` on its tiers on the node until :meth:`unpin` (pins what is
        cached now; NOT_FOUND when nothing is, RESOURCE_EXHAUSTED past the node's pinned-page bound)."""
        req = pb.PinRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens))
        return PinInfo.from_pb(self._call(self.stub.Pin, req, timeout_s, idempotent=False))

    def unpin(self, pin_id: int, timeout_s: float | None = None) -> PinInfo:
        """End pin ``pin_id`` (NOT_FOUND when there is no such pin)."""
        return PinInfo.from_pb(self._call(self.stub.Unpin, pb.UnpinRequest(pin_id=pin_id), timeout_s,
                                          idempotent=False))

    def pins(self, timeout_s: float | None = None) -> list[PinInfo]:
        """The pins the node holds, oldest first."""
        resp = self._call(self.stub.ListPins, pb.ListPinsRequest(), timeout_s, idempotent=True)
        return [PinInfo.from_pb(p) for p in resp.pins]

    def pool_info(self, timeout_s: float | None = None) -> PoolInfo:
        """The node's KV layout and L1 pool geometry (GetPoolInfo: no handle)."""
        return PoolInfo.from_pb(self._call(self.stub.GetPoolInfo, pb.GetPoolInfoRequest(), timeout_s,
                                           idempotent=True))

    def attach_info(self, timeout_s: float | None = None) -> PoolInfo:
        """The Attach reply: layout plus the handle that maps the shared L1 pool (FAILED_PRECONDITION when
        the node does not share its pool); :meth:`attach` maps it."""
        return PoolInfo.from_pb(self._call(self.stub.Attach, pb.AttachRequest(), timeout_s, idempotent=True))

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
    """Matches over one MatchStream call, one at a time; ``close()`` ends the stream.

    A call interrupted while it waits for its reply (a signal handler raising, ``KeyboardInterrupt``)
    leaves that reply due on the stream, where the next call would take it for its own. So the stream is
    cancelled then, and later calls raise :class:`CallError` (CANCELLED): open a new session. Likewise
    once the stream has failed, ended or been closed, every later call raises at once.

    As in :meth:`HiCacheClient.match`, a Match with no ``request_id`` (not a peek) goes out under an id
    the client made up; when its call is interrupted or the stream fails or ends before its reply, the
    client releases that id over the session's client in the background (the node may have opened it).
    """

    _END = object()

    def __init__(self, client: HiCacheClient) -> None:
        self._client = client
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._replies = client.stub.MatchStream(iter(self._q.get, self._END), metadata=client._md)
        self._failure: BaseException | None = None  # set once no more calls can be made: what they raise

    def match(self, tokens: Tokens, request_id: str = "", *, tenant: str = "", load: bool = False,
              skip_l3: bool = False, peek: bool = False, return_keys: bool = False) -> MatchResult:
        """As :meth:`HiCacheClient.match`, over the stream (no deadline, no retry); blocks for the reply.

        A refused request raises :class:`CallError` and the stream goes on; a failed stream raises
        ``grpc.RpcError`` (and so does every later call); a stream that ended, was closed or was cancelled
        raises :class:`CallError`. With no ``request_id`` (not a peek) the client makes one up, and
        releases it when the call fails before its reply (see :class:`MatchStream`).
        """
        owned = not request_id and not peek
        req = match_request(tokens, new_request_id() if owned else request_id, tenant, load, skip_l3, peek,
                            return_keys)
        if self._failure is not None:
            raise self._failure
        self._q.put(req)
        try:
            m = next(self._replies)
        except StopIteration:
            self._failure = CallError(grpc.StatusCode.UNAVAILABLE, "match stream ended")
            self._q.put(self._END)  # lets gRPC's request thread, waiting for the next request, finish
            if owned:
                self._client._abandon_later(req)
            raise self._failure from None
        except grpc.RpcError as e:  # the stream failed: later calls raise the same
            self._failure = e
            self._q.put(self._END)
            if owned and may_have_opened(e):
                self._client._abandon_later(req)
            raise
        except BaseException as e:  # interrupted while the reply is due: no later call may take it
            self._failure = CallError(grpc.StatusCode.CANCELLED,
                                      f"match stream: an earlier call was interrupted ({type(e).__name__}) "
                                      "while its reply was due; the stream was cancelled")
            self._q.put(self._END)
            self._replies.cancel()
            if owned:
                self._client._abandon_later(req)
            raise
        return MatchResult.from_pb(check_reply(m))

    def close(self) -> None:
        """End the request side of the stream and wait for the server to end its side (at once when the
        stream has already failed). Never raises: a stream the server ended with an error (cancelled at
        its shutdown) is closed all the same. Later calls raise :class:`CallError`."""
        failed = self._failure is not None
        if not failed:
            self._failure = CallError(grpc.StatusCode.FAILED_PRECONDITION, "match stream closed")
        self._q.put(self._END)
        if failed:
            self._replies.cancel()
            return
        with contextlib.suppress(grpc.RpcError):
            for _ in self._replies:
                pass

    def __enter__(self) -> MatchStream:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if e is None:
            self.close()
        else:
            if self._failure is None:
                self._failure = CallError(grpc.StatusCode.CANCELLED, "match stream cancelled")
            self._q.put(self._END)  # else gRPC's request thread waits for a next request forever
            self._replies.cancel()
