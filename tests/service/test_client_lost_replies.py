"""A Match that opens a request under no caller-given id, whose reply never reaches the caller.

The clients name such a request themselves (the node would otherwise make up an id only its reply names),
so when the reply is lost (it came after the deadline, the connection dropped, the caller's task was
cancelled, a blocking stream call was interrupted) they can still release it: the node is left with no
open request long before its idle expiry (10 minutes here). After a lost connection the Match is sent
again and gets the first reply (one request, not two). A peek opens nothing and names no id; a refused
Match opened nothing and sends no Release.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.client import AsyncHiCacheClient, HiCacheClient, RetryPolicy
from hicache.client._common import may_have_opened, new_request_id
from hicache.config import config_from_dict
from hicache.service.server import NodeServer
from hicache.storage.base import StorageContext
from hicache.storage.memory import MemoryBackend
from tcpproxy import TcpProxy

from .service_harness import ServerProc

PS = 16
C = grpc.StatusCode
LAG_S = 1.0  # the node's replies reach the client this late
DEADLINE_S = 0.3  # ... past the calls' deadline


def tokens(seed: int, n: int = 4 * PS) -> np.ndarray:
    return np.random.default_rng(11_000 + seed).integers(0, 30_000, n).astype(np.uint32)


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProc]) -> ServerProc:
    return server_factory()


@pytest.fixture
def proxy(srv: ServerProc) -> Iterator[TcpProxy]:
    with TcpProxy(srv.port) as p:
        yield p


class Node:
    """A client straight to the node (no proxy), counting the requests opened since the test began."""

    def __init__(self, c: HiCacheClient) -> None:
        self.c = c
        self.before = c.stats().open_requests

    def opened(self) -> int:
        return self.c.stats().open_requests - self.before

    def left_open(self, timeout_s: float = 6.0) -> int:
        """Requests opened since the test began once none is, or as many as there are after ``timeout_s``
        (far below the node's idle expiry: only a release by the client closes them)."""
        end = time.monotonic() + timeout_s
        while (n := self.opened()) and time.monotonic() < end:
            time.sleep(0.05)
        return n


@pytest.fixture
def node(srv: ServerProc) -> Iterator[Node]:
    with HiCacheClient(srv.target) as c:
        yield Node(c)


def test_a_reply_that_comes_after_the_deadline_leaves_no_request_open(proxy: TcpProxy, node: Node) -> None:
    with HiCacheClient(proxy.target) as c:
        c.stats()  # connected
        proxy.lag_s = LAG_S
        with pytest.raises(grpc.RpcError) as ei:
            c.match(tokens(1), timeout_s=DEADLINE_S)  # the node opened the request at once
        assert ei.value.code() == C.DEADLINE_EXCEEDED
        proxy.lag_s = 0.0
        assert node.left_open() == 0


def test_a_cancelled_asyncio_match_leaves_no_request_open(proxy: TcpProxy, node: Node) -> None:
    async def main() -> None:
        async with AsyncHiCacheClient(proxy.target) as c:
            await c.stats()
            proxy.lag_s = LAG_S
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):  # the cancellation reaches the caller, at once
                await asyncio.wait_for(c.match(tokens(2)), DEADLINE_S)
            assert time.monotonic() - t0 < LAG_S
            proxy.lag_s = 0.0
            assert await asyncio.to_thread(node.left_open) == 0

    asyncio.run(main())


def test_a_match_whose_connection_dropped_is_sent_again_and_opens_one_request(proxy: TcpProxy,
                                                                              node: Node) -> None:
    with HiCacheClient(proxy.target, retry=RetryPolicy(attempts=20, base_s=0.05, max_s=0.2)) as c:
        c.stats()
        proxy.drop_next_reply()
        m = c.match(tokens(3))  # the node opened it; the reply was lost with the connection
        assert proxy.drops == 1 and m.num_pages == 4
        assert node.opened() == 1  # the repeat got the first reply: no second request
        c.release(m.request_id)


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_asyncio_stream_call_cancelled_while_its_reply_is_due_leaves_no_request_open(
        proxy: TcpProxy, node: Node, pipelined: bool) -> None:
    async def main() -> None:
        async with AsyncHiCacheClient(proxy.target) as c:
            s = c.match_stream(pipelined=pipelined)
            await s.match(tokens(4), peek=True)
            proxy.lag_s = LAG_S
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(s.match(tokens(4)), DEADLINE_S)
            proxy.lag_s = 0.0
            assert (await s.match(tokens(5), peek=True)).num_pages == 4  # the session goes on
            assert await asyncio.to_thread(node.left_open) == 0
            await s.close()

    asyncio.run(main())


class Interrupted(BaseException):
    """What a signal handler may raise in a thread blocked on a reply (KeyboardInterrupt and the like)."""


class _InterruptedOnceAnswered:
    """Stands in for the blocking stream's reply iterator: the first wait is interrupted once the node has
    had time to answer (the reply is due, never taken)."""

    def __init__(self, replies: Any) -> None:
        self._replies = replies
        self._interrupt = True

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._interrupt:
            self._interrupt = False
            time.sleep(0.3)
            raise Interrupted
        return next(self._replies)

    def cancel(self) -> bool:
        return bool(self._replies.cancel())


def test_an_interrupted_blocking_stream_call_leaves_no_request_open(srv: ServerProc, node: Node) -> None:
    with HiCacheClient(srv.target) as c:
        s = c.match_stream()
        s.match(tokens(6), peek=True)
        s._replies = _InterruptedOnceAnswered(s._replies)  # type: ignore[assignment]
        with pytest.raises(Interrupted):
            s.match(tokens(6))
        assert node.left_open() == 0


