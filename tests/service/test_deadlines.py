"""Deadlines and races in the node's request handling. A Prefetch whose policy would wait for the whole L3
run (wait_complete) stops reading the store at the caller's deadline, and the cache stays consistent (no
page leaked, nothing half-inserted); the request can still be used and released. A call that races a
Release gets NOT_FOUND."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from hicache.client import AsyncHiCacheClient
from hicache.config import config_from_dict
from hicache.pool import HostPool
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.service import request_rpcs
from hicache.service.server import NodeServer
from hicache.storage.base import StorageContext
from hicache.storage.memory import MemoryBackend

PS = 4
PAGES = 16
SLOW_S = 0.15  # per page read: the whole prompt would take 2.4 s from L3


class SlowStore(MemoryBackend):
    reads = 0

    def batch_get(self, keys: Sequence[bytes], host_pool: HostPool, host_indices: Sequence[int]) -> int:
        time.sleep(SLOW_S * len(keys))
        self.reads += len(keys)
        return super().batch_get(keys, host_pool, host_indices)


_CFG: dict[str, dict[str, Any]] = {
    "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
    "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS, "write_policy": "write_through"},
    "storage": {"prefetch_policy": "wait_complete", "prefetch_threshold_tokens": 0, "io_batch_pages": 1},
    "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0},
}


def config() -> Any:
    return config_from_dict(_CFG)


def test_prefetch_stops_at_the_deadline() -> None:
    async def main() -> None:
        cfg = config()
        ns = cfg.namespace()
        store = SlowStore("memory://", StorageContext(ns.digest, ns.layout))
        node = NodeServer(cfg, storage=store)
        await node.start()
        try:
            assert node.cache is not None
            toks = np.arange(1, PAGES * PS + 1, dtype=np.uint32)
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                m = await c.match(toks, "w")
                new = await c.allocate("w", m.num_pages)
                await c.commit("w", toks, new)
                await c.release("w")
                node.cache.flush()
                node.cache.evict(l1_pages=10**6)
                node.cache.flush()
                node.cache.evict(l2_pages=10**6)  # now only the (slow) store has the pages
                m = await c.match(toks, "r")
                assert m.l3_pages == PAGES
                t0 = time.monotonic()
                try:
                    done = [p async for p in c.prefetch("r", timeout_s=0.6)]
                    assert done[-1].done and done[-1].loaded_l3_pages < PAGES  # returned with what landed
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert time.monotonic() - t0 < 1.0
                prefetcher = node.cache.prefetcher
                assert prefetcher is not None
                end = time.monotonic() + 10
                while prefetcher.live_tasks and time.monotonic() < end:  # at most the batch in flight
                    await asyncio.sleep(0.02)
                assert prefetcher.live_tasks == 0
                reads = store.reads
                assert reads < PAGES, reads  # it stopped reading instead of fetching all 2.4 s worth
                await asyncio.sleep(4 * SLOW_S)
                assert store.reads == reads
                await c.release("r")
                m = await c.match(toks, "again")  # the tree is whole: L2 holds what landed, L3 the rest
                assert m.l1_pages + m.l2_pages + m.l3_pages == PAGES
                await c.release("again")
            node.cache.check_integrity()  # every host page the prefetch took is back or in the tree
        finally:
            await node.stop()

    asyncio.run(main())


def test_allocate_and_commit_racing_a_release_get_not_found() -> None:
    """An Allocate or Commit that looked its request up just before a Release took it gets NOT_FOUND once
    it holds the request, never INTERNAL, and allocates nothing."""
    async def main() -> None:
        node = NodeServer(config())
        await node.start()
        try:
            assert node.cache is not None
            toks = np.arange(1, 4 * PS + 1, dtype=np.uint32)
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                for call in ("allocate", "commit"):
                    m = await c.match(toks, call)
                    entry = node.servicer.table.get(call)
                    free = node.cache.device_pool.allocator.free_pages
                    async with entry.lock:  # the RPC below looks the entry up, then waits for this lock
                        rpc = asyncio.ensure_future(c.allocate(call, 2) if call == "allocate"
                                                    else c.commit(call, toks, m.device_indices))
                        await asyncio.sleep(0.2)
                        assert not rpc.done()
                        assert entry.request is not None
                        node.cache.release(entry.request)  # as Release does, under the same lock
                    try:
                        await rpc
                        raise AssertionError(f"{call} after release succeeded")
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.NOT_FOUND, (call, e.code(), e.details())
                    assert node.cache.device_pool.allocator.free_pages == free
                    node.servicer.table.pop(call)
        finally:
            await node.stop(0.1)

    asyncio.run(main())


def test_a_release_cut_short_by_its_deadline_still_releases() -> None:
    """Release waits for the request's lock (here: a slow Prefetch holds it). When the caller's deadline
    passes meanwhile, the release still completes: no page stays locked or pinned."""
    async def main() -> None:
        cfg = config()
        ns = cfg.namespace()
        node = NodeServer(cfg, storage=SlowStore("memory://", StorageContext(ns.digest, ns.layout)))
        await node.start()
        try:
            cache = node.cache
            assert cache is not None
            toks = np.arange(1, PAGES * PS + 1, dtype=np.uint32)
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                m = await c.match(toks, "w")
                await c.commit("w", toks, await c.allocate("w", m.num_pages))
                await c.release("w")
                cache.flush()
                cache.clear()  # the prompt is on L3 only: a prefetch takes PAGES * SLOW_S
                await c.match(toks, "o")
                prefetch = asyncio.ensure_future(_drain(c.prefetch("o", timeout_s=10)))
                await asyncio.sleep(0.2)
                try:
                    await c.release("o", timeout_s=0.3)
                    raise AssertionError("the release should have outlived its deadline")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                await prefetch
            for _ in range(100):  # the shielded release runs once the prefetch lets go of the lock
                if node.servicer.inflight == 0:
                    break
                await asyncio.sleep(0.05)
            cache.check_integrity()
            cache.clear()  # drops every page no request holds: all of them, if "o" was released
            assert cache.device_pool.allocator.used_pages == 0
            assert cache.host_pool.allocator.used_pages == 0
        finally:
            await node.stop(0.1)

    asyncio.run(main())


def test_a_match_cancelled_as_its_worker_ends_leaves_the_id_usable(monkeypatch: Any) -> None:
    """A Match whose cancellation lands just as its worker ends (``blocking`` then raises CancelledError
    after the worker finished): if the worker failed, nothing opened and the id is free again (a Match on
    it opens, no ALREADY_EXISTS forever); if it succeeded, the request is open and Release closes it."""
    async def cancelled_as_it_ends(fn: Any, *args: Any) -> Any:
        with contextlib.suppress(Exception):
            fn(*args)
        raise asyncio.CancelledError

    def failing_load(req: Any) -> None:
        raise RuntimeError("the L2 -> L1 load failed")

    async def main() -> None:
        node = NodeServer(config())
        await node.start()
        try:
            cache = node.cache
            assert cache is not None
            toks = np.arange(1, 4 * PS + 1, dtype=np.uint32)
            real_load = node.servicer._load
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                for fails in (True, False):
                    rid = f"cut-{fails}"
                    node.servicer._load = failing_load if fails else real_load  # type: ignore[method-assign]
                    monkeypatch.setattr(request_rpcs, "blocking", cancelled_as_it_ends)
                    try:
                        await node.servicer._match(pb.MatchRequest(request_id=rid, tokens=toks.tobytes(),
                                                                   load=True))
                        raise AssertionError("the Match was cancelled")
                    except asyncio.CancelledError:
                        pass
                    finally:
                        monkeypatch.undo()
                    if fails:
                        assert rid not in node.servicer.table._entries
                        await c.match(toks, rid)  # the id opens again
                    await c.release(rid)
                    try:
                        await c.release(rid)
                        raise AssertionError("released twice")
                    except grpc.aio.AioRpcError as e:
                        assert e.code() == grpc.StatusCode.NOT_FOUND
            assert len(node.servicer.table) == 0
            cache.check_integrity()
            cache.clear()
            assert cache.device_pool.allocator.used_pages == 0
        finally:
            await node.stop(0.1)

    asyncio.run(main())


def test_watchers_do_not_use_up_the_concurrency_bound() -> None:
    """WatchEvents subscriptions are not counted against serve.max_concurrency; Release is never refused."""
    async def main() -> None:
        cfg = config_from_dict({**_CFG, "serve": {**_CFG["serve"], "max_concurrency": 2}})
        node = NodeServer(cfg)
        await node.start()
        try:
            toks = np.arange(1, 4 * PS + 1, dtype=np.uint32)
            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                watchers = [asyncio.ensure_future(_drain(c.watch_events())) for _ in range(4)]
                await asyncio.sleep(0.2)
                m = await c.match(toks, "r")  # four watchers open, bound 2: still admitted
                await c.commit("r", toks, await c.allocate("r", m.num_pages))
                await c.release("r")
                for w in watchers:
                    w.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
        finally:
            await node.stop(0.1)

    asyncio.run(main())


async def _drain(stream: Any) -> None:
    async for _ in stream:
        pass


def test_a_made_up_id_whose_match_reply_is_lost_is_released() -> None:
    """A Match without a request_id opens the request under an id the node makes up; only the reply names
    it. When the call ends cancelled after the request opened (here: the caller's deadline passes while the
    reply is on its way), nobody could Release it: the node releases it (no page stays locked until the idle
    TTL). A reply that arrives leaves the request open for its caller."""
    async def main() -> None:
        node = NodeServer(config())
        await node.start()
        try:
            cache = node.cache
            assert cache is not None
            toks = np.arange(1, 8 * PS + 1, dtype=np.uint32)
            real = node.servicer._match

            async def reply_held_up(request: Any, *args: Any, **kw: Any) -> Any:
                resp = await real(request, *args, **kw)
                await asyncio.sleep(1.0)  # the request is open; its reply is late
                return resp

            async with AsyncHiCacheClient(f"127.0.0.1:{node.port}") as c:
                m = await c.match(toks, "w")
                await c.commit("w", toks, await c.allocate("w", m.num_pages))
                await c.release("w")
                cache.flush()  # the backups to L2 have landed: no page is locked but by a request
                assert cache.tree.locked_device_pages == 0
                node.servicer._match = reply_held_up  # type: ignore[method-assign]
                try:
                    await c.match(toks, timeout_s=0.3)
                    raise AssertionError("the reply should have missed its deadline")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                node.servicer._match = real  # type: ignore[method-assign]
                for _ in range(100):
                    if len(node.servicer.table) == 0 and cache.tree.locked_device_pages == 0:
                        break
                    await asyncio.sleep(0.05)
                assert len(node.servicer.table) == 0, "the request nobody can name is still open"
                assert cache.tree.locked_device_pages == 0
                got = await c.match(toks)  # a reply that arrives: the caller's to release
                assert got.l1_pages == 8
                await asyncio.sleep(0.2)
                assert len(node.servicer.table) == 1
                await c.release(got.request_id)
            cache.check_integrity()
        finally:
            await node.stop(0.1)

    asyncio.run(main())
