"""Bearer token (UNAUTHENTICATED without it), TLS and mTLS."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hicache.client import HiCacheClient

from .service_harness import ServerProc

TOKEN = "s3cret-token"


def test_calls_without_the_token_are_unauthenticated(server_factory: Callable[..., ServerProc]) -> None:
    srv = server_factory(serve={"auth_token": TOKEN})
    toks = np.arange(64, dtype=np.uint32)
    with HiCacheClient(srv.target) as anon:
        for call in (lambda: anon.match(toks, "r0"), lambda: anon.match(toks, peek=True), anon.stats, anon.flush,
                     lambda: next(iter(anon.watch_events()))):
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health probes need no secret
        health = health_pb2_grpc.HealthStub(anon.channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    with HiCacheClient(srv.target, token="wrong") as bad, pytest.raises(grpc.RpcError) as ei:
        bad.stats()
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with HiCacheClient(srv.target, token=TOKEN) as ok:
        assert ok.match(toks, peek=True).num_pages == 4  # a peek opens nothing: not a lookup
        assert ok.match(toks, "r1").num_pages == 4
        ok.release("r1")
        assert ok.stats().lookups == 1  # the refused calls never reached the cache


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 / localhost and a client certificate, all signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=hicache-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command")
def test_tls_and_mtls(server_factory: Callable[..., ServerProc], tmp_path: Path) -> None:
    make_pki(tmp_path)
    p = {n: str(tmp_path / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}
    srv = server_factory(serve={"tls_cert": p["server.pem"], "tls_key": p["server.key"],
                                "tls_client_ca": p["ca.pem"]})
    with HiCacheClient(srv.target, root_certificates=p["ca.pem"], client_cert=p["client.pem"],
                       client_key=p["client.key"]) as c:
        assert c.pool_info().num_pages > 0
    # no client certificate: the handshake fails (mTLS)
    with HiCacheClient(srv.target, root_certificates=p["ca.pem"], timeout_s=3) as c, \
            pytest.raises(grpc.RpcError) as ei:
        c.pool_info()
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    # plaintext to a TLS port fails too
    with HiCacheClient(srv.target, timeout_s=3) as c, pytest.raises(grpc.RpcError):
        c.pool_info()
