"""The router's ``/metrics`` tell the truth at any scrape: routes past their TTL are not in flight even when no call
reached the router since, and scrapes at once never count an expired route twice."""

from __future__ import annotations

import asyncio
import sys
import threading
import urllib.request

import numpy as np
from cli_procs import free_port
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from router_helpers import node_config, tokens

from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.server import RouterServer
from hicache.service.server import NodeServer


def values(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


async def start(ttl_s: float, metrics: bool = False) -> tuple[NodeServer, RouterServer]:
    node = NodeServer(node_config(serve={"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0}))
    await node.start()
    router = RouterServer(node_config(), RouterConfig(port=0, metrics_port=free_port() if metrics else 0,
                                                      route_ttl_s=ttl_s,
                                                      nodes=[NodeSpec("n0", f"127.0.0.1:{node.port}")]))
    await router.start()
    await router.wait_synced(10)
    return node, router


def test_an_idle_router_scrapes_expired_routes_as_expired() -> None:
    async def main() -> None:
        node, router = await start(ttl_s=2.0, metrics=True)
        try:
            r = router.router
            tb = tokens(1, 3).tobytes()
            r.route(tb)
            r.route(tb)
            url = f"http://127.0.0.1:{router.metrics_port}/metrics"

            def scrape() -> dict[str, float]:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    return values(resp.read().decode())

            m = await asyncio.to_thread(scrape)
            assert (m["hicache_router_inflight"], m["hicache_router_routes_expired_total"]) == (2, 0)
            await asyncio.sleep(2.1)  # past the TTL; nothing calls the router meanwhile
            m = await asyncio.to_thread(scrape)
            assert (m["hicache_router_inflight"], m["hicache_router_routes_expired_total"]) == (0, 2)
            assert r.inflight.count("n0") == 0
        finally:
            await router.stop(0.1)
            await node.stop(0.1)

    asyncio.run(main())


ROUTES = 600


def test_scrapes_at_once_count_each_expired_route_once() -> None:
    async def main() -> None:
        node, router = await start(ttl_s=1e-6)
        stop = threading.Event()
        errors: list[BaseException] = []
        scrapes = [0]

        def scraper() -> None:
            try:
                while not stop.is_set():
                    generate_latest(router.registry)
                    scrapes[0] += 1
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=scraper) for _ in range(6)]
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads take turns often: scrapes interleave
        r = router.router
        try:
            for t in threads:
                t.start()
            tb = np.arange(8, dtype=np.uint32).tobytes()
            for _ in range(ROUTES):
                r.route(tb)  # expires the one before (its TTL is over at once)
                await asyncio.sleep(0.0005)  # the scrapes run meanwhile (their bookkeeping: on this loop)
        finally:
            stop.set()
            for t in threads:
                await asyncio.to_thread(t.join, 30)
            sys.setswitchinterval(switch)
        try:
            assert not errors, errors[0]
            assert scrapes[0] >= 100, scrapes  # they did run all along
            r.inflight.expire()
            m = await asyncio.to_thread(lambda: values(generate_latest(router.registry).decode()))
            assert m["hicache_router_routes_expired_total"] == r.inflight.expired == ROUTES
            assert m["hicache_router_inflight"] == 0
        finally:
            await router.stop(0.1)
            await node.stop(0.1)

    asyncio.run(main())
