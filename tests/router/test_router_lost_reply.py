"""A Route whose reply never reaches the client (the client's deadline passed while the router was busy)
does not count in flight until ``route_ttl_s``: the client cannot know its route id to Complete it. With the
approximate index it predicts nothing either: the request never reached the node."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
from prometheus_client import generate_latest
from router_helpers import node_config, tokens

from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.server import RouterServer


def test_a_route_the_client_gave_up_on_leaves_no_load_behind() -> None:
    async def main() -> None:
        # the approximate index dials no node, so no node service is needed for the router to route
        router = RouterServer(node_config(), RouterConfig(port=0, nodes=[NodeSpec("n0", "127.0.0.1:9")],
                                                          index="approximate", route_ttl_s=600.0))
        await router.start()
        route = router.router.route

        def slow_route(*args: object, **kw: object) -> object:
            time.sleep(0.4)  # a decision that outlasts the client's deadline (a huge prompt, a busy host)
            return route(*args, **kw)  # type: ignore[arg-type]

        router.router.route = slow_route  # type: ignore[method-assign]
        codes: list[grpc.StatusCode] = []

        def client() -> None:
            with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
                stub = rpb_grpc.RouterStub(ch)
                for i in range(2):
                    try:
                        stub.Route(rpb.RouteRequest(tokens=tokens(i, 4).tobytes()), timeout=0.2)
                    except grpc.RpcError as e:
                        codes.append(e.code())

        try:
            await asyncio.to_thread(client)
            assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2, codes
            await asyncio.sleep(0.6)  # the second call's handler finishes
            assert len(router.router.inflight) == 0
            assert router.router.nodes["n0"].routed == 0  # taken back: never answered, so never routed
            text = generate_latest(router.registry).decode()
            assert "hicache_router_inflight 0.0" in text
            assert "hicache_router_routes_unanswered_total 0.0" not in text  # the first at least was decided
            assert 'hicache_router_routes_total{node="n0"' not in text
            assert router.router.nodes["n0"].breaker.state == "closed"  # the node is not to blame
            assert len(router.router.index) == 0  # no prompt reached the node: no page is predicted there
            assert router.router.route(tokens(0, 4).tobytes(), peek=True).l1_pages == 0
            unanswered = float(re.search(r"^hicache_router_routes_unanswered_total (\S+)$", text, re.M)[1])  # type: ignore[index]
            assert f'hicache_router_approx_forgotten_pages_total{{reason="withdrawn"}} {4.0 * unanswered}' in text
        finally:
            await router.stop(0.1)

    asyncio.run(main())
