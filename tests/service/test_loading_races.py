"""Pages another request is still loading from L2 are never handed out before their data has landed.

Request X's Match(load) starts an L2 -> L1 load of prefix A, slowed down here. Meanwhile another request
matches A (its L1 pages are X's, still being written), prefetches A (it matched A on L2, before X's load
began), reads A's bytes for a peer, or commits its own copy of A (the tree keeps X's pages). Every reply
must come only once the pages it names hold A's bytes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest

import hicache.transfer.cpu as cpu
from hicache.config import config_from_dict
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pbg
from hicache.service.pages import gather_pages, scatter_pages
from hicache.service.server import NodeServer

PS = 4
PAGES = 8
LOAD_DELAY_S = 0.4
A = np.arange(1, PAGES * PS + 1, dtype=np.uint32)


def tb(a: np.ndarray) -> bytes:
    return np.asarray(a, dtype="<u4").tobytes()


@pytest.fixture
def slow_loads(monkeypatch: pytest.MonkeyPatch) -> dict[str, float]:
    """L2 -> L1 loads of the CPU engine start ``delay["s"]`` seconds late (queued behind a sleep)."""
    delay = {"s": 0.0}
    orig = cpu.CpuTransferEngine._submit

    def submit(self: Any, src: Any, dst: Any, to_device: bool) -> Any:
        if to_device and delay["s"]:
            d = delay["s"]
            self._queue.put(lambda: time.sleep(d))
        return orig(self, src, dst, to_device)

    monkeypatch.setattr(cpu.CpuTransferEngine, "_submit", submit)
    return delay


def test_no_reply_names_pages_still_being_loaded(slow_loads: dict[str, float]) -> None:
    async def main() -> None:
        node = NodeServer(config_from_dict({
            "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
            "cache": {"l1_tokens": 32 * PS, "l2_tokens": 64 * PS, "write_policy": "write_through"},
            "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
        }))
        await node.start()
        cache = node.cache
        assert cache is not None
        pool = cache.device_pool
        data = bytes([7]) * (PAGES * cache.layout.bytes_per_page)
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{node.port}")
        s = pbg.HiCacheStub(ch)
        try:
            # A on L2 only, every L1 page scribbled over
            await s.Match(pb.MatchRequest(request_id="w", tokens=tb(A)), timeout=5)
            a = await s.Allocate(pb.AllocateRequest(request_id="w", num_pages=PAGES), timeout=5)
            scatter_pages(pool, np.array(a.device_indices), data)
            await s.Commit(pb.CommitRequest(request_id="w", tokens=tb(A), device_indices=a.device_indices), timeout=5)
            await s.Release(pb.ReleaseRequest(request_id="w"), timeout=5)

            def cold() -> None:
                cache.flush()
                cache.evict(l1_pages=10**6)
                for layer in pool.kv:
                    for t in layer:
                        t.fill_(0)

            async def during_load(other: Callable[[], Any]) -> Any:
                """Start X's load of A, run ``other`` while it is in flight, then finish X."""
                x = asyncio.ensure_future(s.Match(pb.MatchRequest(request_id="x", tokens=tb(A), load=True), timeout=5))
                await asyncio.sleep(LOAD_DELAY_S / 4)
                assert not x.done()  # X's load is in flight: the call below races it
                out = await other()
                await x
                await s.Release(pb.ReleaseRequest(request_id="x"), timeout=5)
                return out

            cold()
            slow_loads["s"] = LOAD_DELAY_S
            async def match() -> tuple[Any, bytes]:
                y = await s.Match(pb.MatchRequest(request_id="y", tokens=tb(A)), timeout=5)
                return y, gather_pages(pool, np.array(y.device_indices))  # read as soon as the reply names them

            y, got = await during_load(match)
            assert y.l1_pages == PAGES
            assert got == data, "Match named pages still loading"
            await s.Release(pb.ReleaseRequest(request_id="y"), timeout=5)

            cold()
            z = await s.Match(pb.MatchRequest(request_id="z", tokens=tb(A)), timeout=5)
            assert (z.l1_pages, z.l2_pages) == (0, PAGES)  # matched on L2, before X's load

            async def prefetch() -> tuple[Any, bytes]:
                last = [m async for m in s.Prefetch(pb.PrefetchRequest(request_id="z"), timeout=5)][-1]
                return last, gather_pages(pool, np.array(last.device_indices))

            last, got = await during_load(prefetch)
            assert len(last.device_indices) == PAGES
            assert got == data, "Prefetch named pages still loading"
            await s.Release(pb.ReleaseRequest(request_id="z"), timeout=5)

            cold()

            async def read() -> bytes:
                return b"".join([c.data async for c in s.ReadPages(pb.ReadPagesRequest(tokens=tb(A)), timeout=5)])

            assert await during_load(read) == data, "ReadPages sent pages still loading"

            cold()
            await s.Match(pb.MatchRequest(request_id="c", tokens=tb(A)), timeout=5)

            async def commit_own_copy() -> Any:
                own = await s.Allocate(pb.AllocateRequest(request_id="c", num_pages=PAGES), timeout=5)
                scatter_pages(pool, np.array(own.device_indices), data)
                cr = await s.Commit(pb.CommitRequest(request_id="c", tokens=tb(A), device_indices=own.device_indices),
                                    timeout=5)
                return cr, gather_pages(pool, np.array(cr.device_indices))

            cr, got = await during_load(commit_own_copy)
            assert cr.reused_pages == PAGES  # the tree kept X's pages, still being loaded
            assert got == data, "Commit named pages still loading"
            await s.Release(pb.ReleaseRequest(request_id="c"), timeout=5)
            cache.check_integrity()
        finally:
            await ch.close()
            await node.stop(0.5)

    asyncio.run(main())
