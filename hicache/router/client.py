"""asyncio client of the router (``hicache route``): typed results over ``hicache.v1.Router``.

    async with AsyncRouterClient("127.0.0.1:50061") as r:
        d = await r.route(tokens, tenant="acme")      # d.node, d.address, d.l1_pages, d.reason, d.scores
        ... send the request to d.address ...
        await r.complete(d.route_id, grpc.StatusCode.OK)   # or the status the node call ended with
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import grpc

from hicache.client._common import ChannelSettings, Tokens, encode_tokens, ns_ref
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc


class AsyncRouterClient:
    def __init__(self, target: str, *, token: str = "", timeout_s: float = 5.0, root_certificates: str = "",
                 client_cert: str = "", client_key: str = "", tls: bool = False) -> None:
        self.settings = ChannelSettings(target, token, root_certificates, client_cert, client_key, tls)
        creds = self.settings.credentials()
        opts = self.settings.options()
        self.channel = (grpc.aio.secure_channel(target, creds, options=opts) if creds is not None
                        else grpc.aio.insecure_channel(target, options=opts))
        self.stub = rpb_grpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        self._md = self.settings.metadata()

    async def route(self, tokens: Tokens, *, tenant: str = "", policy: str = "", exclude: Sequence[str] = (),
                    peek: bool = False) -> rpb.RouteResponse:
        req = rpb.RouteRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens), policy=policy,
                               exclude_nodes=list(exclude), peek=peek)
        r: rpb.RouteResponse = await self.stub.Route(req, timeout=self.timeout_s, metadata=self._md)
        return r

    async def complete(self, route_id: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> rpb.CompleteResponse:
        req = rpb.CompleteRequest(route_id=route_id, status_code=code.value[0])
        r: rpb.CompleteResponse = await self.stub.Complete(req, timeout=self.timeout_s, metadata=self._md)
        return r

    async def list_nodes(self) -> rpb.ListNodesResponse:
        r: rpb.ListNodesResponse = await self.stub.ListNodes(rpb.ListNodesRequest(), timeout=self.timeout_s,
                                                             metadata=self._md)
        return r

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
