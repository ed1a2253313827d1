"""Clients of the router (``hicache route``): :class:`RouterClient` (blocking, any thread) and
:class:`AsyncRouterClient` (asyncio), the same calls over ``hicache.v1.Router``.

    with RouterClient("127.0.0.1:50061") as r:
        d = r.route(tokens, tenant="acme")            # d.node, d.address, d.l1_pages, d.reason, d.scores
        ... send the request to d.address ...
        r.complete(d.route_id, grpc.StatusCode.OK)     # or the status the node call ended with

    async with AsyncRouterClient("127.0.0.1:50061") as r:
        d = await r.route(tokens, tenant="acme")      # d.node, d.address, d.l1_pages, d.reason, d.scores
        ... send the request to d.address ...
        await r.complete(d.route_id, grpc.StatusCode.OK)   # or the status the node call ended with

Every Route names its request (``request_id``: the caller's, or a fresh one), so a Route whose connection
dropped before the reply came back is sent again as the same request and gets the route the router already
made (``replayed``), instead of leaving a second one in flight until the router's TTL. Complete is repeated
the same way (a repeat finds the route finished and changes nothing). Both retry UNAVAILABLE as
:class:`~hicache.client.RetryPolicy` says, within the call's timeout; the router's own "no node can take
the request" is not retried.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc

from hicache.client._common import (
    ChannelSettings,
    RetryPolicy,
    Tokens,
    call_async,
    call_sync,
    encode_tokens,
    new_request_id,
    ns_ref,
)
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.core import NO_NODE

R = TypeVar("R")


def _no_node(e: grpc.RpcError) -> bool:
    """The router's own refusal for want of a node: a retry would only be refused again."""
    details = getattr(e, "details", None)
    return ((details() if callable(details) else "") or "").startswith(NO_NODE)


def route_request(tokens: Tokens, tenant: str, policy: str, exclude: Sequence[str], peek: bool,
                  request_id: str | None) -> rpb.RouteRequest:
    """A Route naming its request (the caller's id, or a fresh one; none for a peek)."""
    return rpb.RouteRequest(namespace=ns_ref(tenant), tokens=encode_tokens(tokens), policy=policy,
                            exclude_nodes=list(exclude), peek=peek,
                            request_id="" if peek else request_id or new_request_id())


class _Base:
    """The channel and settings both clients share: ``target`` host:port of the router; ``token``: sent as
    ``authorization: Bearer``; TLS / mTLS PEM paths; ``timeout_s`` for each call, retries included;
    ``retry``: backoff on UNAVAILABLE (every call here is safe to repeat)."""

    aio = False

    def __init__(self, target: str, *, token: str = "", timeout_s: float = 5.0, root_certificates: str = "",
                 client_cert: str = "", client_key: str = "", tls: bool = False,
                 retry: RetryPolicy | None = None) -> None:
        self.settings = ChannelSettings(target, token, root_certificates, client_cert, client_key, tls)
        creds = self.settings.credentials()
        opts = self.settings.options()
        mod: Any = grpc.aio if self.aio else grpc
        self.channel = (mod.secure_channel(target, creds, options=opts) if creds is not None
                        else mod.insecure_channel(target, options=opts))
        self.stub = rpb_grpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self._md = self.settings.metadata()


class RouterClient(_Base):
    """Blocking client of the router; calls may come from several threads at once."""

    def _call(self, method: Callable[..., R], request: Any) -> R:
        return call_sync(method, request, self.timeout_s, self._md, self.retry, True, _no_node)

    def route(self, tokens: Tokens, *, tenant: str = "", policy: str = "", exclude: Sequence[str] = (),
              peek: bool = False, request_id: str | None = None) -> rpb.RouteResponse:
        """As :meth:`AsyncRouterClient.route`."""
        r: rpb.RouteResponse = self._call(self.stub.Route, route_request(tokens, tenant, policy, exclude, peek,
                                                                         request_id))
        return r

    def complete(self, route_id: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> rpb.CompleteResponse:
        r: rpb.CompleteResponse = self._call(self.stub.Complete,
                                             rpb.CompleteRequest(route_id=route_id, status_code=code.value[0]))
        return r

    def list_nodes(self) -> rpb.ListNodesResponse:
        r: rpb.ListNodesResponse = self._call(self.stub.ListNodes, rpb.ListNodesRequest())
        return r

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class AsyncRouterClient(_Base):
    """asyncio client of the router."""

    aio = True

    async def _call(self, method: Callable[..., Awaitable[R]], request: Any) -> R:
        """One unary call whose repeat changes nothing, tried again on UNAVAILABLE within ``timeout_s``,
        except the router's refusal for want of a node (a retry would only be refused again)."""
        return await call_async(method, request, self.timeout_s, self._md, self.retry, True, _no_node)

    async def route(self, tokens: Tokens, *, tenant: str = "", policy: str = "", exclude: Sequence[str] = (),
                    peek: bool = False, request_id: str | None = None) -> rpb.RouteResponse:
        """Where to send the request. ``request_id``: the caller's name for it (default: a fresh one);
        reusing it for another request while its route is in flight is refused (ALREADY_EXISTS)."""
        r: rpb.RouteResponse = await self._call(self.stub.Route, route_request(tokens, tenant, policy, exclude, peek,
                                                                               request_id))
        return r

    async def complete(self, route_id: str, code: grpc.StatusCode = grpc.StatusCode.OK) -> rpb.CompleteResponse:
        req = rpb.CompleteRequest(route_id=route_id, status_code=code.value[0])
        r: rpb.CompleteResponse = await self._call(self.stub.Complete, req)
        return r

    async def list_nodes(self) -> rpb.ListNodesResponse:
        r: rpb.ListNodesResponse = await self._call(self.stub.ListNodes, rpb.ListNodesRequest())
        return r

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()
