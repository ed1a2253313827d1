"""The outside probe's kit: a node and a router running in a thread of their own (one per test module), raw
calls by method descriptor, and the leak check every probe case ends with.

The servers run in-process, each on its own event loop in a daemon thread, so a module starts them in a
fraction of a second and the tests call them over real sockets with the synchronous gRPC client, exactly as
an outside caller would. :func:`assert_whole` is the leak check: no RPC in flight, no request open, no L1
page locked (once the backups in flight ended), and, once an admin Clear dropped what the cases cached, every
L1 and L2 page free again with the pools' bookkeeping intact.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from hicache.config import config_from_dict
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.server import RouterServer
from hicache.service.server import NodeServer

T = TypeVar("T")
C = grpc.StatusCode
PS = 4
TOKENS = {"acme": "tok-acme", "beta": "tok-beta", "every": "tok-every", "ops": "tok-ops"}
TOKENS_FILE = f"""tokens:
  - {{name: acme-app, token: {TOKENS["acme"]}, tenants: [acme]}}
  - {{name: beta-app, token: {TOKENS["beta"]}, tenants: [beta]}}
  - {{name: every, token: {TOKENS["every"]}, tenants: ["*"]}}
  - {{name: ops, token: {TOKENS["ops"]}, admin: true}}
"""
NODE_SERVICE = "hicache.v1.HiCache"
ROUTER_SERVICE = "hicache.v1.Router"
HEALTH = "grpc.health.v1.Health"


def bearer(who: str) -> tuple[tuple[str, str], ...]:
    """Metadata with the token of ``who`` (a key of TOKENS), or ``who`` itself as the token."""
    return (("authorization", f"Bearer {TOKENS.get(who, who)}"),)


def node_config(**sections: dict[str, Any]) -> Any:
    base: dict[str, dict[str, Any]] = {
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": PS},
        "cache": {"l1_tokens": 64 * PS, "l2_tokens": 64 * PS},
        "serve": {"port": 0, "metrics_port": 0, "shared_pool": False, "shutdown_grace_s": 1.0,
                  "max_message_bytes": 1 << 20},
    }
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return config_from_dict(base)


class Background:
    """An event loop in a daemon thread: servers live there, tests hand it coroutines."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="probe-loop", daemon=True)
        self._thread.start()

    def run(self, aw: Awaitable[T], timeout_s: float = 30.0) -> T:
        async def wrap() -> T:
            return await aw

        fut: Future[T] = asyncio.run_coroutine_threadsafe(wrap(), self.loop)
        return fut.result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def start_node(bg: Background, tmp: Path, **sections: dict[str, Any]) -> NodeServer:
    """A node with the probe's tokens file (unless ``serve`` names other auth) started on ``bg``'s loop."""
    f = tmp / "tokens.yaml"
    f.write_text(TOKENS_FILE)
    serve = {"auth_tokens_file": str(f), **sections.pop("serve", {})}
    node = NodeServer(node_config(serve=serve, **sections))
    bg.run(node.start())
    return node


def start_router(bg: Background, tmp: Path, **kw: Any) -> RouterServer:
    """A router (approximate index: it needs no live node) with the probe's tokens file."""
    f = tmp / "router-tokens.yaml"
    f.write_text(TOKENS_FILE)
    rc = RouterConfig(port=0, nodes=[NodeSpec("n0", "127.0.0.1:1"), NodeSpec("n1", "127.0.0.1:2")],
                      index="approximate", max_request_tokens=4096, **{"auth_tokens_file": str(f), **kw})
    router = RouterServer(node_config(), rc)
    bg.run(router.start())
    return router


def methods_of(*services: str) -> list[MethodDescriptor]:
    pool = descriptor_pool.Default()
    return [m for s in services for m in pool.FindServiceByName(s).methods]


def path(m: MethodDescriptor) -> str:
    return f"/{m.containing_service.full_name}/{m.name}"


def message_class(descriptor: Any) -> type[Message]:
    return GetMessageClass(descriptor)  # type: ignore[no-any-return]