class _Spy:
    """Calls through to one RPC of a blocking client's stub, keeping the requests."""

    def __init__(self, c: HiCacheClient, name: str) -> None:
        self.real = getattr(c.stub, name)
        self.requests: list[Any] = []
        setattr(c.stub, name, self)

    def __call__(self, request: Any, **kw: Any) -> Any:
        self.requests.append(request)
        return self.real(request, **kw)


def test_the_client_names_a_match_request_and_a_peek_names_none(srv: ServerProc, node: Node) -> None:
    with HiCacheClient(srv.target) as c:
        match = _Spy(c, "Match")
        release = _Spy(c, "Release")
        assert c.match(tokens(7), peek=True).request_id == ""
        assert match.requests[-1].request_id == ""
        m = c.match(tokens(7))
        assert len(m.request_id) == 32 and match.requests[-1].request_id == m.request_id
        other = c.match(tokens(8)).request_id
        assert other not in ("", m.request_id)
        assert c.match(tokens(7), "mine").request_id == "mine"
        assert node.opened() == 3
        with pytest.raises(grpc.RpcError) as ei:  # refused before anything opened: nothing to release
            c.match(tokens(9), tenant="t" * 300)
        assert ei.value.code() == C.INVALID_ARGUMENT
        time.sleep(0.2)
        assert release.requests == []
        for rid in (m.request_id, other, "mine"):
            c.release(rid)


def test_which_failures_may_have_opened_a_request() -> None:
    def err(code: grpc.StatusCode, details: str = "") -> grpc.RpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    for code in (C.DEADLINE_EXCEEDED, C.CANCELLED, C.INTERNAL, C.UNKNOWN):
        assert may_have_opened(err(code))
    assert may_have_opened(err(C.UNAVAILABLE, "Socket closed"))
    assert not may_have_opened(err(C.UNAVAILABLE, "failed to connect to all addresses; ..."))
    for code in (C.INVALID_ARGUMENT, C.FAILED_PRECONDITION, C.ALREADY_EXISTS, C.UNAUTHENTICATED):
        assert not may_have_opened(err(code))
    assert not may_have_opened(err(C.RESOURCE_EXHAUSTED, "more than 8 RPCs in flight"))
    assert may_have_opened(err(C.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)"))
    assert may_have_opened(asyncio.CancelledError()) and may_have_opened(KeyboardInterrupt())
    assert new_request_id() != new_request_id() and len(new_request_id().encode()) <= 128


LOOKUP_S = 1.0  # each L3 lookup of the slow store


class SlowLookups(MemoryBackend):
    def batch_exists(self, keys: Sequence[bytes]) -> int:
        time.sleep(LOOKUP_S)
        return super().batch_exists(keys)


def test_a_match_whose_deadline_passes_during_its_l3_lookup_leaves_no_request_open() -> None:
    """The deadline passes while the node's worker still looks the prompt up on L3: the request opens only
    after the call ended. The client's Release at once finds the id still opening; the node waits for that
    Match and releases what it opened."""
    cfg = config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": 4},
        "cache": {"l1_tokens": 256, "l2_tokens": 256},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
    })

    async def main() -> None:
        ns = cfg.namespace()
        node = NodeServer(cfg, storage=SlowLookups("memory://", StorageContext(ns.digest, ns.layout)))
        await node.start()
        try:
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                with pytest.raises(grpc.aio.AioRpcError) as ei:
                    await c.match(np.arange(1, 17, dtype=np.uint32), timeout_s=DEADLINE_S)
                assert ei.value.code() == C.DEADLINE_EXCEEDED
                end = time.monotonic() + 4 * LOOKUP_S
                while (await c.stats()).open_requests and time.monotonic() < end:
                    await asyncio.sleep(0.05)
                assert (await c.stats()).open_requests == 0
        finally:
            await node.stop(0.1)

    asyncio.run(main())


def test_a_release_while_the_match_still_opens_the_id_releases_it_once_open() -> None:
    """Straight on the node's API: a Release arriving while the Match that names the id is still in its L3
    lookup waits for it and releases the request (no NOT_FOUND, nothing left open); one whose own deadline
    passes first still releases it once open."""
    cfg = config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": 4},
        "cache": {"l1_tokens": 256, "l2_tokens": 256},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
    })

    async def main() -> None:
        from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
        from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc

        ns = cfg.namespace()
        node = NodeServer(cfg, storage=SlowLookups("memory://", StorageContext(ns.digest, ns.layout)))
        await node.start()
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{node.port}")
        stub = pb_grpc.HiCacheStub(ch)
        try:
            toks = np.arange(1, 17, dtype="<u4").tobytes()
            for rid, release_s in (("waits", 5.0), ("cut-short", 0.2)):
                match = asyncio.ensure_future(stub.Match(pb.MatchRequest(request_id=rid, tokens=toks), timeout=5))
                await asyncio.sleep(0.2)  # the Match is in its L3 lookup
                assert node.servicer is not None and node.servicer.table.pending(rid) is not None
                t0 = time.monotonic()
                if release_s > 1:
                    await stub.Release(pb.ReleaseRequest(request_id=rid), timeout=release_s)
                    assert time.monotonic() - t0 >= LOOKUP_S / 2  # it waited for the Match
                    assert len(node.servicer.table) == 0
                else:
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await stub.Release(pb.ReleaseRequest(request_id=rid), timeout=release_s)
                    assert ei.value.code() == C.DEADLINE_EXCEEDED
                assert (await match).request_id == rid  # the Match itself still answers
                end = time.monotonic() + 2
                while len(node.servicer.table) and time.monotonic() < end:
                    await asyncio.sleep(0.02)
                assert len(node.servicer.table) == 0
                assert node.cache is not None and node.cache.stats()["l1_pages_locked"] == 0
        finally:
            await ch.close()
            await node.stop(0.1)

    asyncio.run(main())
