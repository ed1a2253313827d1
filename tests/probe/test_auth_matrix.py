"""The auth matrix: every RPC of the node and of the router, called with no token, a wrong token, the right
token and another tenant's token, against state another tenant's caller set up (tenant acme: its pages, an
open request, a pin; on the router, a route in flight).

No token and a wrong one: UNAUTHENTICATED. The other tenant's token: PERMISSION_DENIED where the call names
acme's tenant, NOT_FOUND where it names acme's request or pin (as if there were none), an empty or filtered
answer where it lists (ListPins, WatchEvents), its own tenant's pages alone for Clear; node-wide figures
(Stats, GetPoolInfo, ListNodes) for any token. The right token: the call's own answer. Every RPC of the
services' descriptors must have its row (a new RPC fails here until it says what it checks), and each row
ends with the node whole again (:func:`probekit.assert_whole`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import pytest

from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.server import RouterServer
from hicache.service.server import NodeServer

from .probekit import PS, Background, C, assert_whole, bearer, start_node, start_router

PAGES = 3
T_ACME = (np.arange(PAGES * PS, dtype=np.uint32) + 100).tobytes()
T_BETA = (np.arange(PAGES * PS, dtype=np.uint32) + 900).tobytes()
ACME = pb.NamespaceRef(tenant="acme")
BETA = pb.NamespaceRef(tenant="beta")
MD = {"none": (), "wrong": bearer("tok-nobody"), "acme": bearer("acme"), "beta": bearer("beta"),
      "every": bearer("every"), "ops": bearer("ops")}


@dataclass
class State:
    """What acme's caller set up before each row."""

    stub: pb_grpc.HiCacheStub
    bpp: int
    rid: str = "acme-req"
    dev: tuple[int, ...] = ()
    pin_id: int = 0


def code_of(fn: Callable[..., Any], *args: Any) -> tuple[C, Any]:
    """The status of ``fn(*args)`` and its reply (None unless OK)."""
    try:
        return C.OK, fn(*args)
    except grpc.RpcError as e:
        return e.code(), None  # type: ignore[attr-defined]


