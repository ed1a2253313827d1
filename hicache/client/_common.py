"""Everything of the node clients but the transport (:mod:`hicache.client.sync` and
:mod:`hicache.client.aio` only run what this builds, blocking or awaited).

* channel settings (:class:`ChannelSettings`), retries (:class:`RetryPolicy`, :func:`retryable`);
* every unary call as a :class:`Unary`: stub method, request, whether a repeat is safe, reply decoder and
  what an attempt's error means (:func:`match_call`, :func:`release_call`, ...), run by :func:`run_sync` /
  :func:`run_async`;
* the requests and reply decoders of the streaming calls;
* the ids of Match requests the clients name themselves (:func:`new_request_id`, :func:`may_have_opened`)
  and the mapping of stream errors (:class:`CallError`, :func:`check_reply`)."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc
import numpy as np

from hicache.client.types import (
    ClearResult,
    CommitResult,
    FlushResult,
    MatchResult,
    PinInfo,
    PoolInfo,
    PrefetchProgress,
    Stats,
)
from hicache.keys import tokens_to_bytes
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc

Tokens = bytes | np.ndarray | Sequence[int]

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Closing a Match's request the caller never learned of (see :func:`may_have_opened`): the deadline of
# each Release, and how long ``close()`` waits for such closings still under way before it ends them.
ABANDON_RELEASE_TIMEOUT_S = 2.0
ABANDON_CLOSE_WAIT_S = 2.0

log = logging.getLogger("hicache.client")


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of unary calls that failed with UNAVAILABLE: ``attempts`` tries in all, sleeping
    ``base_s * 2**i`` (jittered, capped at ``max_s``) in between, never past the call's deadline.

    gRPC says UNAVAILABLE in two cases that a retry must tell apart (:func:`retryable`):

    * no connection could be made (server down or restarting, connection refused, name not resolved):
      the call never left the client, so every call is tried again;
    * the connection dropped during the call: the server may have taken it and only the reply was lost.
      Then only calls whose repeat changes nothing are tried again: Stats, GetPoolInfo, Attach, ListPins,
      Flush, a peek Match; every other Match, which always names its ``request_id`` (the caller's, or one
      the client makes up: :func:`new_request_id`), as the server answers an identical repeat of the Match
      that opened the id, before any other call on it, with the same reply; and Release (a repeat that
      finds the request gone returns normally: the first attempt released it). Allocate (it would allocate
      twice), Commit, Pin (a second pin nobody would unpin), Unpin and Clear fail with the UNAVAILABLE
      error instead: the caller cannot know whether they took effect. (A Match sent by hand with no
      ``request_id``, which leaves the id to the server, is not retried either: it would open a second
      request.)

    Streaming calls (MatchStream, Prefetch, WatchEvents, ReadPages, WritePages) are never retried.

    The default gives up within about half a second, so an engine computes the prefix instead of waiting
    out a node restart; more ``attempts`` (with a small ``max_s``) wait for the node, up to the deadline."""

    attempts: int = 4
    base_s: float = 0.05
    max_s: float = 1.0

    def delay(self, attempt: int) -> float:
        return min(self.max_s, self.base_s * (2 ** attempt)) * (0.5 + random.random() / 2)


DEFAULT_RECONNECT_MAX_S = 2.0


@dataclass(frozen=True)
class ChannelSettings:
    target: str  # host:port
    token: str = ""  # bearer token ("" : none)
    root_certificates: str = ""  # PEM path: use TLS, trusting this CA ("" : plaintext unless tls=True)
    client_cert: str = ""  # PEM paths for mTLS
    client_key: str = ""
    tls: bool = False  # TLS with the system's roots
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Cap on the channel's wait between connection attempts. gRPC's default (1 s, growing 1.6x per failed
    # attempt up to 120 s) fails every call at once, without trying, until the current wait ends: a node
    # back after a long outage would stay unreachable for up to two minutes.
    reconnect_max_s: float = DEFAULT_RECONNECT_MAX_S

    def options(self) -> list[tuple[str, Any]]:
        """gRPC channel arguments: message size limits both ways and the reconnect wait's cap."""
        cap_ms = max(1, round(self.reconnect_max_s * 1000))
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", min(1000, cap_ms)),
                ("grpc.max_reconnect_backoff_ms", cap_ms)]

    def credentials(self) -> grpc.ChannelCredentials | None:
        if not (self.tls or self.root_certificates or self.client_cert):
            return None
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.root_certificates), read(self.client_key),
                                            read(self.client_cert))

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        return (("authorization", f"Bearer {self.token}"),) if self.token else None


