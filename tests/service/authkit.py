"""Raw calls to every method of a server, by descriptor (the node's and the router's auth tests).

The methods come from the services a server registers (what its reflection lists, looked up in the
descriptor pool the generated modules filled), never from a list written here: a method added to a proto
is covered as soon as it exists.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

# field 1, length-delimited, 127 bytes announced and 40 given: no message decodes from it
GARBAGE = b"\x0a\x7f" + b"\xff" * 40


def registered_methods(target: str, metadata: Sequence[tuple[str, str]] = ()) -> list[MethodDescriptor]:
    """Every method of every service the server at ``target`` registers (what its reflection lists; reflection
    needs the token too where the server wants one)."""
    with grpc.insecure_channel(target) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(stub.ServerReflectionInfo(iter([req]), metadata=tuple(metadata), timeout=10))
    names = [s.name for s in resp.list_services_response.service]
    pool = descriptor_pool.Default()
    return [m for name in sorted(names) for m in pool.FindServiceByName(name).methods]


def path(method: MethodDescriptor) -> str:
    return f"/{method.containing_service.full_name}/{method.name}"


async def call_raw(ch: grpc.aio.Channel, method: MethodDescriptor, body: bytes,
                   metadata: Sequence[tuple[str, str]] = (), timeout_s: float = 10.0
                   ) -> tuple[grpc.StatusCode, list[bytes]]:
    """Send ``body`` (bytes as they are) as the one request message of ``method``; the call's status code
    and the response messages (bytes) it got."""
    p = path(method)
    md = tuple(metadata)
    try:
        if method.client_streaming and method.server_streaming:
            call = ch.stream_stream(p)(iter([body]), metadata=md, timeout=timeout_s)
            return grpc.StatusCode.OK, [m async for m in call]
        if method.client_streaming:
            return grpc.StatusCode.OK, [await ch.stream_unary(p)(iter([body]), metadata=md, timeout=timeout_s)]
        if method.server_streaming:
            call = ch.unary_stream(p)(body, metadata=md, timeout=timeout_s)
            return grpc.StatusCode.OK, [m async for m in call]
        return grpc.StatusCode.OK, [await ch.unary_unary(p)(body, metadata=md, timeout=timeout_s)]
    except grpc.aio.AioRpcError as e:
        return e.code(), []


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)
