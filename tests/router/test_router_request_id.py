"""A Route that names its request (``request_id``) can be repeated: while its route is in flight the same
request gets that route back and nothing is counted twice, so a reply lost when the connection dropped
leaves no second route holding load until the TTL. Another request under the same id is refused; after
Complete, withdrawal or the TTL the id routes anew."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import generate_latest
from router_helpers import Clock, node_config, router_config, tokens

from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router import Router
from hicache.router.client import AsyncRouterClient, RouterClient
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.core import RequestIdConflict
from hicache.router.server import RouterServer
from tcpproxy import TcpProxy

TTL = 10.0


def new_router(nodes: tuple[str, ...] = ("a", "b")) -> tuple[Router, Clock]:
    r = Router(node_config(), router_config(list(nodes), route_ttl_s=TTL, policy="round_robin"))
    clock = Clock()
    r.inflight._clock = clock
    return r, clock


def req(seed: int) -> bytes:
    return tokens(seed, 3).astype("<u4").tobytes()


def test_a_repeat_gets_the_same_route_and_counts_nothing() -> None:
    r, _ = new_router()
    first = r.route(req(1), request_id="q1")
    again = r.route(req(1), request_id="q1")  # round robin would pick the other node for a new route
    assert not first.replayed and again.replayed
    assert (again.route_id, again.node, again.scores) == (first.route_id, first.node, first.scores)
    assert len(r.inflight) == 1 and r.nodes[first.node].routed == 1
    other = r.route(req(1), request_id="q2")  # another id is another request
    assert other.route_id != first.route_id and other.node != first.node and len(r.inflight) == 2


def test_the_id_routes_anew_after_complete_withdraw_or_the_ttl() -> None:
    r, clock = new_router()
    first = r.route(req(1), request_id="q")
    assert r.complete(first.route_id) == first.node
    second = r.route(req(1), request_id="q")
    assert not second.replayed and second.route_id != first.route_id
    assert r.withdraw(second.route_id)
    third = r.route(req(1), request_id="q")
    assert not third.replayed and third.route_id not in (first.route_id, second.route_id)
    clock.t += TTL + 1
    fourth = r.route(req(1), request_id="q")
    assert not fourth.replayed and fourth.route_id != third.route_id
    assert len(r.inflight) == 1 and not r.inflight._named.keys() - {("", "q")}


def test_another_request_under_an_id_in_flight_is_refused() -> None:
    r, _ = new_router()
    first = r.route(req(1), request_id="q")
    for kw in ({"token_bytes": req(2)}, {"token_bytes": req(1), "policy": "least_load"},
               {"token_bytes": req(1), "exclude": ["b"]}):
        with pytest.raises(RequestIdConflict, match="in flight for another request"):
            r.route(request_id="q", **kw)  # type: ignore[arg-type]
    assert len(r.inflight) == 1
    # the way to retry elsewhere after a failed node: complete the route, then exclude the node
    r.complete(first.route_id, grpc.StatusCode.UNAVAILABLE)
    retry = r.route(req(1), request_id="q", exclude=[first.node])
    assert retry.node != first.node and not retry.replayed


def test_ids_are_per_tenant_and_ignored_by_peeks() -> None:
    r, _ = new_router()
    a = r.route(req(1), tenant="t1", request_id="q")
    b = r.route(req(1), tenant="t2", request_id="q")
    assert a.route_id != b.route_id and not b.replayed
    peek = r.route(req(1), tenant="t1", request_id="q", peek=True)
    assert peek.route_id == "" and not peek.replayed and len(r.inflight) == 2
    with pytest.raises(ValueError, match="request_id: longer than 128 bytes"):
        r.route(req(1), request_id="x" * 129)


MARKER = "lost-reply-marker.invalid:9"  # the node's address: in every Route reply, so a proxy can drop one


@contextlib.asynccontextmanager
async def lone_router() -> AsyncIterator[tuple[RouterServer, TcpProxy]]:
    """A router over one node it never dials (the approximate index), and a proxy in front of it."""
    router = RouterServer(node_config(), RouterConfig(port=0, nodes=[NodeSpec("n0", MARKER)], index="approximate",
                                                      route_ttl_s=600.0))
    await router.start()
    proxy = TcpProxy(router.port)
    try:
        yield router, proxy
    finally:
        proxy.close()
        await router.stop(0.1)


def test_a_reply_lost_in_transit_is_retried_onto_the_same_route() -> None:
    async def main() -> None:
        async with lone_router() as (router, proxy), AsyncRouterClient(f"127.0.0.1:{proxy.port}") as client:
            proxy.arm_at(MARKER.encode())
            d = await client.route(tokens(1, 4), request_id="req-1")
            assert proxy.cuts == 1  # the first reply was lost: this one is the retry's
            assert d.replayed and d.node == "n0"
            assert len(router.router.inflight) == 1 and router.router.nodes["n0"].routed == 1
            text = generate_latest(router.registry).decode()
            assert "hicache_router_routes_replayed_total 1.0" in text
            assert re.search(r'^hicache_router_routes_total\{node="n0",reason="\w+"\} 1\.0$', text, re.M)
            done = await client.complete(d.route_id)
            assert done.known and len(router.router.inflight) == 0

            # a client that names no request cannot be answered again: the lost route stays in flight
            proxy.arm_at(MARKER.encode())
            with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as ch:
                stub = rpb_grpc.RouterStub(ch)
                call = rpb.RouteRequest(tokens=tokens(2, 4).tobytes())
                with pytest.raises(grpc.RpcError) as lost:
                    await asyncio.to_thread(stub.Route, call, timeout=5.0)
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
                await asyncio.to_thread(stub.Route, call, timeout=5.0)
            assert len(router.router.inflight) == 2  # one of them holds load until the TTL

    asyncio.run(main())


def test_the_blocking_client_retries_a_lost_reply_onto_the_same_route() -> None:
    async def main() -> None:
        async with lone_router() as (router, proxy):
            def client() -> None:
                with RouterClient(f"127.0.0.1:{proxy.port}") as c:
                    proxy.arm_at(MARKER.encode())
                    d = c.route(tokens(1, 4))
                    assert proxy.cuts == 1 and d.replayed and d.node == "n0"
                    proxy.arm_at(b"\x08\x01\x12\x02n0")  # CompleteResponse{known, node "n0"}: its reply is lost
                    done = c.complete(d.route_id)
                    assert proxy.cuts == 2 and done.known and done.repeated and done.node == "n0"
                    assert [n.name for n in c.list_nodes().nodes] == ["n0"]

            await asyncio.to_thread(client)
            assert len(router.router.inflight) == 0 and router.router.nodes["n0"].routed == 1
            text = generate_latest(router.registry).decode()
            assert "hicache_router_routes_replayed_total 1.0" in text
            assert 'hicache_router_completed_total{code="OK"} 1.0' in text  # the repeat is not counted again

    asyncio.run(main())


def test_no_node_is_not_retried() -> None:
    async def main() -> None:
        async with lone_router() as (router, _):
            calls = 0
            route = router.router.route

            def counted(*args: object, **kw: object) -> object:
                nonlocal calls
                calls += 1
                return route(*args, **kw)  # type: ignore[arg-type]

            router.router.route = counted  # type: ignore[method-assign]
            with RouterClient(f"127.0.0.1:{router.port}") as c, pytest.raises(grpc.RpcError) as e:
                await asyncio.to_thread(c.route, tokens(1, 4), exclude=["n0"])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and calls == 1

    asyncio.run(main())


def test_the_server_refuses_a_reused_id_and_a_long_one() -> None:
    async def main() -> None:
        async with lone_router() as (router, _), AsyncRouterClient(f"127.0.0.1:{router.port}") as client:
            first = await client.route(tokens(1, 4), request_id="same")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.route(tokens(2, 4), request_id="same")
            assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
            assert "in flight for another request" in (e.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.route(tokens(1, 4), request_id="x" * 200)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            a, b = await client.route(tokens(3, 4)), await client.route(tokens(3, 4))  # fresh ids each
            assert not a.replayed and not b.replayed and a.route_id != b.route_id
            assert len(router.router.inflight) == 3 and first.route_id

    asyncio.run(main())