def encode_tokens(tokens: Tokens) -> bytes:
    """Token ids as packed uint32 LE bytes (``bytes`` pass through: they already are)."""
    if isinstance(tokens, bytes | bytearray | memoryview):
        b = bytes(tokens)
        if len(b) % 4:
            raise ValueError("tokens: packed bytes must be a multiple of 4 (uint32 LE)")
        return b
    return tokens_to_bytes(tokens)


def ns_ref(tenant: str) -> pb.NamespaceRef | None:
    return pb.NamespaceRef(tenant=tenant) if tenant else None


def match_request(tokens: Tokens, request_id: str, tenant: str, load: bool, skip_l3: bool, peek: bool,
                  return_keys: bool) -> pb.MatchRequest:
    return pb.MatchRequest(request_id=request_id, namespace=ns_ref(tenant), tokens=encode_tokens(tokens),
                           load=load, skip_l3=skip_l3, peek=peek, return_keys=return_keys)


def commit_request(request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray) -> pb.CommitRequest:
    return pb.CommitRequest(request_id=request_id, tokens=encode_tokens(tokens),
                            device_indices=np.asarray(device_indices, dtype=np.int64).tolist())


def write_pages_messages(tokens: Tokens, data: bytes | memoryview, first_page: int, tenant: str,
                         chunk_bytes: int) -> list[pb.WritePagesChunk]:
    out = [pb.WritePagesChunk(header=pb.WritePagesHeader(namespace=ns_ref(tenant), tokens=encode_tokens(tokens),
                                                         first_page=first_page))]
    view = memoryview(data)
    out.extend(pb.WritePagesChunk(data=bytes(view[i:i + chunk_bytes])) for i in range(0, len(view), chunk_bytes))
    return out


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class CallError(Exception):
    """A request refused inside a stream (MatchStream): the status code and message the server gave; or a
    stream session that can take no more calls (it ended, was closed or cancelled, or failed)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def check_reply(m: pb.MatchResponse) -> pb.MatchResponse:
    """Raise :class:`CallError` when a MatchStream reply carries an error."""
    if m.HasField("error"):
        raise CallError(_CODES.get(m.error.code, grpc.StatusCode.UNKNOWN), m.error.message)
    return m


# How gRPC words an UNAVAILABLE that came before any connection carried the call: no address could be
# connected to, or the target's name did not resolve (older releases: "DNS resolution failed"). A lost
# connection mid-call reads differently ("Socket closed", "Connection reset", ...). An unknown wording
# counts as "may have been sent": the safe side.
_NOT_SENT = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed")


def never_sent(err: grpc.RpcError) -> bool:
    """Whether ``err`` says the call never reached a server (no connection could be made)."""
    details = getattr(err, "details", None)
    text = details() if callable(details) else ""
    return any(s in (text or "") for s in _NOT_SENT)


def retryable(err: grpc.RpcError, idempotent: bool) -> bool:
    """Whether a unary call that failed with ``err`` may be sent again (see :class:`RetryPolicy`):
    UNAVAILABLE, and either ``idempotent`` (a repeat changes nothing) or the call never reached a server."""
    code = getattr(err, "code", None)  # grpc.Call (blocking client) and grpc.aio.AioRpcError both have it
    if not callable(code) or code() != grpc.StatusCode.UNAVAILABLE:
        return False
    return idempotent or never_sent(err)


R = TypeVar("R")


def retry_pause(e: Any, attempt: int, end: float, retry: RetryPolicy, idempotent: bool,
                final: Callable[[Any], bool] | None) -> float | None:
    """How long to wait before trying a call again after its ``attempt``-th try failed with ``e`` (None:
    not again: not :func:`retryable`, ``final``, out of attempts, or the wait would pass ``end``)."""
    if not retryable(e, idempotent) or (final is not None and final(e)) or attempt >= retry.attempts:
        return None
    pause = retry.delay(attempt - 1)
    return None if time.monotonic() + pause >= end else pause


def call_sync(method: Callable[..., R], request: Any, timeout_s: float, metadata: Any, retry: RetryPolicy,
              idempotent: bool, final: Callable[[grpc.RpcError], bool] | None = None,
              failed: Callable[[BaseException], Any | None] | None = None) -> R:
    """One blocking unary call, tried again on UNAVAILABLE as ``retry`` says (:func:`retryable`), within
    ``timeout_s`` in all; ``final``: errors not to retry even so (a server's own refusal); ``failed``:
    sees every attempt's error and may return a reply to use instead (:meth:`Unary.failed`)."""
    end = time.monotonic() + timeout_s
    attempt = 0
    while True:
        try:
            return method(request, timeout=max(0.001, end - time.monotonic()), metadata=metadata)
        except BaseException as e:
            reply = failed(e) if failed is not None else None
            if reply is not None:
                return reply  # type: ignore[no-any-return]
            if not isinstance(e, grpc.RpcError):
                raise
            attempt += 1
            pause = retry_pause(e, attempt, end, retry, idempotent, final)
            if pause is None:
                raise
            time.sleep(pause)


async def call_async(method: Callable[..., Awaitable[R]], request: Any, timeout_s: float, metadata: Any,
                     retry: RetryPolicy, idempotent: bool,
                     final: Callable[[grpc.aio.AioRpcError], bool] | None = None,
                     failed: Callable[[BaseException], Any | None] | None = None) -> R:
    """:func:`call_sync` for an asyncio stub."""
    end = time.monotonic() + timeout_s
    attempt = 0
    while True:
        try:
            return await method(request, timeout=max(0.001, end - time.monotonic()), metadata=metadata)
        except BaseException as e:
            reply = failed(e) if failed is not None else None
            if reply is not None:
                return reply  # type: ignore[no-any-return]
            if not isinstance(e, grpc.aio.AioRpcError):
                raise
            attempt += 1
            pause = retry_pause(e, attempt, end, retry, idempotent, final)
            if pause is None:
                raise
            await asyncio.sleep(pause)


def match_idempotent(req: pb.MatchRequest) -> bool:
    """A Match may be repeated after a lost reply when it opens nothing (peek) or names its request."""
    return req.peek or bool(req.request_id)


def new_request_id() -> str:
    """An id for a Match whose caller names none: 32 hex digits (``uuid4``), well within the node's bound
    on ids (128 bytes, :mod:`hicache.service.requests`) and never one another client chose."""
    return uuid.uuid4().hex


# Codes with which the node refuses a Match before opening anything (validation, a foreign namespace, no
# room or too many calls in flight, an id already open, authentication, an unknown method): the servicer
# validates first and drops the id when opening fails.
_REFUSED = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS,
                      grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                      grpc.StatusCode.UNIMPLEMENTED})