def write(stub: pb_grpc.HiCacheStub, ns: pb.NamespaceRef, tokens: bytes, bpp: int, md: Any) -> pb.CommitResponse:
    head = pb.WritePagesChunk(header=pb.WritePagesHeader(namespace=ns, tokens=tokens))
    return stub.WritePages(iter([head, pb.WritePagesChunk(data=bytes(range(256)) * (PAGES * bpp // 256))]),
                           metadata=md, timeout=5)


def first(it: Any) -> Any:
    for msg in it:
        it.cancel()
        return msg
    return None


# one row per RPC: (whose token is the right one, the call, what the right token gets, what beta's gets);
# a call returns its reply (or raises), and a check of the reply may follow in `ok`
Row = tuple[str, Callable[[State, Any], Any], C, C]


def _match_stream(s: State, md: Any) -> pb.MatchResponse:
    (reply,) = list(s.stub.MatchStream(iter([pb.MatchRequest(namespace=ACME, tokens=T_ACME, peek=True)]),
                                       metadata=md, timeout=5))
    if reply.HasField("error"):  # refused in band: raise it as the unary Match would
        raise InBand(C.PERMISSION_DENIED if reply.error.code == C.PERMISSION_DENIED.value[0] else C.UNKNOWN)
    return reply


class InBand(grpc.RpcError):
    def __init__(self, code: C) -> None:
        self._code = code

    def code(self) -> C:
        return self._code


NODE_ROWS: dict[str, Row] = {
    "Match": ("acme", lambda s, md: s.stub.Match(pb.MatchRequest(namespace=ACME, tokens=T_ACME, peek=True),
                                                 metadata=md, timeout=5), C.OK, C.PERMISSION_DENIED),
    "MatchStream": ("acme", _match_stream, C.OK, C.PERMISSION_DENIED),
    "Prefetch": ("acme", lambda s, md: list(s.stub.Prefetch(pb.PrefetchRequest(request_id=s.rid), metadata=md,
                                                            timeout=5)), C.OK, C.NOT_FOUND),
    "Allocate": ("acme", lambda s, md: s.stub.Allocate(pb.AllocateRequest(request_id=s.rid, num_pages=1),
                                                       metadata=md, timeout=5), C.OK, C.NOT_FOUND),
    "Commit": ("acme", lambda s, md: s.stub.Commit(pb.CommitRequest(request_id=s.rid, tokens=T_ACME,
                                                                    device_indices=list(s.dev)),
                                                   metadata=md, timeout=5), C.OK, C.NOT_FOUND),
    "Release": ("acme", lambda s, md: s.stub.Release(pb.ReleaseRequest(request_id=s.rid), metadata=md, timeout=5),
                C.OK, C.NOT_FOUND),
    "Stats": ("acme", lambda s, md: s.stub.Stats(pb.StatsRequest(), metadata=md, timeout=5), C.OK, C.OK),
    "WatchEvents": ("acme", lambda s, md: first(s.stub.WatchEvents(pb.WatchEventsRequest(), metadata=md,
                                                                   timeout=5)), C.OK, C.OK),
    "GetPoolInfo": ("acme", lambda s, md: s.stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=md, timeout=5),
                    C.OK, C.OK),
    # the every-tenant token gets past the check; this node's pool is not shared: refused for that
    "Attach": ("every", lambda s, md: s.stub.Attach(pb.AttachRequest(), metadata=md, timeout=5),
               C.FAILED_PRECONDITION, C.PERMISSION_DENIED),
    "ReadPages": ("acme", lambda s, md: list(s.stub.ReadPages(pb.ReadPagesRequest(namespace=ACME, tokens=T_ACME),
                                                              metadata=md, timeout=5)), C.OK, C.PERMISSION_DENIED),
    "WritePages": ("acme", lambda s, md: write(s.stub, ACME, T_ACME, s.bpp, md), C.OK, C.PERMISSION_DENIED),
    "Flush": ("ops", lambda s, md: s.stub.Flush(pb.FlushRequest(), metadata=md, timeout=5), C.OK,
              C.PERMISSION_DENIED),
    "Pin": ("acme", lambda s, md: s.stub.Pin(pb.PinRequest(namespace=ACME, tokens=T_ACME), metadata=md, timeout=5),
            C.OK, C.PERMISSION_DENIED),
    "Unpin": ("acme", lambda s, md: s.stub.Unpin(pb.UnpinRequest(pin_id=s.pin_id), metadata=md, timeout=5),
              C.OK, C.NOT_FOUND),
    "ListPins": ("acme", lambda s, md: s.stub.ListPins(pb.ListPinsRequest(), metadata=md, timeout=5), C.OK, C.OK),
    # a tenant's token clears its own tenants' pages (checked below: beta's Clear leaves acme's)
    "Clear": ("acme", lambda s, md: s.stub.Clear(pb.ClearRequest(), metadata=md, timeout=5), C.OK, C.OK),
}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeServer, RouterServer]]:
    bg = Background()
    tmp = tmp_path_factory.mktemp("probe-auth")
    node = start_node(bg, tmp)
    router = start_router(bg, tmp)
    try:
        yield node, router
    finally:
        bg.run(router.stop(0.1))
        bg.run(node.stop(0.1))
        bg.close()


def setup_acme(stub: pb_grpc.HiCacheStub, bpp: int) -> State:
    """acme's pages (on L1), a request open on them, a pin; beta's pages too (for Clear)."""
    s = State(stub, bpp)
    write(stub, ACME, T_ACME, bpp, MD["acme"])
    write(stub, BETA, T_BETA, bpp, MD["beta"])
    m = stub.Match(pb.MatchRequest(request_id=s.rid, namespace=ACME, tokens=T_ACME), metadata=MD["acme"], timeout=5)
    assert m.l1_pages == PAGES
    s.dev = tuple(m.device_indices)
    s.pin_id = stub.Pin(pb.PinRequest(namespace=ACME, tokens=T_ACME), metadata=MD["acme"], timeout=5).pin_id
    return s


def teardown_acme(s: State) -> None:
    code_of(lambda: s.stub.Release(pb.ReleaseRequest(request_id=s.rid), metadata=MD["acme"], timeout=5))
    code_of(lambda: s.stub.Unpin(pb.UnpinRequest(pin_id=s.pin_id), metadata=MD["acme"], timeout=5))


def hits(stub: pb_grpc.HiCacheStub, ns: pb.NamespaceRef, tokens: bytes, who: str) -> int:
    return stub.Match(pb.MatchRequest(namespace=ns, tokens=tokens, peek=True), metadata=MD[who], timeout=5).l1_pages


def test_node_auth_matrix(servers: tuple[NodeServer, RouterServer]) -> None:
    node, _ = servers
    assert node.cache is not None
    bpp = node.cache.layout.bytes_per_page
    assert set(NODE_ROWS) == set(pb.DESCRIPTOR.services_by_name["HiCache"].methods_by_name)
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pb_grpc.HiCacheStub(ch)
        for name, (right, fn, want_right, want_other) in NODE_ROWS.items():
            s = setup_acme(stub, bpp)
            for who in ("none", "wrong"):
                assert code_of(fn, s, MD[who])[0] == C.UNAUTHENTICATED, (name, who)
            other = "beta" if right != "every" else "acme"  # Attach: a tenant's token is the wrong kind
            code, reply = code_of(fn, s, MD[other])
            assert code == want_other, (name, other, code)
            if name == "ListPins":
                assert list(reply.pins) == []  # acme's pin is not beta's to see
            elif name == "WatchEvents":
                beta_ns = node.cache.ns.with_tenant("beta").digest  # its own run, nothing of acme's
                assert reply.kind == pb.Event.SNAPSHOT and {r.namespace_digest for r in reply.runs} == {beta_ns}
            elif name == "Clear":
                assert (reply.l1_pages, hits(stub, ACME, T_ACME, "acme")) == (PAGES, PAGES)  # beta's pages alone
                assert hits(stub, BETA, T_BETA, "beta") == 0
            assert node.servicer.open_requests == 1, (name, "beta's call reached acme's request")
            code, reply = code_of(fn, s, MD[right])
            assert code == want_right, (name, right, code)
            if name == "WatchEvents":
                assert {r.namespace_digest for r in reply.runs} == {node.cache.ns.with_tenant("acme").digest}
            elif name == "Clear":  # acme's own: all locked by its request or its pin, so nothing goes
                assert reply.l1_pages == 0 and hits(stub, ACME, T_ACME, "acme") == PAGES
            elif name == "Pin":  # a second pin, acme's to end
                stub.Unpin(pb.UnpinRequest(pin_id=reply.pin_id), metadata=MD["acme"], timeout=5)
            teardown_acme(s)
            assert_whole(node, ch, name)


def test_clear_by_a_tenant_token_drops_only_its_tenants_pages(servers: tuple[NodeServer, RouterServer]) -> None:
    node, _ = servers
    assert node.cache is not None
    bpp = node.cache.layout.bytes_per_page
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pb_grpc.HiCacheStub(ch)
        write(stub, ACME, T_ACME, bpp, MD["acme"])
        write(stub, BETA, T_BETA, bpp, MD["beta"])
        # the every-tenant (non-admin) token: a Clear of every tenant is node-wide, so it needs admin
        assert code_of(lambda: stub.Clear(pb.ClearRequest(), metadata=MD["every"], timeout=5))[0] == \
            C.PERMISSION_DENIED
        assert stub.Clear(pb.ClearRequest(), metadata=MD["acme"], timeout=5).l1_pages == PAGES
        assert (hits(stub, ACME, T_ACME, "acme"), hits(stub, BETA, T_BETA, "beta")) == (0, PAGES)
        write(stub, ACME, T_ACME, bpp, MD["acme"])
        cleared = stub.Clear(pb.ClearRequest(), metadata=MD["ops"], timeout=5)  # admin: every tenant
        assert cleared.l1_pages == 2 * PAGES
        assert (hits(stub, ACME, T_ACME, "acme"), hits(stub, BETA, T_BETA, "beta")) == (0, 0)
        assert_whole(node, ch, "clear")


def test_router_auth_matrix(servers: tuple[NodeServer, RouterServer]) -> None:
    _, router = servers
    rows = {"Route", "Complete", "ListNodes"}
    assert rows == set(rpb.DESCRIPTOR.services_by_name["Router"].methods_by_name)
    with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        stub = rpb_grpc.RouterStub(ch)

        def route(who: str, ns: pb.NamespaceRef = ACME) -> rpb.RouteResponse:
            return stub.Route(rpb.RouteRequest(namespace=ns, tokens=T_ACME), metadata=MD[who], timeout=5)

        def complete(rid: str, who: str) -> rpb.CompleteResponse:
            return stub.Complete(rpb.CompleteRequest(route_id=rid), metadata=MD[who], timeout=5)

        def nodes(who: str) -> rpb.ListNodesResponse:
            return stub.ListNodes(rpb.ListNodesRequest(), metadata=MD[who], timeout=5)

        for who in ("none", "wrong"):
            assert code_of(route, who)[0] == C.UNAUTHENTICATED
            assert code_of(complete, "x", who)[0] == C.UNAUTHENTICATED
            assert code_of(nodes, who)[0] == C.UNAUTHENTICATED
        for ns in (ACME, pb.NamespaceRef(), pb.NamespaceRef(tenant="acme ")):
            assert code_of(route, "beta", ns)[0] == C.PERMISSION_DENIED, ns
        assert len(router.router.inflight) == 0  # refused before anything was counted
        d = route("acme")
        assert d.route_id and len(router.router.inflight) == 1
        # another token cannot complete acme's route, nor a forged or bare id: as unknown, nothing changes
        raw = d.route_id.rpartition(".")[0]
        for rid, who in ((d.route_id, "beta"), (d.route_id, "every"), (d.route_id, "ops"), (raw, "acme"),
                         (raw + ".0000000000000000", "acme"), (d.route_id + "x", "acme")):
            assert not complete(rid, who).known, (rid, who)
        assert len(router.router.inflight) == 1
        assert complete(d.route_id, "acme").known and len(router.router.inflight) == 0
        assert complete(d.route_id, "acme").repeated
        for who in ("acme", "beta"):  # router-wide figures
            assert len(nodes(who).nodes) == 2
        d = route("ops", BETA)  # admin: every tenant
        assert complete(d.route_id, "ops").known and len(router.router.inflight) == 0


def test_write_pages_for_another_tenant_is_refused_at_its_header(servers: tuple[NodeServer, RouterServer]) -> None:
    """The tenant is checked when the header arrives: data past the pages' size (or none yet) is never read for
    a token that may not write there (INVALID_ARGUMENT for the size would mean the data was read first)."""
    node, _ = servers
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pb_grpc.HiCacheStub(ch)
        head = pb.WritePagesChunk(header=pb.WritePagesHeader(namespace=ACME, tokens=T_ACME))
        too_much = pb.WritePagesChunk(data=bytes(64 << 10))

        def send(who: str) -> pb.CommitResponse:
            return stub.WritePages(iter([head, too_much]), metadata=MD[who], timeout=5)

        assert code_of(send, "beta")[0] == C.PERMISSION_DENIED
        assert code_of(send, "acme")[0] == C.INVALID_ARGUMENT  # acme's own: past the pages' size
        assert_whole(node, ch, "write pages header")
