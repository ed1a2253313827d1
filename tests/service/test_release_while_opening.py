"""A Release that comes while the Match naming its id is still opening it (an L3 lookup on a worker), on an
in-process node whose store answers each lookup late.

The Release waits for that Match and releases what it opened, once: with several Releases waiting, one
releases and the others answer NOT_FOUND; one cut short by its deadline leaves nothing behind (no error of
its background wait reported as a bug); while it waits it takes no room under ``serve.max_concurrency``
(the Match it waits for does). At shutdown the Match still opening is waited for and what it opened is
released, and no waiting Release outlives ``stop``. A Match slower than the idle TTL opens a request that
idle expiry does not take at once.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import grpc
import numpy as np

from hicache.config import config_from_dict
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.requests import Entry
from hicache.service.server import NodeServer
from hicache.storage.base import StorageContext
from hicache.storage.memory import MemoryBackend

C = grpc.StatusCode
TOKENS = np.arange(1, 17, dtype="<u4").tobytes()


class SlowLookups(MemoryBackend):
    lookup_s = 1.0

    def batch_exists(self, keys: Sequence[bytes]) -> int:
        time.sleep(self.lookup_s)
        return super().batch_exists(keys)


class Node:
    def __init__(self, server: NodeServer, stub: pb_grpc.HiCacheStub, errors: list[dict[str, Any]]) -> None:
        self.server = server
        self.stub = stub
        self.errors = errors  # what the event loop was told of: exceptions nobody retrieved, and the like

    @property
    def servicer(self) -> Any:
        assert self.server.servicer is not None
        return self.server.servicer

    def match(self, rid: str, timeout_s: float = 5.0) -> asyncio.Future[pb.MatchResponse]:
        return asyncio.ensure_future(self.stub.Match(pb.MatchRequest(request_id=rid, tokens=TOKENS),
                                                     timeout=timeout_s))

    def release(self, rid: str, timeout_s: float = 5.0) -> asyncio.Future[pb.ReleaseResponse]:
        return asyncio.ensure_future(self.stub.Release(pb.ReleaseRequest(request_id=rid), timeout=timeout_s))

    async def opening(self, rid: str) -> Entry:
        """The table's entry of ``rid`` once its Match is in its L3 lookup."""
        end = time.monotonic() + 2
        while (e := self.servicer.table.pending(rid)) is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        assert e is not None
        return e

    def waiting_releases(self) -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if "_release_when_open" in repr(t.get_coro())]


@asynccontextmanager
async def node(lookup_s: float = 1.0, request_ttl_s: float = 600.0, **serve: Any) -> AsyncIterator[Node]:
    cfg = config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": 4},
        "cache": {"l1_tokens": 256, "l2_tokens": 256},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 3.0, **serve},
    })
    ns = cfg.namespace()
    store = SlowLookups("memory://", StorageContext(ns.digest, ns.layout))
    store.lookup_s = lookup_s
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
    server = NodeServer(cfg, storage=store, request_ttl_s=request_ttl_s)
    await server.start()
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield Node(server, pb_grpc.HiCacheStub(ch), errors)
    finally:
        await ch.close()
        await server.stop(0.1)


async def outcome(f: asyncio.Future[Any]) -> grpc.StatusCode:
    try:
        await f
    except grpc.aio.AioRpcError as e:
        return e.code()
    return C.OK


def test_of_two_releases_waiting_for_one_match_one_releases_and_the_other_finds_nothing() -> None:
    async def main() -> None:
        async with node() as n:
            m = n.match("twice")
            await n.opening("twice")
            first, second = n.release("twice"), n.release("twice")
            assert (await m).request_id == "twice"
            assert sorted([await outcome(first), await outcome(second)], key=str) == [C.NOT_FOUND, C.OK]
            assert len(n.servicer.table) == 0 and n.server.cache is not None
            assert n.server.cache.stats()["l1_pages_locked"] == 0
            assert n.errors == []

    asyncio.run(main())


def test_a_release_cut_short_that_another_release_beat_leaves_no_error_behind() -> None:
    """The waiting Release whose deadline passes keeps waiting in the background; when another Release
    took the request first, that background wait ends with nothing to do, which is no error."""
    async def main() -> None:
        async with node() as n:
            m = n.match("beaten")
            await n.opening("beaten")
            winner = n.release("beaten")
            await asyncio.sleep(0.05)  # the winner waits first, so it takes the request first
            loser = n.release("beaten", timeout_s=0.2)
            assert await outcome(loser) == C.DEADLINE_EXCEEDED
            await m
            assert await outcome(winner) == C.OK
            await asyncio.sleep(0.1)
            assert n.waiting_releases() == []
            gc.collect()  # an exception nobody retrieved is reported when its task is collected
            await asyncio.sleep(0)
            assert n.errors == []

    asyncio.run(main())


