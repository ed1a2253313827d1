"""With auth on, a call without a known token is UNAUTHENTICATED whatever its body, for every method of every
service the node registers, and nothing reads or decodes that body first.

The methods are the ones the node's reflection lists (:mod:`.authkit`), each sent raw garbage bytes: with no
token or a wrong one the answer is UNAUTHENTICATED (a multi-MB body too); with the token, the node's own
answer to garbage (INVALID_ARGUMENT, or an in-band refusal on MatchStream). Health stays open; reflection
needs the token. A recording interceptor behind the auth one shows that refused calls never reached the
handler lookup, where the request deserializers are.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest

from hicache.config import config_from_dict
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.service import server as server_mod
from hicache.service.decode import DecodeGuard
from hicache.service.server import NodeServer

from .authkit import GARBAGE, bearer, call_raw, path, registered_methods

C = grpc.StatusCode
TOKEN = "node-token-1"
HEALTH = "grpc.health.v1.Health"


class Recording(DecodeGuard):
    """DecodeGuard (which wraps every hicache.v1 deserializer) that notes each method reaching it."""

    reached: ClassVar[list[str]] = []

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        Recording.reached.append(details.method)
        return await super().intercept_service(continuation, details)


def node_config(**serve: Any) -> Any:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": 4},
        "cache": {"l1_tokens": 256, "l2_tokens": 256},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0, **serve},
    })


@asynccontextmanager
async def node(monkeypatch: pytest.MonkeyPatch, **serve: Any) -> AsyncIterator[NodeServer]:
    monkeypatch.setattr(server_mod, "DecodeGuard", Recording)
    server = NodeServer(node_config(**serve))
    await server.start()
    try:
        yield server
    finally:
        await server.stop(0.1)


@pytest.mark.parametrize("mode", ["auth_token", "auth_tokens_file"])
def test_every_method_refuses_a_tokenless_garbage_body_before_reading_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str) -> None:
    if mode == "auth_token":
        serve: dict[str, Any] = {"auth_token": TOKEN}
    else:
        f = tmp_path / "tokens.yaml"
        f.write_text(f"tokens:\n  - {{name: a, token: {TOKEN}, tenants: ['']}}\n")
        serve = {"auth_tokens_file": str(f)}

    async def main() -> None:
        async with node(monkeypatch, **serve) as n:
            target = f"127.0.0.1:{n.port}"
            with pytest.raises(grpc.RpcError) as ei:  # reflection needs the token
                await asyncio.to_thread(registered_methods, target)
            assert ei.value.code() == C.UNAUTHENTICATED
            methods = await asyncio.to_thread(registered_methods, target, bearer(TOKEN))
            services = {m.containing_service.full_name for m in methods}
            assert {"hicache.v1.HiCache", HEALTH, "grpc.reflection.v1alpha.ServerReflection"} <= services
            node_methods = {m.name for m in methods if m.containing_service.full_name == "hicache.v1.HiCache"}
            assert node_methods == set(pb.DESCRIPTOR.services_by_name["HiCache"].methods_by_name)
            async with grpc.aio.insecure_channel(target) as ch:
                Recording.reached.clear()
                for m in methods:
                    if m.containing_service.full_name == HEALTH:
                        continue
                    for md in ((), bearer("wrong"), bearer(TOKEN + "x"), (("authorization", TOKEN),)):
                        code, _ = await call_raw(ch, m, GARBAGE, md)
                        assert code == C.UNAUTHENTICATED, (path(m), md, code)
                # the body is not read: one far beyond what it takes to refuse, and past the client's own
                # message limit would not even be sent whole
                big = GARBAGE + b"\x00" * (8 << 20)
                code, _ = await call_raw(ch, pb.DESCRIPTOR.services_by_name["HiCache"].methods_by_name["Match"],
                                         big, bearer("wrong"))
                assert code == C.UNAUTHENTICATED
                assert Recording.reached == [], "a refused call reached the handler lookup"
                # health stays open
                code, _ = await call_raw(ch, pb_method(HEALTH, "Check"), b"", ())
                assert code == C.OK
                # the token: the node's own answer to garbage
                for m in methods:
                    if m.containing_service.full_name != "hicache.v1.HiCache":
                        continue
                    code, replies = await call_raw(ch, m, GARBAGE, bearer(TOKEN))
                    if m.name == "MatchStream":  # refused in band, the stream goes on
                        assert code == C.OK and len(replies) == 1, (m.name, code)
                        err = pb.MatchResponse.FromString(replies[0]).error
                        assert err.code == C.INVALID_ARGUMENT.value[0] and "could not be decoded" in err.message
                    else:
                        assert code == C.INVALID_ARGUMENT, (m.name, code)
                assert len(Recording.reached) == len(node_methods) + 1  # and the health Check

    asyncio.run(main())


def pb_method(service: str, name: str) -> Any:
    from google.protobuf import descriptor_pool

    return descriptor_pool.Default().FindServiceByName(service).methods_by_name[name]


def test_without_auth_every_method_still_decodes_and_refuses_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        async with node(monkeypatch) as n:
            target = f"127.0.0.1:{n.port}"
            methods = await asyncio.to_thread(registered_methods, target)
            async with grpc.aio.insecure_channel(target) as ch:
                for m in methods:
                    if m.containing_service.full_name == "hicache.v1.HiCache" and m.name != "MatchStream":
                        code, _ = await call_raw(ch, m, GARBAGE)
                        assert code == C.INVALID_ARGUMENT, (m.name, code)

    asyncio.run(main())
