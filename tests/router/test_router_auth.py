"""With router.auth_token set, every method of every service the router registers (its reflection's list, not a
list written here) answers a call without the token, or with another, UNAUTHENTICATED whatever its body;
with the token, garbage gets the router's own INVALID_ARGUMENT. Health stays open for probes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_helpers import node_config
from service.authkit import GARBAGE, bearer, call_raw, path, registered_methods

from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.server import RouterServer

C = grpc.StatusCode
TOKEN = "router-token-1"
HEALTH = "grpc.health.v1.Health"


def test_every_router_method_refuses_a_tokenless_garbage_body() -> None:
    async def main() -> None:
        rc = RouterConfig(port=0, nodes=[NodeSpec("n0", "127.0.0.1:1")], index="approximate", auth_token=TOKEN)
        router = RouterServer(node_config(), rc)
        await router.start()
        target = f"127.0.0.1:{router.port}"
        try:
            with pytest.raises(grpc.RpcError) as ei:
                await asyncio.to_thread(registered_methods, target)
            assert ei.value.code() == C.UNAUTHENTICATED
            methods = await asyncio.to_thread(registered_methods, target, bearer(TOKEN))
            routed = {m.name for m in methods if m.containing_service.full_name == "hicache.v1.Router"}
            assert routed == set(rpb.DESCRIPTOR.services_by_name["Router"].methods_by_name)
            assert HEALTH in {m.containing_service.full_name for m in methods}
            async with grpc.aio.insecure_channel(target) as ch:
                for m in methods:
                    if m.containing_service.full_name == HEALTH:
                        code, _ = await call_raw(ch, m, b"", ()) if m.name == "Check" else (C.OK, [])
                        assert code == C.OK
                        continue
                    for md in ((), bearer("wrong")):
                        code, _ = await call_raw(ch, m, GARBAGE, md)
                        assert code == C.UNAUTHENTICATED, (path(m), md, code)
                    if m.containing_service.full_name == "hicache.v1.Router":
                        code, _ = await call_raw(ch, m, GARBAGE, bearer(TOKEN))
                        assert code == C.INVALID_ARGUMENT, (path(m), code)
        finally:
            await router.stop(0.1)

    asyncio.run(main())
