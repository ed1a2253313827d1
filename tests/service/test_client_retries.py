"""Which unary calls the clients try again after UNAVAILABLE, and what the server does with a repeat.

UNAVAILABLE comes both when no connection could be made (the call never left the client: any call may be
sent again) and when the connection dropped after the server took the call (its reply was lost). After
the second kind, only calls whose repeat changes nothing are sent again: reads, a peek, a Match (it names
its request, the caller's id or one the client made up, and the server answers an identical repeat with
the first reply) and Release (a repeat that finds the request gone counts as done). Allocate, Commit, Pin,
Unpin and Clear are not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.client import AsyncHiCacheClient, HiCacheClient, RetryPolicy
from hicache.client._common import retryable
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

from .service_harness import ServerProc, free_port, serve_prompt

PS = 16
C = grpc.StatusCode
LOST = "Stream removed (Socket closed)"  # what gRPC says when the connection drops during a call
NO_CONNECTION = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
                 "Failed to connect to remote host: Connection refused")
FAST = RetryPolicy(attempts=4, base_s=0.01, max_s=0.02)


class LostReply(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    """The error of a blocking call whose connection dropped after the server took it."""

    def code(self) -> grpc.StatusCode:
        return C.UNAVAILABLE

    def details(self) -> str:
        return LOST

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


def tokens(seed: int, n: int = 4 * PS) -> np.ndarray:
    return np.random.default_rng(9000 + seed).integers(0, 30_000, n).astype(np.uint32)


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProc]) -> ServerProc:
    return server_factory()


@pytest.fixture
def client(srv: ServerProc) -> Iterator[HiCacheClient]:
    with HiCacheClient(srv.target, retry=FAST, timeout_s=10) as c:
        yield c
        assert c.stats().open_requests == 0


class Lossy:
    """Wraps one RPC of a blocking client: every attempt reaches the server, the first one's reply is lost."""

    def __init__(self, c: HiCacheClient, name: str) -> None:
        self.real = getattr(c.stub, name)
        self.calls = 0
        self.replies: list[Any] = []
        setattr(c.stub, name, self)

    def __call__(self, request: Any, **kw: Any) -> Any:
        self.calls += 1
        reply = self.real(request, **kw)
        self.replies.append(reply)
        if self.calls == 1:
            raise LostReply()
        return reply


def lost(fn: Callable[[], Any]) -> None:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    assert ei.value.code() == C.UNAVAILABLE and ei.value.details() == LOST


def test_calls_that_change_state_are_not_sent_again_after_a_lost_reply(client: HiCacheClient) -> None:
    c = client
    toks = tokens(1)
    c.match(toks, "a")
    used = c.stats().l1_pages_used
    alloc = Lossy(c, "Allocate")
    lost(lambda: c.allocate("a", 4))
    assert alloc.calls == 1 and c.stats().l1_pages_used == used + 4  # allocated once, not twice
    pages = np.asarray(alloc.replies[0].device_indices, dtype=np.int64)
    commit = Lossy(c, "Commit")
    lost(lambda: c.commit("a", toks, pages))
    assert commit.calls == 1
    c.release("a")
    assert c.match(toks, peek=True).l1_pages == 4  # the one commit went through

    pin = Lossy(c, "Pin")
    lost(lambda: c.pin(toks))
    assert pin.calls == 1 and len(c.pins()) == 1  # one pin, not a second one nobody knows of
    unpin = Lossy(c, "Unpin")
    lost(lambda: c.unpin(pin.replies[0].pin_id))
    assert unpin.calls == 1 and c.pins() == []
    clear = Lossy(c, "Clear")
    lost(c.clear)
    assert clear.calls == 1


