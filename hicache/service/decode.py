"""Requests that cannot be decoded get INVALID_ARGUMENT with a message.

gRPC answers a request whose bytes its deserializer rejects (truncated or corrupt protobuf, invalid UTF-8
in a string field) with UNKNOWN, before any handler runs. :class:`DecodeGuard` wraps each ``hicache.v1``
method's deserializer so that such a message becomes an :class:`Undecodable` value instead. A unary-request
method then ends with INVALID_ARGUMENT before its handler runs; handlers of request streams (MatchStream,
WritePages) see the value in their stream and refuse that message. The node and the router both use it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

SERVICE_PREFIX = "/hicache.v1."


class Undecodable:
    """A request message that could not be decoded; ``reason`` is the decoder's message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    @property
    def message(self) -> str:
        return f"request message could not be decoded: {self.reason}"


def _guarded(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError and friends: bad bytes from the client
            return Undecodable(str(e) or type(e).__name__)

    return decode


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Wraps the request deserializer of every ``hicache.v1`` method (see the module docstring)."""

    def __init__(self) -> None:
        # method -> (the handler the server looked up, its guarded copy): built once per method, not per call
        self._guarded: dict[str, tuple[Any, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (handler is None or not details.method.startswith(SERVICE_PREFIX)
                or getattr(handler, "request_deserializer", None) is None or not hasattr(handler, "_replace")):
            return handler
        seen = self._guarded.get(details.method)
        if seen is not None and seen[0] is handler:
            return seen[1]
        guarded = self._guard(handler)
        self._guarded[details.method] = (handler, guarded)
        return guarded

    @staticmethod
    def _guard(handler: Any) -> grpc.RpcMethodHandler:
        handler = handler._replace(request_deserializer=_guarded(handler.request_deserializer))
        if handler.unary_unary is not None:
            handler = handler._replace(unary_unary=_refuse_unary(handler.unary_unary))
        elif handler.unary_stream is not None:
            handler = handler._replace(unary_stream=_refuse_unary_stream(handler.unary_stream))
        return handler


def _refuse_unary(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def behavior(request: Any, context: Any) -> Any:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await fn(request, context)

    return behavior


def _refuse_unary_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def behavior(request: Any, context: Any) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for item in fn(request, context):
            yield item

    return behavior