# ... but this RESOURCE_EXHAUSTED comes from the client's own channel, refusing a reply over its size limit:
# the node had answered, so it had opened the request.
_REPLY_TOO_LARGE = "Received message larger than max"


def may_have_opened(err: BaseException) -> bool:
    """Whether a (non-peek) Match that ended with ``err`` may have opened its request on the node.

    No after a refusal (see ``_REFUSED``) and after an UNAVAILABLE that never reached a node
    (:func:`never_sent`); yes after anything else: DEADLINE_EXCEEDED and CANCELLED (the node may have
    opened it, or still be opening it, when the call ended), a connection lost mid-call, INTERNAL or
    UNKNOWN, a reply too large to receive, the caller's cancellation or an interruption."""
    code = getattr(err, "code", None)
    if not isinstance(err, grpc.RpcError | CallError) or not callable(code):
        return True
    c = code()
    if c == grpc.StatusCode.UNAVAILABLE:
        return not never_sent(err)
    if c == grpc.StatusCode.RESOURCE_EXHAUSTED:
        details = getattr(err, "details", None)
        return _REPLY_TOO_LARGE in ((details() if callable(details) else "") or "")
    return c not in _REFUSED


# ---------------------------------------------------------------------------------------------- unary calls
class Unary(Generic[R]):
    """One unary call, transport-free: the stub's ``method`` (by name), its ``request``, ``idempotent``
    (a repeat after a lost reply changes nothing: see :class:`RetryPolicy`) and ``decode`` (reply ->
    result). One object per call: :meth:`failed` may keep state across its attempts."""

    def __init__(self, method: str, request: Any, decode: Callable[[Any], R], idempotent: bool) -> None:
        self.method = method
        self.request = request
        self.decode = decode
        self.idempotent = idempotent

    def failed(self, e: BaseException) -> Any | None:
        """Called with each attempt's error (a cancellation or interruption included): a reply to use
        instead, or None (the error stands, and is retried or raised)."""
        return None