def test_calls_whose_repeat_changes_nothing_are_sent_again(client: HiCacheClient) -> None:
    c = client
    serve_prompt(c, tokens(3), "seed")
    for name, call in (("Stats", c.stats), ("GetPoolInfo", c.pool_info), ("ListPins", c.pins),
                       ("Flush", c.flush), ("Match", lambda: c.match(tokens(3), peek=True))):
        wrapped = Lossy(c, name)
        call()
        assert wrapped.calls == 2, name
        setattr(c.stub, name, wrapped.real)

    match = Lossy(c, "Match")
    m = c.match(tokens(3, 6 * PS), "named", return_keys=True)  # the repeat gets the first reply again
    assert match.calls == 2 and m.l1_pages == 4 and m.num_pages == 6
    first = match.replies[0]
    assert m.device_indices.tolist() == list(first.device_indices) and m.page_keys == list(first.page_keys)
    assert c.stats().open_requests == 1
    match.calls = 0
    match.replies.clear()
    unnamed = c.match(tokens(2))  # the client names it: the repeat gets the first reply, no second request
    assert match.calls == 2 and unnamed.request_id == match.replies[0].request_id != ""
    assert c.stats().open_requests == 2
    c.release(unnamed.request_id)
    new = c.allocate("named", 2)
    assert c.commit("named", tokens(3, 6 * PS), np.concatenate([m.device_indices, new])).new_pages == 2
    release = Lossy(c, "Release")
    c.release("named")  # the repeat finds the request released by the first attempt: done
    assert release.calls == 2 and c.stats().open_requests == 0
    with pytest.raises(grpc.RpcError) as ei:  # a Release of an unknown id is still refused
        c.release("named")
    assert ei.value.code() == C.NOT_FOUND


def test_every_call_is_sent_again_when_no_connection_was_made() -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    with HiCacheClient(target, retry=RetryPolicy(attempts=3, base_s=0.01, max_s=0.02), timeout_s=5) as c:
        for name, call in (("Allocate", lambda: c.allocate("r", 1)), ("Pin", lambda: c.pin([1, 2])),
                           ("Match", lambda: c.match([1, 2])), ("Clear", c.clear)):
            real = getattr(c.stub, name)
            calls = 0

            def counting(*args: Any, _real: Any = real, **kw: Any) -> Any:
                nonlocal calls
                calls += 1
                return _real(*args, **kw)

            setattr(c.stub, name, counting)
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == C.UNAVAILABLE and calls == 3, (name, calls)


def test_retryable_tells_a_connection_never_made_from_a_lost_reply() -> None:
    def err(code: grpc.StatusCode, details: str) -> grpc.RpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    for idempotent in (True, False):
        assert retryable(err(C.UNAVAILABLE, NO_CONNECTION), idempotent)
        assert retryable(err(C.UNAVAILABLE, "errors resolving nowhere.invalid:5000: ..."), idempotent)
        assert retryable(err(C.UNAVAILABLE, LOST), idempotent) == idempotent
        assert not retryable(err(C.DEADLINE_EXCEEDED, "Deadline Exceeded"), idempotent)
        assert not retryable(err(C.NOT_FOUND, NO_CONNECTION), idempotent)
    assert retryable(LostReply(), True) and not retryable(LostReply(), False)


def test_the_asyncio_client_follows_the_same_rule(srv: ServerProc) -> None:
    def lose_first(c: AsyncHiCacheClient, name: str) -> list[int]:
        real = getattr(c.stub, name)
        calls = [0]

        async def wrapped(request: Any, **kw: Any) -> Any:
            calls[0] += 1
            reply = await real(request, **kw)
            if calls[0] == 1:
                raise grpc.aio.AioRpcError(C.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=LOST)
            return reply

        setattr(c.stub, name, wrapped)
        return calls

    async def main() -> None:
        async with AsyncHiCacheClient(f"127.0.0.1:{free_port()}", retry=RetryPolicy(attempts=3, base_s=0.01),
                                      timeout_s=5) as dead:
            calls = lose_first(dead, "Stats")  # nothing listens: every attempt fails to connect
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await dead.stats()
            assert ei.value.code() == C.UNAVAILABLE and calls == [3]
        async with AsyncHiCacheClient(srv.target, retry=FAST) as c:
            stats = lose_first(c, "Stats")
            await c.stats()
            assert stats == [2]
            await c.match(tokens(4), "x")
            alloc = lose_first(c, "Allocate")
            with pytest.raises(grpc.aio.AioRpcError):
                await c.allocate("x", 2)
            assert alloc == [1]
            m = lose_first(c, "Match")
            assert (await c.match(tokens(5), "y")).num_pages == 4 and m == [2]
            release = lose_first(c, "Release")
            await c.release("x")
            assert release == [2]
            await c.release("y")
            assert (await c.stats()).open_requests == 0

    asyncio.run(main())