def call(ch: grpc.Channel, m: MethodDescriptor, body: bytes, md: Sequence[tuple[str, str]] = (),
         timeout_s: float = 5.0, first_only: bool = False) -> tuple[C, list[bytes]]:
    """``body`` (raw bytes) as the one request message of ``m``; the status code and the replies (raw).
    ``first_only``: a server stream is cut after its first reply (WatchEvents never ends), counted OK."""
    p, md = path(m), tuple(md)
    try:
        if m.server_streaming:
            it = (ch.stream_stream(p)(iter([body]), metadata=md, timeout=timeout_s) if m.client_streaming
                  else ch.unary_stream(p)(body, metadata=md, timeout=timeout_s))
            out: list[bytes] = []
            for reply in it:
                out.append(reply)
                if first_only:
                    it.cancel()
                    break
            return C.OK, out
        if m.client_streaming:
            return C.OK, [ch.stream_unary(p)(iter([body]), metadata=md, timeout=timeout_s)]
        return C.OK, [ch.unary_unary(p)(body, metadata=md, timeout=timeout_s)]
    except grpc.RpcError as e:
        return e.code(), []  # type: ignore[attr-defined]


def wait_until(cond: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def stats(ch: grpc.Channel) -> pb.StatsResponse:
    return pb_grpc.HiCacheStub(ch).Stats(pb.StatsRequest(), metadata=bearer("ops"), timeout=5)


def assert_whole(node: NodeServer, ch: grpc.Channel, what: Any = "") -> None:
    """The leak check (see the module docstring): ``ch`` is a channel the admin token may use."""
    s = node.servicer
    assert wait_until(lambda: s.inflight == 0 and s.open_requests == 0 and not s._background), (
        what, "inflight", s.inflight, "open", s.open_requests)
    # an L1 -> L2 backup still copying keeps its pages locked for a moment: wait for it, not for a leak
    wait_until(lambda: stats(ch).l1_pages_locked == 0)
    st = stats(ch)
    assert (st.open_requests, st.l1_pages_locked, st.pins) == (0, 0, 0), (what, st)
    if st.l1_pages_used or st.l2_pages_used:  # what the case cached (or lost): an admin Clear drops the former
        pb_grpc.HiCacheStub(ch).Clear(pb.ClearRequest(), metadata=bearer("ops"), timeout=5)
        st = stats(ch)
    assert (st.l1_pages_used, st.l2_pages_used, st.l1_pages_cached, st.l2_pages_cached) == (0, 0, 0, 0), (what, st)
    assert node.cache is not None
    node.cache.check_integrity()


def cleanup(node_ch: grpc.Channel, m: MethodDescriptor, code: C, replies: list[bytes],
            md: Sequence[tuple[str, str]]) -> None:
    """Undo what a call that succeeded opened, as its caller would: Release a Match's request, Unpin a pin."""
    if code != C.OK or not replies:
        return
    stub = pb_grpc.HiCacheStub(node_ch)
    if m.name == "Match":
        rid = pb.MatchResponse.FromString(replies[0]).request_id
        if rid:
            stub.Release(pb.ReleaseRequest(request_id=rid), metadata=tuple(md), timeout=5)
    elif m.name == "Pin":
        stub.Unpin(pb.UnpinRequest(pin_id=pb.PinInfo.FromString(replies[0]).pin_id), metadata=tuple(md), timeout=5)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def truncations(data: bytes) -> Iterator[bytes]:
    """``data`` cut short at a few places (every byte for short messages)."""
    n = len(data)
    cuts = range(1, n) if n <= 24 else sorted({1, 2, 3, n // 4, n // 2, n - 3, n - 2, n - 1})
    for c in cuts:
        yield data[:c]


HUGE_PREFIXES = [
    b"\x0a" + varint(2**31 - 1) + b"x" * 8,  # field 1, length-delimited, 2 GiB announced
    b"\x12" + varint(2**62) + b"x" * 8,  # field 2, a length past any int32
    b"\x1a" + varint(2**64 - 1),  # field 3, the largest varint
    b"\x0a" + b"\xff" * 11,  # a varint that never ends (over 10 bytes)
    b"\x22" + varint(1 << 20) + b"\x00" * 16,  # field 4, 1 MiB announced, 16 bytes given
]
WRONG_WIRE_TYPES = [
    b"\x08\x01",  # field 1 as a varint (string / message fields expect length-delimited)
    b"\x0d\x01\x02\x03\x04",  # field 1 as fixed32
    b"\x09" + b"\x01" * 8,  # field 1 as fixed64
    b"\x0b\x0c",  # a group start/end (deprecated wire types)
    b"\x0f",  # wire type 7: no such type
    b"\x00\x00",  # field number 0
    b"\x12\x03\xff\xfe\xfd",  # field 2 length-delimited with invalid UTF-8 (a string in some messages)
]
