"""Match stream sessions of the clients when a call is abandoned or the stream breaks.

A pipelined :class:`AsyncMatchStream` hands replies to waiting calls in order. A call that is cancelled
while waiting (``asyncio.wait_for`` timing out) must only lose its own reply: the calls after it still
get theirs, and the session goes on. A stream that fails must fail every waiting and later call with a
clear error, never leave them waiting forever. The blocking :class:`MatchStream` must never hand a call
the reply of an earlier, interrupted one.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.client import AsyncHiCacheClient, CallError, HiCacheClient

from .service_harness import ServerProc, serve_prompt

PS = 16
N = 10  # prompts; prompt i has its first i % 5 pages cached


def prompt(i: int) -> np.ndarray:
    return np.random.default_rng(7000 + i).integers(0, 30_000, 4 * PS).astype(np.uint32)


def cached(i: int) -> int:
    return i % 5


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProc]) -> ServerProc:
    s = server_factory()
    with HiCacheClient(s.target) as c:
        for i in range(N):
            if cached(i):
                serve_prompt(c, prompt(i)[: cached(i) * PS], f"seed-{i}")
        assert [c.match(prompt(i), peek=True).l1_pages for i in range(N)] == [cached(i) for i in range(N)]
    return s


def cancel_once_written(call: Any, victim: bytes, task: Callable[[], asyncio.Task[Any]]) -> None:
    """Make the stream's ``write`` cancel ``task()`` right after the request with tokens ``victim`` went
    out: that call is then cancelled while its reply is due, with no chance for the reply to come first."""
    real_write = call.write

    async def write(req: Any) -> None:
        await real_write(req)
        if req.tokens == victim:
            task().cancel()

    call.write = write


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_call_cancelled_while_its_reply_is_due_loses_only_its_reply(srv: ServerProc, pipelined: bool) -> None:
    async def main() -> None:
        async with AsyncHiCacheClient(srv.target) as c:
            s = c.match_stream(pipelined=pipelined)
            assert (await s.match(prompt(0), peek=True)).l1_pages == 0  # the stream is open
            victim: list[asyncio.Task[Any]] = []
            cancel_once_written(s._call, prompt(3).tobytes(), lambda: victim[0])
            # a slow request first (hashing 4096 page keys takes the node milliseconds): the victim's reply
            # cannot come before the victim is cancelled, microseconds after its write
            slow = asyncio.create_task(s.match(np.arange(1 << 16, dtype=np.uint32), peek=True, return_keys=True))
            victim.append(asyncio.create_task(s.match(prompt(3), peek=True)))
            others = [asyncio.create_task(s.match(prompt(i), peek=True)) for i in range(N)]
            got = await asyncio.wait_for(asyncio.gather(*others), 10)
            assert [m.l1_pages for m in got] == [cached(i) for i in range(N)]
            assert len((await slow).page_keys) == 1 << 12
            with pytest.raises(asyncio.CancelledError):
                await victim[0]
            again = await asyncio.wait_for(asyncio.gather(*(s.match(prompt(i), peek=True) for i in range(N))), 10)
            assert [m.l1_pages for m in again] == [cached(i) for i in range(N)]
            await asyncio.wait_for(s.close(), 10)

    asyncio.run(main())


@pytest.mark.parametrize("pipelined", [True, False])
def test_calls_timing_out_at_random_points_leave_the_session_working(srv: ServerProc, pipelined: bool) -> None:
    """Timeouts cut calls before, during and after their write: every call that completes has its own reply."""

    async def main() -> None:
        async with AsyncHiCacheClient(srv.target) as c:
            s = c.match_stream(pipelined=pipelined)

            async def one(k: int, scale: float) -> int | None:
                i = k % N
                if k % 3:
                    return (await s.match(prompt(i), peek=True)).l1_pages
                try:  # timeouts spread over the time the whole batch takes
                    return (await asyncio.wait_for(s.match(prompt(i), peek=True), (k * 37 % 101) * scale)).l1_pages
                except TimeoutError:
                    return None

            for scale in (3e-4, 6e-4, 1e-3, 2e-3):
                got = await asyncio.wait_for(asyncio.gather(*(one(k, scale) for k in range(300))), 30)
                assert all(g is None or g == cached(k % N) for k, g in enumerate(got)), (scale, got)
                assert sum(g is not None for g in got) >= 200
            again = await asyncio.wait_for(asyncio.gather(*(s.match(prompt(i), peek=True) for i in range(N))), 10)
            assert [m.l1_pages for m in again] == [cached(i) for i in range(N)]
            await asyncio.wait_for(s.close(), 10)
            stats = await c.stats()
            assert stats.open_requests == 0

    asyncio.run(main())


class _FailingAfter:
    """Stands in for the stream call: its replies, then an error that is not a gRPC status (a fault in
    the code that reads the stream)."""

    def __init__(self, call: Any, replies: int) -> None:
        self._call = call
        self._left = replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)

    def __aiter__(self) -> Any:
        return self._gen()

    async def _gen(self) -> Any:
        async for m in self._call:
            if self._left == 0:
                raise RuntimeError("reader fault")
            self._left -= 1
            yield m


def test_a_failed_pipelined_reader_fails_waiting_and_later_calls_clearly(srv: ServerProc) -> None:
    async def main() -> None:
        async with AsyncHiCacheClient(srv.target) as c:
            s = c.match_stream(pipelined=True)
            s._call = _FailingAfter(s._call, 3)  # type: ignore[assignment]
            got = await asyncio.wait_for(
                asyncio.gather(*(s.match(prompt(i), peek=True) for i in range(N)), return_exceptions=True), 10)
            assert [m.l1_pages for m in got[:3]] == [cached(i) for i in range(3)]  # type: ignore[union-attr]
            for e in got[3:]:
                assert isinstance(e, CallError) and e.code() == grpc.StatusCode.INTERNAL, e
                assert "reader fault" in e.details()
            with pytest.raises(CallError) as ei:  # later calls fail at once instead of waiting forever
                await asyncio.wait_for(s.match(prompt(0), peek=True), 5)
            assert ei.value.code() == grpc.StatusCode.INTERNAL and "reader fault" in ei.value.details()
            s._call.cancel()

    asyncio.run(main())


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_broken_or_closed_stream_fails_later_calls_at_once(srv: ServerProc, pipelined: bool) -> None:
    async def main() -> None:
        async with AsyncHiCacheClient(srv.target) as c:
            s = c.match_stream(pipelined=pipelined)
            assert (await s.match(prompt(1), peek=True)).l1_pages == cached(1)
            s._call.cancel()  # the stream breaks (as when the connection is lost)
            for _ in range(2):
                with pytest.raises((grpc.RpcError, CallError)) as ei:
                    await asyncio.wait_for(s.match(prompt(1), peek=True), 5)
                assert ei.value.code() == grpc.StatusCode.CANCELLED  # type: ignore[union-attr]
            s = c.match_stream(pipelined=pipelined)
            assert (await s.match(prompt(2), peek=True)).l1_pages == cached(2)
            await asyncio.wait_for(s.close(), 5)
            with pytest.raises(CallError) as ce:
                await asyncio.wait_for(s.match(prompt(2), peek=True), 5)
            assert "closed" in ce.value.details()

    asyncio.run(main())


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_call_waiting_when_the_client_closes_gets_an_error_not_a_cancellation(srv: ServerProc,
                                                                                  pipelined: bool) -> None:
    """Closing the client cancels the stream under a call waiting for its reply: that call raises the
    stream's end (CANCELLED), and its task is not taken for cancelled."""

    async def main() -> None:
        c = AsyncHiCacheClient(srv.target)
        s = c.match_stream(pipelined=pipelined)
        assert (await s.match(prompt(1), peek=True)).l1_pages == cached(1)
        real_write = s._call.write
        slow = np.arange(1 << 18, dtype=np.uint32)  # hashing its page keys keeps the reply due a while

        async def write(req: Any) -> None:
            await real_write(req)
            if req.tokens == slow.tobytes():
                await c.close()

        s._call.write = write  # type: ignore[method-assign]
        t = asyncio.create_task(s.match(slow, peek=True, return_keys=True))
        await asyncio.wait([t], timeout=10)
        assert t.done() and not t.cancelled()
        e = t.exception()
        assert isinstance(e, CallError | grpc.RpcError) and e.code() == grpc.StatusCode.CANCELLED, e
        with pytest.raises((CallError, grpc.RpcError)):  # and so do later calls, at once
            await asyncio.wait_for(s.match(prompt(1), peek=True), 5)

    asyncio.run(main())


