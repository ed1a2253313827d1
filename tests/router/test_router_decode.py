"""A router answers a request message it cannot decode with INVALID_ARGUMENT, not gRPC's UNKNOWN."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_helpers import node_config

from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.server import RouterServer


def test_undecodable_route_and_complete_are_invalid_argument() -> None:
    async def main() -> None:
        router = RouterServer(node_config(), RouterConfig(port=0, nodes=[NodeSpec("n0", "127.0.0.1:1")]))
        await router.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
                for method in ("Route", "Complete", "ListNodes"):
                    call = ch.unary_unary(f"/hicache.v1.Router/{method}", request_serializer=None,
                                          response_deserializer=None)
                    with pytest.raises(grpc.aio.AioRpcError) as ei:
                        await call(b"\x0a\x05ab", timeout=5)  # field 1, length 5, 2 bytes follow
                    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, ei.value.code())
                    assert "could not be decoded" in (ei.value.details() or "")
        finally:
            await router.stop(0.1)

    asyncio.run(main())
