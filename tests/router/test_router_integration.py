"""Router + real node services (in-process grpc.aio servers): requests go where their prefix is, and a
router that restarts rebuilds its index from the nodes' snapshots."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc
import numpy as np
from router_helpers import node_config, tokens

from hicache.client import AsyncHiCacheClient
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.router.client import AsyncRouterClient
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.server import RouterServer
from hicache.service.server import NodeServer

DOC_PAGES = 8


async def start_nodes(n: int) -> list[NodeServer]:
    nodes = []
    for _ in range(n):
        cfg = node_config(serve={"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0})
        node = NodeServer(cfg)
        await node.start()
        nodes.append(node)
    return nodes


async def start_router(nodes: list[NodeServer], **kw: object) -> RouterServer:
    rc = RouterConfig(port=0, nodes=[NodeSpec(f"n{i}", f"127.0.0.1:{n.port}") for i, n in enumerate(nodes)],
                      stats_interval_s=0.2, reconnect_max_s=0.3, **kw)  # type: ignore[arg-type]
    router = RouterServer(node_config(), rc)
    await router.start()
    await router.wait_synced(10)
    return router


async def serve_on(client: AsyncHiCacheClient, toks: np.ndarray, rid: str) -> int:
    """Run one request on a node as an engine would; returns the L1 pages it hit."""
    m = await client.match(toks, rid)
    new = await client.allocate(rid, m.num_pages - m.l1_pages)
    await client.commit(rid, toks, np.concatenate([m.device_indices, new]))
    await client.release(rid)
    return m.l1_pages


async def eventually(pred: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not await pred():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.02)


def test_prefix_affinity_and_rebuild_after_router_restart() -> None:
    async def main() -> None:
        nodes = await start_nodes(3)
        clients = {f"n{i}": AsyncHiCacheClient(f"127.0.0.1:{n.port}") for i, n in enumerate(nodes)}
        router = await start_router(nodes)
        rc = AsyncRouterClient(f"127.0.0.1:{router.port}")
        try:
            docs = [tokens(10 + i, DOC_PAGES) for i in range(3)]
            home: dict[int, str] = {}
            for i, doc in enumerate(docs):  # first request per document: nobody has it, spread
                q = np.concatenate([doc, tokens(100 + i, 2)])
                d = await rc.route(q)
                assert d.reason == "balance" and d.l1_pages == 0
                assert await serve_on(clients[d.node], q, f"first-{i}") == 0
                await rc.complete(d.route_id)
                home[i] = d.node
            assert sorted(home.values()) == ["n0", "n1", "n2"]  # equal nodes share new prefixes

            async def indexed() -> bool:
                for i, doc in enumerate(docs):
                    d = await rc.route(doc, peek=True)
                    if d.node != home[i] or d.l1_pages != DOC_PAGES:
                        return False
                return True

            await eventually(indexed)
            for k in range(12):  # follow-up questions over the same documents go home and hit
                i = k % 3
                q = np.concatenate([docs[i], tokens(200 + k, 3)])
                d = await rc.route(q, tenant="")
                assert (d.node, d.reason, d.l1_pages, d.num_pages) == (home[i], "prefix", DOC_PAGES, DOC_PAGES + 3)
                assert await serve_on(clients[d.node], q, f"q-{k}") == DOC_PAGES
                assert (await rc.complete(d.route_id, grpc.StatusCode.OK)).known
            listed = await rc.list_nodes()
            assert [n.name for n in listed.nodes] == ["n0", "n1", "n2"]
            assert all(n.connected and n.namespace_ok and n.breaker == "closed" for n in listed.nodes)
            assert all(n.in_flight == 0 and n.l1_pages >= DOC_PAGES for n in listed.nodes)
            assert sum(n.routed for n in listed.nodes) == 15
            before = {n.name: (n.l1_pages, n.l2_pages) for n in listed.nodes}

            # the router restarts: a new process knows nothing until each node's snapshot arrives
            await rc.close()
            await router.stop()
            router = await start_router(nodes)
            rc = AsyncRouterClient(f"127.0.0.1:{router.port}")
            after = {n.name: (n.l1_pages, n.l2_pages) for n in (await rc.list_nodes()).nodes}
            assert after == before
            for i, doc in enumerate(docs):
                d = await rc.route(np.concatenate([doc, tokens(300 + i, 1)]), peek=True)
                assert (d.node, d.l1_pages) == (home[i], DOC_PAGES)

            # bad requests are the client's problem: INVALID_ARGUMENT, and nobody's breaker moves
            for bad in (rpb.RouteRequest(tokens=b"\x01\x02\x03"), rpb.RouteRequest(),
                        rpb.RouteRequest(token_ids=[-1, 5]), rpb.RouteRequest(token_ids=[1], policy="zz")):
                try:
                    await rc.stub.Route(bad)
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
                else:
                    raise AssertionError("accepted bad tokens")
            try:
                await rc.stub.Route(rpb.RouteRequest(token_ids=[1] * 8, namespace=pb.NamespaceRef(model="other")))
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
            else:
                raise AssertionError("accepted another model")
            assert all(n.breaker == "closed" for n in (await rc.list_nodes()).nodes)

            # a node goes away: its pages leave the index at once (it may come back empty)
            lost = home[0]
            idx = int(lost[1])
            old_id = (await rc.list_nodes()).nodes[idx].server_id
            port = nodes[idx].port
            await nodes[idx].stop(0.1)

            async def gone() -> bool:
                d = await rc.route(docs[0], peek=True)
                return d.scores[idx].l1_pages == 0 and not (await rc.list_nodes()).nodes[idx].connected

            await eventually(gone)
            info = (await rc.list_nodes()).nodes[idx]
            assert info.l1_pages == 0 and info.last_error
            d = await rc.route(docs[1], peek=True)
            assert (d.node, d.l1_pages) == (home[1], DOC_PAGES)  # the others are untouched

            # it restarts on the same address (a new server run, empty cache): the router reconnects,
            # takes the new snapshot, closes the breaker the outage may have opened
            nodes[idx] = NodeServer(node_config(serve={"port": port, "metrics_port": 0, "shared_pool": False,
                                                       "shutdown_grace_s": 1.0}))
            await nodes[idx].start()

            async def back() -> bool:
                n = (await rc.list_nodes()).nodes[idx]
                return n.connected and n.server_id not in ("", old_id) and n.breaker == "closed"

            await eventually(back, timeout=20)
            c = clients[lost]
            q = np.concatenate([docs[0], tokens(400, 1)])
            await serve_on(c, q, "after-restart")
            await eventually(lambda: _has(rc, docs[0], lost))
        finally:
            await rc.close()
            await router.stop()
            for c in clients.values():
                await c.close()
            for n in nodes:
                await n.stop(0.1)

    asyncio.run(main())


async def _has(rc: AsyncRouterClient, toks: np.ndarray, node: str) -> bool:
    d = await rc.route(toks, peek=True)
    return (d.node, d.l1_pages) == (node, DOC_PAGES)


def test_index_stays_exact_when_the_node_resnapshots_a_slow_subscriber() -> None:
    """A tiny event queue makes the node drop the router's queue and send fresh snapshots mid-stream;
    after a burst of commits and evictions the router's view equals what the node itself matches."""

    async def main() -> None:
        nodes = await start_nodes(1)
        client = AsyncHiCacheClient(f"127.0.0.1:{nodes[0].port}")
        router = await start_router(nodes, event_queue=1)
        rc = AsyncRouterClient(f"127.0.0.1:{router.port}")
        try:
            prompts = [tokens(500 + i, 6) for i in range(20)]  # 120 pages through a 64-page L1
            gate = asyncio.Semaphore(8)  # at most 48 pages held at once: the burst never runs L1 out of room

            async def one(i: int, p: np.ndarray) -> int:
                async with gate:
                    return await serve_on(client, p, f"burst-{i}")

            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            # The router may have kept up with that burst. These evictions run on the node's event loop
            # (a synchronous call from this coroutine), so all their events are queued before the
            # subscriber's stream can take one: the 1-event queue overflows for certain.
            cache = nodes[0].cache
            assert cache is not None
            freed, _ = cache.evict(l1_pages=64)
            assert freed >= 12  # two 6-page nodes at least: two events or more

            async def exact() -> bool:
                for p in prompts:
                    want = await client.match(p, peek=True, skip_l3=True)
                    d = await rc.route(p, peek=True)
                    if (d.l1_pages, d.l2_pages) != (want.l1_pages, want.l2_pages):
                        return False
                return True

            await eventually(exact)
            feed = router.router.index.feed("n0")
            assert feed.snapshots >= 2  # the node did re-snapshot the stream at least once
        finally:
            await rc.close()
            await router.stop()
            await client.close()
            await nodes[0].stop(0.1)

    asyncio.run(main())
