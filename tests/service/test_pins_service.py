"""Pin / Unpin / ListPins over gRPC: a pinned prefix stays on L1 under other traffic; errors map to
status codes and change nothing."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from hicache.client import HiCacheClient
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb

from .service_harness import ServerProc
from .service_harness import serve_prompt as serve

PS = 16
L1_PAGES = 64


@pytest.fixture(scope="module")
def srv(server_factory: Callable[..., ServerProc]) -> ServerProc:
    return server_factory(cache={"l1_tokens": L1_PAGES * PS, "l2_tokens": 0, "eviction_policy": "lru",
                                 "max_pinned_fraction": 0.25})


def prompt(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, pages * PS).astype(np.uint32)


def test_pinned_prefix_stays_on_l1_and_unpin_lets_it_go(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        system = prompt(1, 8)
        serve(c, system, "sys")
        pin = c.pin(system)
        assert (pin.l1_pages, pin.l2_pages) == (8, 0) and c.pins() == [pin]
        for i in range(40):  # 160 pages of other prompts through a 64-page L1
            serve(c, prompt(100 + i, 4), f"other-{i}")
        assert c.match(system, peek=True).l1_pages == 8
        assert c.unpin(pin.pin_id) == pin and c.pins() == []
        for i in range(40):
            serve(c, prompt(200 + i, 4), f"more-{i}")
        assert c.match(system, peek=True).l1_pages == 0


def test_pin_errors(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.pin(prompt(9, 4))  # nothing cached
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "cached" in e.value.details()
        big = prompt(10, 20)
        serve(c, big, "big")
        with pytest.raises(grpc.RpcError) as e:
            c.pin(big)  # 20 pages > 0.25 of 64
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pinned_fraction" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            c.unpin(12345)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as raw:  # both token fields set
            c.stub.Pin(pb.PinRequest(tokens=big.tobytes(), token_ids=[1, 2]), timeout=5)
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert c.pins() == []


def test_pins_are_per_tenant(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        docs = prompt(20, 4)
        serve(c, docs, "acme-1", tenant="acme")
        with pytest.raises(grpc.RpcError):
            c.pin(docs)  # not in the default namespace
        pin = c.pin(docs, tenant="acme")
        assert pin.l1_pages == 4 and "acme" in pin.namespace
        c.unpin(pin.pin_id)


def test_async_client_pins(srv: ServerProc) -> None:
    import asyncio

    from hicache.client import AsyncHiCacheClient

    docs = prompt(30, 4)
    with HiCacheClient(srv.target) as c:
        serve(c, docs, "async-1")

    async def go() -> None:
        async with AsyncHiCacheClient(srv.target) as c:
            pin = await c.pin(docs)
            assert pin.l1_pages == 4 and await c.pins() == [pin]
            assert await c.unpin(pin.pin_id) == pin and await c.pins() == []

    asyncio.run(go())


def test_clear_keeps_only_pins(srv: ServerProc) -> None:
    with HiCacheClient(srv.target) as c:
        kept, gone = prompt(40, 4), prompt(41, 4)
        serve(c, kept, "clear-kept")
        serve(c, gone, "clear-gone")
        pin = c.pin(kept)
        res = c.clear()
        assert res.l1_pages >= 4 and res.l2_pages == 0  # this node has no L2
        assert c.match(gone, peek=True).l1_pages == 0
        assert c.match(kept, peek=True).l1_pages == 4
        assert c.stats().l1_pages_cached == 4
        c.unpin(pin.pin_id)
        assert c.clear().l1_pages == 4
        assert c.stats().l1_pages_cached == 0
