"""The router's tenant boundary: ``router.auth_tokens_file`` maps each token to the tenants it may route for.

A Route naming another tenant ends with PERMISSION_DENIED and counts nothing; route ids are per token
(another token's Complete of an id is as of an unknown one), and so are request ids; ``router.auth_token``
beside the file is an admin token. ``router.auth_token`` alone stays one token for every tenant. The
router's ``/metrics`` binds loopback unless told otherwise and wants ``router.metrics_token`` when set; a bad
tokens file stops ``hicache route`` with one line.
"""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from probe.probekit import Background, bearer, start_router

from hicache.cli import main
from hicache.config import ConfigError
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.server import RouterServer

C = grpc.StatusCode
TOKS = (np.arange(32, dtype=np.uint32) + 5).tobytes()


@pytest.fixture
def bg() -> Iterator[Background]:
    b = Background()
    yield b
    b.close()


def route(stub: rpb_grpc.RouterStub, who: str, tenant: str = "acme", request_id: str = "") -> rpb.RouteResponse:
    return stub.Route(rpb.RouteRequest(namespace=pb.NamespaceRef(tenant=tenant), tokens=TOKS,
                                       request_id=request_id), metadata=bearer(who), timeout=5)


def complete(stub: rpb_grpc.RouterStub, who: str, rid: str) -> rpb.CompleteResponse:
    return stub.Complete(rpb.CompleteRequest(route_id=rid), metadata=bearer(who), timeout=5)


def code(fn: Callable[..., Any], *args: Any) -> C:
    try:
        fn(*args)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined, no-any-return]
    return C.OK


def test_a_token_routes_and_completes_for_its_tenants_alone(bg: Background, tmp_path: Path) -> None:
    router = start_router(bg, tmp_path)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stub = rpb_grpc.RouterStub(ch)
            for tenant in ("beta", "", "Acme", "acme\x00"):  # the router's model.tenant is "": not acme's
                assert code(route, stub, "acme", tenant) == C.PERMISSION_DENIED, tenant
            assert len(router.router.inflight) == 0
            d = route(stub, "acme")
            assert d.route_id and len(router.router.inflight) == 1
            for other in ("beta", "every", "ops"):  # a tagged id is the token's own
                assert not complete(stub, other, d.route_id).known, other
            assert complete(stub, "acme", d.route_id).known and len(router.router.inflight) == 0
            for who in ("every", "ops"):  # every tenant (an every-tenant token, the admin one)
                d = route(stub, who, "beta")
                assert complete(stub, who, d.route_id).known
    finally:
        bg.run(router.stop(0.1))


def test_request_ids_are_per_token(bg: Background, tmp_path: Path) -> None:
    router = start_router(bg, tmp_path)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stub = rpb_grpc.RouterStub(ch)
            a = route(stub, "acme", request_id="req-1")
            again = route(stub, "acme", request_id="req-1")  # the same token's retry: the same route
            assert again.replayed and again.route_id == a.route_id
            other = route(stub, "every", request_id="req-1")  # another token's id of the same name: its own
            assert not other.replayed and other.route_id != a.route_id and len(router.router.inflight) == 2
            assert not complete(stub, "every", a.route_id).known
            assert complete(stub, "acme", a.route_id).known and complete(stub, "every", other.route_id).known
            # the client's id is what the length limit counts, not the router's name for it
            assert code(route, stub, "acme", "acme", "x" * 128) == C.OK
            assert code(route, stub, "acme", "acme", "x" * 129) == C.INVALID_ARGUMENT
            route(stub, "acme", request_id="y")
            with pytest.raises(grpc.RpcError) as ei:  # the same id for another request: named as the client did
                stub.Route(rpb.RouteRequest(namespace=pb.NamespaceRef(tenant="acme"), tokens=TOKS[:-4],
                                            request_id="y"), metadata=bearer("acme"), timeout=5)
            assert ei.value.code() == C.ALREADY_EXISTS and "'y'" in ei.value.details()  # type: ignore[attr-defined]
    finally:
        bg.run(router.stop(0.1))


def test_the_single_token_mode_routes_every_tenant_with_plain_ids(bg: Background, tmp_path: Path) -> None:
    router = start_router(bg, tmp_path, auth_tokens_file="", auth_token="tok-one")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stub = rpb_grpc.RouterStub(ch)
            for tenant in ("acme", "beta", ""):
                d = route(stub, "tok-one", tenant)
                assert "." not in d.route_id  # the router's id as it is: no token to tag it for
                assert complete(stub, "tok-one", d.route_id).known
            assert code(route, stub, "tok-acme") == C.UNAUTHENTICATED
    finally:
        bg.run(router.stop(0.1))


def test_a_token_both_in_the_file_and_auth_token_is_refused(tmp_path: Path) -> None:
    from hicache.service.auth import Authenticator

    f = tmp_path / "t.yaml"
    f.write_text("tokens:\n  - {name: a, token: tok-a, tenants: [a]}\n")
    with pytest.raises(ConfigError, match=r"router\.auth_tokens_file: a token of the file is router\.auth_token"):
        Authenticator.for_serve("tok-a", str(f), "router")


def test_a_bad_tokens_file_stops_hicache_route_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("tokens:\n  - {name: a, token: 'secret value'}\n")
    for path in (str(f), str(tmp_path / "missing.yaml")):
        assert main(["route", "--node", "n0=127.0.0.1:1", "--auth-tokens-file", path]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("hicache route: ") and "router.auth_tokens_file" in err and "\n" not in err, err
        assert "secret" not in err


def test_router_metrics_bind_loopback_and_want_their_token(bg: Background, tmp_path: Path) -> None:
    router: RouterServer = start_router(bg, tmp_path, host="0.0.0.0")
    try:
        assert router.metrics_url == ""  # off unless metrics_port is set
    finally:
        bg.run(router.stop(0.1))
    router = start_router(bg, tmp_path, host="0.0.0.0", metrics_port=free_port(), metrics_token="scrape-tok")
    try:
        url = router.metrics_url
        assert url.startswith("http://127.0.0.1:"), url  # not router.host
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(url, timeout=5)
        assert ei.value.code == 401
        req = urllib.request.Request(url, headers={"Authorization": "Bearer scrape-tok"})
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200 and b"hicache_router" in r.read()
    finally:
        bg.run(router.stop(0.1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
