"""Raw bytes at every RPC of every service the node and the router register (their descriptors, not a list
written here): garbage, valid messages cut short, huge length prefixes, wrong wire types, and messages of
another RPC, each without a token, with a wrong one and with a tenant's token.

Without a known token every call is UNAUTHENTICATED, whatever its body. With the token a ``hicache.v1`` call
ends OK or with a refusal (never UNKNOWN, INTERNAL or a hang); a MatchStream refuses in band and goes on.
After every case the node is whole again (:func:`probekit.assert_whole`: nothing in flight, no request
open, no page locked or lost) and the router counts no route in flight once the probe completed what it
was given.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.descriptor import MethodDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.server import RouterServer
from hicache.service.server import NodeServer

from .probekit import (
    HEALTH,
    HUGE_PREFIXES,
    NODE_SERVICE,
    PS,
    ROUTER_SERVICE,
    WRONG_WIRE_TYPES,
    Background,
    C,
    assert_whole,
    bearer,
    call,
    cleanup,
    message_class,
    methods_of,
    start_node,
    start_router,
    truncations,
)

REFUSALS = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.PERMISSION_DENIED, C.ALREADY_EXISTS,
            C.RESOURCE_EXHAUSTED, C.OUT_OF_RANGE}
TOKS = (np.arange(3 * PS, dtype=np.uint32) + 7).tobytes()
ACME = pb.NamespaceRef(tenant="acme")
RID = "probe"
# a body over the node's max_message_bytes (1 MiB) and the router's receive limit (4 MiB): each costs a few
# hundred ms to send, so it goes to one method of each kind (unary, client stream, server stream)
BIG = b"\x0a\x7f" + b"\x00" * (2 << 20)
BIG_ROUTER = b"\x0a\x7f" + b"\x00" * (5 << 20)
BIG_BODY_METHODS = ("Match", "WritePages", "ReadPages", "MatchStream")


def node_templates(bpp: int) -> dict[str, bytes]:
    """A valid request of each node RPC, by input type (tenant acme, request id ``probe``)."""
    msgs: list[Any] = [
        pb.MatchRequest(request_id=RID, namespace=ACME, tokens=TOKS, return_keys=True),
        pb.PrefetchRequest(request_id=RID, stream_progress=True), pb.AllocateRequest(request_id=RID, num_pages=2),
        pb.CommitRequest(request_id=RID, tokens=TOKS, device_indices=[0, 1, 2]), pb.ReleaseRequest(request_id=RID),
        pb.StatsRequest(), pb.WatchEventsRequest(max_queue=8), pb.GetPoolInfoRequest(), pb.AttachRequest(),
        pb.ReadPagesRequest(namespace=ACME, tokens=TOKS, max_pages=2), pb.FlushRequest(timeout_s=0.5),
        pb.PinRequest(namespace=ACME, tokens=TOKS), pb.UnpinRequest(pin_id=1), pb.ListPinsRequest(),
        pb.ClearRequest(),
    ]
    out = {type(m).DESCRIPTOR.full_name: m.SerializeToString() for m in msgs}
    # WritePages: its header (the first message of the stream; the data would come next)
    out[pb.WritePagesChunk.DESCRIPTOR.full_name] = pb.WritePagesChunk(
        header=pb.WritePagesHeader(namespace=ACME, tokens=TOKS)).SerializeToString()
    return out


def router_templates() -> dict[str, bytes]:
    # peek first on the wire: a valid message cut short keeps it (or is empty, and refused for no tokens)
    route = rpb.RouteRequest(peek=True).SerializeToString() + rpb.RouteRequest(
        namespace=ACME, tokens=TOKS, policy="cache_aware").SerializeToString()
    return {rpb.RouteRequest.DESCRIPTOR.full_name: route,
            rpb.CompleteRequest.DESCRIPTOR.full_name: rpb.CompleteRequest(route_id="x-1.abc",
                                                                          status_code=14).SerializeToString(),
            rpb.ListNodesRequest.DESCRIPTOR.full_name: b""}


def bodies(m: MethodDescriptor, templates: dict[str, bytes], rng: np.random.Generator) -> Iterator[tuple[str, bytes]]:
    valid = templates.get(m.input_type.full_name, message_class(m.input_type)().SerializeToString())
    yield "valid", valid
    for i, cut in enumerate(truncations(valid)):
        yield f"truncated-{i}", cut
    for i, b in enumerate(HUGE_PREFIXES):
        yield f"huge-prefix-{i}", b
    for i, b in enumerate(WRONG_WIRE_TYPES):
        yield f"wire-type-{i}", b
    for name, other in templates.items():  # another RPC's message
        if name != m.input_type.full_name:
            yield f"as-{name.rsplit('.', 1)[1]}", other
    for i in range(3):
        yield f"random-{i}", rng.integers(0, 256, int(rng.integers(1, 200)), dtype=np.uint8).tobytes()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeServer, RouterServer]]:
    bg = Background()
    tmp = tmp_path_factory.mktemp("probe-fuzz")
    node = start_node(bg, tmp)
    router = start_router(bg, tmp)
    try:
        yield node, router
    finally:
        bg.run(router.stop(0.1))
        bg.run(node.stop(0.1))
        bg.close()


@pytest.fixture(scope="module")
def channels(servers: tuple[NodeServer, RouterServer]) -> Iterator[tuple[grpc.Channel, grpc.Channel]]:
    node, router = servers
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as n, grpc.insecure_channel(f"127.0.0.1:{router.port}") as r:
        yield n, r


def check_node_reply(m: MethodDescriptor, case: str, code: C, replies: list[bytes]) -> None:
    if m.containing_service.full_name != NODE_SERVICE:
        # health, reflection: grpc's own handlers; they answer, or refuse what they cannot decode
        assert code in {C.OK, C.INVALID_ARGUMENT, C.UNKNOWN, C.INTERNAL, C.NOT_FOUND, C.UNIMPLEMENTED}, (m.name,
                                                                                                       case, code)
        return
    assert code in REFUSALS, (m.name, case, code)
    if m.name == "MatchStream":
        assert code == C.OK and len(replies) == 1, (case, code, replies)


def test_node_refuses_every_body_without_a_known_token(servers: tuple[NodeServer, RouterServer],
                                                       channels: tuple[grpc.Channel, grpc.Channel]) -> None:
    node, _ = servers
    ch = channels[0]
    assert node.cache is not None
    templates = node_templates(node.cache.layout.bytes_per_page)
    rng = np.random.default_rng(1)
    odd = (bearer("wrong"), (("authorization", "tok-acme"),), (("authorization", "Bearer "),),
           (("authorization", "Bearer tok-acme "),), (("authorization", "bearer tok-acme"),))
    for m in methods_of(NODE_SERVICE, "grpc.reflection.v1alpha.ServerReflection"):
        for case, body in bodies(m, templates, rng):
            # the decision reads metadata alone: every body without a token, a few with each wrong one
            for md in ((), *odd) if case in ("valid", "truncated-0", "huge-prefix-0", "random-0") else ((),):
                code, _ = call(ch, m, body, md, first_only=True)
                assert code == C.UNAUTHENTICATED, (m.name, case, md, code)
        if m.name in BIG_BODY_METHODS:  # a body past serve.max_message_bytes: refused for the token all the same
            for md in ((), bearer("wrong")):
                code, _ = call(ch, m, BIG, md, first_only=True)
                assert code == C.UNAUTHENTICATED, (m.name, md, code)
    assert_whole(node, ch, "no token")
    assert node.servicer._counts == {} or all(k[0] in {"Stats", "Clear"} for k in node.servicer._counts)


def test_node_answers_every_body_with_a_refusal_and_leaks_nothing(servers: tuple[NodeServer, RouterServer],
                                                                  channels: tuple[grpc.Channel, grpc.Channel]) -> None:
    node, _ = servers
    ch = channels[0]
    assert node.cache is not None
    templates = node_templates(node.cache.layout.bytes_per_page)
    rng = np.random.default_rng(2)
    seen: set[str] = set()
    for m in methods_of(NODE_SERVICE, HEALTH):
        for case, body in bodies(m, templates, rng):
            code, replies = call(ch, m, body, bearer("acme"), first_only=True)
            check_node_reply(m, case, code, replies)
            cleanup(ch, m, code, replies, bearer("acme"))
            seen.add(m.name)
            assert_whole(node, ch, (m.name, case, code))
        if m.name in BIG_BODY_METHODS:  # past serve.max_message_bytes (1 MiB here): refused for its size
            code, _ = call(ch, m, BIG, bearer("acme"))
            assert code == C.RESOURCE_EXHAUSTED, (m.name, code)
            assert_whole(node, ch, (m.name, "big"))
    assert seen >= set(pb.DESCRIPTOR.services_by_name["HiCache"].methods_by_name)
    assert_whole(node, ch, "after all")


def test_node_garbage_from_hypothesis(servers: tuple[NodeServer, RouterServer],
                                      channels: tuple[grpc.Channel, grpc.Channel]) -> None:
    node, _ = servers
    ch = channels[0]
    methods = methods_of(NODE_SERVICE)

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.sampled_from(methods), st.binary(max_size=96))
    def one(m: MethodDescriptor, body: bytes) -> None:
        code, replies = call(ch, m, body, bearer("acme"), first_only=True)
        check_node_reply(m, "hypothesis", code, replies)
        cleanup(ch, m, code, replies, bearer("acme"))

    one()
    assert_whole(node, ch, "hypothesis")


def _router_whole(router: RouterServer, ch: grpc.Channel, what: Any) -> None:
    assert len(router.router.inflight) == 0, (what, len(router.router.inflight))


def test_router_every_body_with_and_without_a_token(servers: tuple[NodeServer, RouterServer],
                                                    channels: tuple[grpc.Channel, grpc.Channel]) -> None:
    _, router = servers
    ch = channels[1]
    templates = router_templates()
    rng = np.random.default_rng(3)
    stub = rpb_grpc.RouterStub(ch)
    for m in methods_of(ROUTER_SERVICE, HEALTH, "grpc.reflection.v1alpha.ServerReflection"):
        big = [("big", BIG_ROUTER)] if m.name in ("Route", "Check") else []
        for case, body in [*bodies(m, templates, rng), *big]:
            if m.containing_service.full_name != HEALTH:
                for md in ((), bearer("wrong")):
                    code, _ = call(ch, m, body, md, first_only=True)
                    assert code == C.UNAUTHENTICATED, (m.name, case, md, code)
            if m.containing_service.full_name != ROUTER_SERVICE:
                continue
            code, replies = call(ch, m, body, bearer("acme"))
            if case == "big":
                assert code == C.RESOURCE_EXHAUSTED, (m.name, code)
                continue
            assert code in REFUSALS, (m.name, case, code)
            if code == C.OK and m.name == "Route":
                rid = rpb.RouteResponse.FromString(replies[0]).route_id
                if rid:  # a Route that lost its peek: the probe completes it, as a client would
                    assert stub.Complete(rpb.CompleteRequest(route_id=rid), metadata=bearer("acme"),
                                         timeout=5).known
            _router_whole(router, ch, (m.name, case))
    _router_whole(router, ch, "after all")