def test_a_release_waiting_for_a_match_takes_no_room_under_max_concurrency() -> None:
    async def main() -> None:
        async with node(max_concurrency=2) as n:
            m = n.match("slot")  # one call in flight
            await n.opening("slot")
            r = n.release("slot")
            await asyncio.sleep(0.1)  # the Release waits for the Match
            await n.stub.Stats(pb.StatsRequest(), timeout=2)  # a second call in flight: within the bound
            await m
            assert await outcome(r) == C.OK
            assert n.servicer.inflight == 0

    asyncio.run(main())


def test_shutdown_releases_what_a_match_opens_while_a_release_waits_for_it() -> None:
    """``stop`` cancels the calls in flight; the Match's worker goes on with its lookup. Shutdown waits for
    it, releases what it opened (once: the waiting Release does not also), and leaves no waiting Release
    behind."""
    async def main() -> None:
        async with node() as n:
            m = n.match("at-stop")
            entry = await n.opening("at-stop")
            r1, r2 = n.release("at-stop"), n.release("at-stop")
            await asyncio.sleep(0.1)
            await n.server.stop(0.1)
            assert entry.request is not None and entry.request.released
            assert n.waiting_releases() == []
            for f in (m, r1, r2):
                assert await outcome(f) != C.OK
            gc.collect()
            await asyncio.sleep(0)
            assert n.errors == []

    asyncio.run(main())


def test_a_match_slower_than_the_idle_ttl_is_not_expired_as_soon_as_it_opens() -> None:
    """Idle time counts from when the request opened, not from when its Match began."""
    async def main() -> None:
        # the expiry loop runs every 0.5 s; the request opens after 1.25 s, idle since its Match began
        async with node(lookup_s=1.25, request_ttl_s=1.2) as n:
            assert (await n.match("slow")).request_id == "slow"
            await asyncio.sleep(0.5)  # an expiry pass has run since (and the next is due later)
            await n.stub.Allocate(pb.AllocateRequest(request_id="slow", num_pages=1), timeout=2)
            await n.stub.Release(pb.ReleaseRequest(request_id="slow"), timeout=2)

    asyncio.run(main())


def test_expiry_passes_over_an_entry_whose_match_has_not_settled() -> None:
    """The worker sets the entry's request before its Match resumes on the event loop (and settles the
    entry): in between, the entry is not idle however long the Match took."""
    from hicache.service.requests import RequestTable

    table = RequestTable(idle_ttl_s=1.0)
    e = table.reserve("r")
    e.request = object()  # type: ignore[assignment]  # opened by the worker; the Match has not resumed
    later = time.monotonic() + 10
    assert table.expired(later) == []
    e.settled.set()
    assert table.expired(later) == [e] and len(table) == 0


def test_idle_expiry_cut_short_at_shutdown_still_releases_its_whole_batch() -> None:
    """The expiry loop takes idle requests out of the table and releases them one by one; cancelled midway
    (the node shuts down), the rest of its batch is still released -- nothing stays locked."""

    async def main() -> None:
        async with node(lookup_s=0.0, request_ttl_s=0.2) as n:
            for i in range(3):
                await n.stub.Match(pb.MatchRequest(request_id=f"idle-{i}",
                                                   tokens=np.arange(1 + 16 * i, 17 + 16 * i, dtype="<u4").tobytes()),
                                   timeout=5)
            cache = n.server.cache
            assert cache is not None
            released: list[Any] = []
            real = cache.release

            def slow_release(req: Any) -> None:
                time.sleep(0.2)  # a release that takes a while (an L3 prefetch to stop)
                real(req)
                released.append(req)

            cache.release = slow_release  # type: ignore[method-assign]
            await asyncio.sleep(0.3)  # all three idle past the TTL
            task = asyncio.ensure_future(n.servicer.expire_idle())
            await asyncio.sleep(0.1)  # the first release is under way
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await n.servicer.release_all(wait_s=2.0)
            assert len(released) == 3 and all(r.released for r in released)
            assert len(n.servicer.table) == 0

    asyncio.run(main())