class MatchCall(Unary[MatchResult]):
    """A Match. ``owned``: the client made up its ``request_id`` (the caller gave none, not a peek); then,
    when the call fails, ``abandon`` says whether an attempt may have opened the request on the node
    (:func:`may_have_opened`), which the client must then release (nobody else knows the id)."""

    def __init__(self, req: pb.MatchRequest, owned: bool) -> None:
        super().__init__("Match", req, MatchResult.from_pb, match_idempotent(req))
        self.owned = owned
        self.abandon = False

    def failed(self, e: BaseException) -> None:
        self.abandon = self.abandon or (self.owned and may_have_opened(e))
        return None


def match_call(tokens: Tokens, request_id: str, tenant: str, load: bool, skip_l3: bool, peek: bool,
               return_keys: bool) -> MatchCall:
    """A Match; with no ``request_id`` (and not ``peek``) under an id the client makes up."""
    owned = not request_id and not peek
    req = match_request(tokens, new_request_id() if owned else request_id, tenant, load, skip_l3, peek,
                        return_keys)
    return MatchCall(req, owned)


class _Release(Unary[None]):
    """Release, retried like a read: a repeat that finds the request gone after an attempt that may have
    reached the node returns normally (that attempt released it)."""

    def __init__(self, request_id: str) -> None:
        super().__init__("Release", pb.ReleaseRequest(request_id=request_id), lambda r: None, True)
        self._maybe_taken = False

    def failed(self, e: BaseException) -> pb.ReleaseResponse | None:
        if not isinstance(e, grpc.RpcError):
            return None
        if self._maybe_taken and e.code() == grpc.StatusCode.NOT_FOUND:
            return pb.ReleaseResponse()
        self._maybe_taken = self._maybe_taken or not never_sent(e)
        return None


def release_call(request_id: str) -> Unary[None]:
    return _Release(request_id)


def _device_indices(r: pb.AllocateResponse) -> np.ndarray:
    return np.asarray(r.device_indices, dtype=np.int64)


def _pins(r: pb.ListPinsResponse) -> list[PinInfo]:
    return [PinInfo.from_pb(p) for p in r.pins]


def allocate_call(request_id: str, num_pages: int) -> Unary[np.ndarray]:
    return Unary("Allocate", pb.AllocateRequest(request_id=request_id, num_pages=num_pages), _device_indices, False)


def commit_call(request_id: str, tokens: Tokens, device_indices: Sequence[int] | np.ndarray) -> Unary[CommitResult]:
    return Unary("Commit", commit_request(request_id, tokens, device_indices), CommitResult.from_pb, False)


def stats_call() -> Unary[Stats]:
    return Unary("Stats", pb.StatsRequest(), Stats.from_pb, True)


def flush_call() -> Unary[FlushResult]:
    return Unary("Flush", pb.FlushRequest(), FlushResult.from_pb, True)


def clear_call() -> Unary[ClearResult]:
    return Unary("Clear", pb.ClearRequest(), ClearResult.from_pb, False)


def pin_call(tokens: Tokens, tenant: str) -> Unary[PinInfo]:
    return Unary("Pin", pb.PinRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens)), PinInfo.from_pb,
                 False)


def unpin_call(pin_id: int) -> Unary[PinInfo]:
    return Unary("Unpin", pb.UnpinRequest(pin_id=pin_id), PinInfo.from_pb, False)


