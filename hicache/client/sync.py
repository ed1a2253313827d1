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
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, TypeVar

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


class HiCacheClient(ClientBase):
    """Blocking client of one node's ``hicache.v1.HiCache`` service, over one gRPC channel (arguments:
    :class:`~hicache.client._common.ClientBase`). Calls may come from several threads at once; a
    :class:`MatchStream` may not.

    A Match the client named the request of (the caller gave no ``request_id``) and that failed after the
    node may have opened it is closed on a background thread (see :meth:`match`); :meth:`close` waits a
    little for those closings.
    """

    _grpc = grpc
    channel: grpc.Channel

    def _unary(self, call: Unary[R], timeout_s: float | None) -> R:
        """One unary call, tried again on UNAVAILABLE as :class:`RetryPolicy` says."""
        return core.run_sync(self.stub, call, self._deadline(timeout_s), self._md, self.retry)

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
        call = core.match_call(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        try:
            return self._unary(call, timeout_s)
        except BaseException:
            if call.abandon:
                self._abandon_later(call.request)
            raise

    def match_stream(self) -> MatchStream:
        """A MatchStream session (one call in flight at a time from this blocking client)."""
        return MatchStream(self)

    def prefetch(self, request_id: str, *, stream_progress: bool = False, progress_interval_ms: int = 0,
                 timeout_s: float | None = None) -> Iterator[PrefetchProgress]:
        """L3 -> L2 -> L1 for the request; yields progress (when asked) and a last ``done`` message."""
        req = core.prefetch_request(request_id, stream_progress, progress_interval_ms)
        for m in self.stub.Prefetch(req, timeout=self._deadline(timeout_s), metadata=self._md):
            yield core.prefetch_progress(m)

    def allocate(self, request_id: str, num_pages: int, timeout_s: float | None = None) -> np.ndarray:
        """``num_pages`` L1 pages (int64) owned by the open request, evicting unlocked pages if needed.

        0 pages give none (a prompt found whole on L1). NOT_FOUND: unknown or released id;
        INVALID_ARGUMENT: over the node's request limit;
        RESOURCE_EXHAUSTED: L1 cannot free that many (the rest is locked).
        """
        return self._unary(core.allocate_call(request_id, num_pages), timeout_s)

    def commit(self, request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray,
               timeout_s: float | None = None) -> CommitResult:
        """Insert the request's pages; the request stays open until :meth:`release`.

        ``tokens``: the whole sequence, matched prefix included; ``device_indices``: the L1 page of each of
        its full pages, the match's prefix pages first, then pages from :meth:`allocate`. INVALID_ARGUMENT:
        a page count that differs from the tokens'; FAILED_PRECONDITION: tokens that do not extend the
        match, or a page the request does not own; NOT_FOUND: unknown or released id.
        """
        return self._unary(core.commit_call(request_id, tokens, device_indices), timeout_s)

    def release(self, request_id: str, timeout_s: float | None = None) -> None:
        """Close the request: unlock its prefix, free pages it still owns (NOT_FOUND: unknown or released).

        Retried like a read: a repeat that finds the request gone after an attempt whose reply was lost
        returns normally (that attempt released it)."""
        self._unary(core.release_call(request_id), timeout_s)

    def stats(self, timeout_s: float | None = None) -> Stats:
        """The node's pool occupancy, hit counters, L3 counters and pins (:class:`Stats`)."""
        return self._unary(core.stats_call(), timeout_s)

    def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Wait (up to the call's deadline) until the node's backups in flight and queued L3 writes are
        done; ``complete`` says everything reached the store."""
        return self._unary(core.flush_call(), timeout_s)

    def clear(self, timeout_s: float | None = None) -> ClearResult:
        """Drop every L1 and L2 page on the node that no request holds and no pin keeps (L3 untouched)."""
        return self._unary(core.clear_call(), timeout_s)

    def pin(self, tokens: Tokens, *, tenant: str = "", timeout_s: float | None = None) -> PinInfo:
        """Keep the cached prefix of ``tokens`` on its tiers on the node until :meth:`unpin` (pins what is
        cached now; NOT_FOUND when nothing is, RESOURCE_EXHAUSTED past the node's pinned-page bound)."""
        return self._unary(core.pin_call(tokens, tenant), timeout_s)

    def unpin(self, pin_id: int, timeout_s: float | None = None) -> PinInfo:
        """End pin ``pin_id`` (NOT_FOUND when there is no such pin)."""
        return self._unary(core.unpin_call(pin_id), timeout_s)

    def pins(self, timeout_s: float | None = None) -> list[PinInfo]:
        """The pins the node holds, oldest first."""
        return self._unary(core.pins_call(), timeout_s)

    def pool_info(self, timeout_s: float | None = None) -> PoolInfo:
        """The node's KV layout and L1 pool geometry (GetPoolInfo: no handle)."""
        return self._unary(core.pool_info_call(), timeout_s)

    def attach_info(self, timeout_s: float | None = None) -> PoolInfo:
        """The Attach reply: layout plus the handle that maps the shared L1 pool (FAILED_PRECONDITION when
        the node does not share its pool); :meth:`attach` maps it."""
        return self._unary(core.attach_call(), timeout_s)

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
        out = core.PagesRead()
        for chunk in self.stub.ReadPages(core.read_pages_request(tokens, tenant, max_pages),
                                         timeout=self._deadline(timeout_s), metadata=self._md):
            out.add(chunk)
        return out.result()

    def write_pages(self, tokens: Tokens, data: bytes | memoryview, *, first_page: int = 0, tenant: str = "",
                    chunk_bytes: int = 4 << 20, timeout_s: float | None = None) -> CommitResult:
        """Send page bytes (pages ``first_page..`` of ``tokens``, canonical order); the server commits them."""
        msgs = core.write_pages_messages(tokens, data, first_page, tenant, chunk_bytes)
        r = self.stub.WritePages(iter(msgs), timeout=self._deadline(timeout_s), metadata=self._md)
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
        call = core.match_call(tokens, request_id, tenant, load, skip_l3, peek, return_keys)
        req, owned = call.request, call.owned
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
        return core.stream_match_result(m)

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