def test_server_answers_an_identical_repeat_of_the_opening_match_with_the_same_reply(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        serve_prompt(c, tokens(6), "seed-6")
        stub = c.stub
        req = pb.MatchRequest(request_id="rep", tokens=tokens(6, 6 * PS).tobytes(), return_keys=True)
        first = stub.Match(req, timeout=5)
        assert first.l1_pages == 4 and len(first.page_keys) == 6
        assert stub.Match(req, timeout=5) == first  # the same request again: the same reply
        assert c.stats().open_requests == 1  # and no second request
        with c.match_stream() as s:  # over a stream too
            assert s.match(tokens(6, 6 * PS), "rep", return_keys=True).device_indices.tolist() == \
                list(first.device_indices)
        for other in (pb.MatchRequest(request_id="rep", tokens=tokens(7).tobytes()),  # other tokens
                      pb.MatchRequest(request_id="rep", tokens=req.tokens)):  # other options (no keys)
            with pytest.raises(grpc.RpcError) as ei:
                stub.Match(other, timeout=5)
            assert ei.value.code() == C.ALREADY_EXISTS
        c.allocate("rep", 1)  # once the request is used, a repeat is a conflict, not a retry
        with pytest.raises(grpc.RpcError) as ei:
            stub.Match(req, timeout=5)
        assert ei.value.code() == C.ALREADY_EXISTS
        c.release("rep")
        assert stub.Match(req, timeout=5).request_id == "rep"  # released: the id opens anew
        c.release("rep")
        assert c.stats().open_requests == 0


def test_a_repeat_arriving_while_the_first_match_still_opens_waits_for_it() -> None:
    """The first attempt's Match may still be running (an L3 lookup, a load) when the repeat comes: the
    repeat waits for the request to open and answers from it; if the first attempt fails instead, the
    repeat goes on as a Match of its own."""
    from types import SimpleNamespace

    from hicache.service.requests import RequestTable
    from hicache.service.servicer import HiCacheServicer

    async def main() -> None:
        table = RequestTable()
        fake = SimpleNamespace(table=table, _match_response=lambda req, rid, keys: (req.name, rid, keys))
        req = pb.MatchRequest(request_id="r", tokens=tokens(8).tobytes())
        entry = table.reserve("r")
        entry.opening = req
        waiting = asyncio.create_task(HiCacheServicer._repeat(fake, req))  # type: ignore[arg-type]
        await asyncio.sleep(0.02)
        assert not waiting.done()
        entry.request = SimpleNamespace(name="opened", pending=[])  # type: ignore[assignment]
        entry.settled.set()  # as the first attempt's Match does once it has opened the request
        assert await asyncio.wait_for(waiting, 5) == ("opened", "r", False)
        other = pb.MatchRequest(request_id="r", tokens=tokens(9).tobytes())
        assert await HiCacheServicer._repeat(fake, other) is None  # not a repeat: ALREADY_EXISTS follows
        table.drop("r")
        second = table.reserve("r")
        second.opening = req
        waiting = asyncio.create_task(HiCacheServicer._repeat(fake, req))  # type: ignore[arg-type]
        await asyncio.sleep(0.02)
        table.drop("r")  # the first attempt failed: its entry is gone
        assert await asyncio.wait_for(waiting, 5) is None

    asyncio.run(main())


def test_a_patient_retry_policy_rides_out_a_node_restart(tmp_path: Any) -> None:
    """The default policy gives up within about half a second (an engine would rather compute the prefix than
    wait); a caller that would rather wait gives more attempts, and a call made while the node is down
    succeeds once it is back (the channel's reconnect wait is capped, so it notices within ``reconnect_max_s``)."""
    import threading
    import time

    from .service_harness import start_server

    port = free_port()
    with HiCacheClient(f"127.0.0.1:{port}", timeout_s=30) as c:
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            c.stats()
        assert ei.value.code() == C.UNAVAILABLE and time.monotonic() - t0 < 2.0
    started: list[ServerProc] = []
    boot = threading.Timer(1.0, lambda: started.append(start_server(tmp_path, serve={"port": port})))
    boot.start()
    try:
        with HiCacheClient(f"127.0.0.1:{port}", timeout_s=30,
                           retry=RetryPolicy(attempts=200, base_s=0.05, max_s=0.25)) as c:
            t0 = time.monotonic()
            assert c.stats().open_requests == 0
            assert time.monotonic() - t0 >= 0.9
    finally:
        boot.join()
        for s in started:
            s.terminate(15)