class Interrupted(BaseException):
    """What a signal handler may raise in a thread blocked on a reply (KeyboardInterrupt and the like)."""


class _InterruptFirstWait:
    """Stands in for the blocking stream's reply iterator: the first wait for a reply is interrupted
    before the reply is taken (it stays due on the stream)."""

    def __init__(self, replies: Any) -> None:
        self._replies = replies
        self._interrupt = True

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self._interrupt:
            self._interrupt = False
            raise Interrupted
        return next(self._replies)

    def cancel(self) -> bool:
        return bool(self._replies.cancel())


def test_blocking_stream_never_hands_a_call_the_reply_of_an_interrupted_one(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        s = c.match_stream()
        assert s.match(prompt(1), peek=True).l1_pages == cached(1)
        s._replies = _InterruptFirstWait(s._replies)  # type: ignore[assignment]
        with pytest.raises(Interrupted):
            s.match(prompt(2), peek=True)  # its reply is still due when the call gives up
        with pytest.raises(CallError) as ei:  # not prompt 2's reply taken for prompt 3's
            s.match(prompt(3), peek=True)
        assert ei.value.code() == grpc.StatusCode.CANCELLED and "interrupted" in ei.value.details()
        with pytest.raises(CallError):
            s.match(prompt(3), peek=True)
        with c.match_stream() as fresh:  # a new session works
            assert fresh.match(prompt(3), peek=True).l1_pages == cached(3)


def test_blocking_streams_given_up_leave_no_thread_behind(srv: ServerProc) -> None:
    """gRPC reads a blocking stream's requests on a thread of its own: a session that ends without
    ``close`` (an interrupted call, an exception in its ``with`` block) must still let that thread end."""
    with HiCacheClient(srv.target) as c:
        with c.match_stream() as s:
            s.match(prompt(1), peek=True)
        time.sleep(0.2)
        base = threading.active_count()
        for _ in range(4):
            s = c.match_stream()
            s.match(prompt(1), peek=True)
            s._replies = _InterruptFirstWait(s._replies)  # type: ignore[assignment]
            with pytest.raises(Interrupted):
                s.match(prompt(2), peek=True)
            with pytest.raises(Interrupted), c.match_stream() as s:
                s.match(prompt(1), peek=True)
                raise Interrupted
        end = time.monotonic() + 5
        while threading.active_count() > base and time.monotonic() < end:
            time.sleep(0.05)
        assert threading.active_count() <= base, [t.name for t in threading.enumerate()]


def test_blocking_stream_after_close_raises_call_error(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        s = c.match_stream()
        assert s.match(prompt(4), peek=True).l1_pages == cached(4)
        s.close()
        with pytest.raises(CallError) as ei:  # not a bare StopIteration
            s.match(prompt(4), peek=True)
        assert "closed" in ei.value.details()


def test_blocking_stream_closes_quietly_after_the_server_ended_it(
        server_factory: Callable[..., ServerProc]) -> None:
    s = server_factory(serve={"shutdown_grace_s": 0.3})
    with HiCacheClient(s.target) as c:
        ms = c.match_stream()
        assert ms.match(prompt(0), peek=True).l1_pages == 0
        s.terminate(30)  # the node cancels the open stream once its grace is over
        ms.close()  # nothing to report: the session is over either way
        with pytest.raises(CallError):
            ms.match(prompt(0), peek=True)