def pins_call() -> Unary[list[PinInfo]]:
    return Unary("ListPins", pb.ListPinsRequest(), _pins, True)


def pool_info_call() -> Unary[PoolInfo]:
    return Unary("GetPoolInfo", pb.GetPoolInfoRequest(), PoolInfo.from_pb, True)


def attach_call() -> Unary[PoolInfo]:
    return Unary("Attach", pb.AttachRequest(), PoolInfo.from_pb, True)


def run_sync(stub: Any, call: Unary[R], timeout_s: float, metadata: Any, retry: RetryPolicy) -> R:
    """``call`` on a blocking stub, with retries (:func:`call_sync`)."""
    return call.decode(call_sync(getattr(stub, call.method), call.request, timeout_s, metadata, retry,
                                 call.idempotent, failed=call.failed))


async def run_async(stub: Any, call: Unary[R], timeout_s: float, metadata: Any, retry: RetryPolicy) -> R:
    """``call`` on an asyncio stub, with retries (:func:`call_async`)."""
    return call.decode(await call_async(getattr(stub, call.method), call.request, timeout_s, metadata, retry,
                                        call.idempotent, failed=call.failed))


class ClientBase:
    """What both node clients hold: channel settings, default deadline, retries, the channel (of
    ``_grpc``: ``grpc`` or ``grpc.aio``) and its stub, and the closings of requests a failed Match under a
    client-made id may have opened (see ``match``).

    ``timeout_s``: default deadline of unary calls, ``prefetch``, ``read_pages`` and ``write_pages``;
    ``retry``: backoff for unary calls failing with UNAVAILABLE (when a retry is safe: see
    :class:`RetryPolicy`); ``token``: sent as ``authorization: Bearer``;
    ``root_certificates`` / ``client_cert`` / ``client_key``: PEM file paths (TLS, mTLS); ``tls``: TLS with
    the system's roots; ``reconnect_max_s``: the longest wait between connection attempts to a node that
    went away (gRPC's own default grows to 120 s)."""

    _grpc: Any

    def __init__(self, target: str, *, token: str = "", timeout_s: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, root_certificates: str = "", client_cert: str = "",
                 client_key: str = "", tls: bool = False, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 reconnect_max_s: float = DEFAULT_RECONNECT_MAX_S) -> None:
        self.settings = ChannelSettings(target, token, root_certificates, client_cert, client_key, tls,
                                        max_message_bytes, reconnect_max_s)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        creds = self.settings.credentials()
        opts = self.settings.options()
        self.channel = (self._grpc.secure_channel(target, creds, options=opts) if creds is not None
                        else self._grpc.insecure_channel(target, options=opts))
        self.stub = pb_grpc.HiCacheStub(self.channel)
        self._md = self.settings.metadata()
        self._abandoning: set[Any] = set()  # threads / tasks closing requests no reply named
        self._abandoning_lock = threading.Lock()

    def _deadline(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s


# ---------------------------------------------------------------------------------------------- streams
def prefetch_request(request_id: str, stream_progress: bool, progress_interval_ms: int) -> pb.PrefetchRequest:
    return pb.PrefetchRequest(request_id=request_id, stream_progress=stream_progress,
                              progress_interval_ms=progress_interval_ms)


def prefetch_progress(m: pb.PrefetchProgress) -> PrefetchProgress:
    return PrefetchProgress.from_pb(m)


def read_pages_request(tokens: Tokens, tenant: str, max_pages: int) -> pb.ReadPagesRequest:
    return pb.ReadPagesRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens), max_pages=max_pages)


class PagesRead:
    """ReadPages' chunks as they come (:meth:`add`), then :meth:`result`: page keys and page bytes."""

    def __init__(self) -> None:
        self.keys: list[bytes] = []
        self._parts: list[bytes] = []

    def add(self, chunk: pb.PageChunk) -> None:
        self.keys.extend(chunk.page_keys)
        self._parts.append(chunk.data)

    def result(self) -> tuple[list[bytes], bytes]:
        return self.keys, b"".join(self._parts)


def stream_match_result(m: pb.MatchResponse) -> MatchResult:
    """A MatchStream reply as a result (:class:`CallError` when it carries a refusal)."""
    return MatchResult.from_pb(check_reply(m))
