"""TLS and mTLS from outside, with certificates made here (the ``cryptography`` package): a node and a router
that require a client certificate of their CA, called by a plaintext client, a client trusting another CA,
one with no client certificate, one whose certificate another CA signed, one whose certificate expired, and
one with the right certificate; and a node serving an expired certificate. Only the right certificate gets
an answer (and still needs the bearer token); every other handshake fails (UNAVAILABLE) and leaves the node
as it was. Bad certificate files made here (a garbage key, the key of another certificate, a key given as the
certificate, a client CA that is a key) stop ``hicache serve`` and ``hicache route`` in one line naming the
field and the file, before anything binds (every kind of bad file, for serve: tests/test_tls_errors.py)."""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from hicache.cli import main
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.proto_gen.hicache.v1 import router_pb2 as rpb
from hicache.proto_gen.hicache.v1 import router_pb2_grpc as rpb_grpc
from hicache.router.server import RouterServer
from hicache.service.server import NodeServer

from .probekit import Background, C, assert_whole, bearer, start_node, start_router

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

NOW = dt.datetime.now(dt.UTC)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
          ca: bool = False, expired: bool = False) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
    start, end = (NOW - dt.timedelta(days=10), NOW - dt.timedelta(days=1)) if expired else \
        (NOW - dt.timedelta(hours=1), NOW + dt.timedelta(days=2))
    b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ca/other-ca, and by ca: server, client, expired-client, expired-server; by other-ca: stranger."""
    d = tmp_path_factory.mktemp("probe-pki")
    out: dict[str, Path] = {}
    cas = {}
    for ca in ("ca", "other-ca"):
        k = _key()
        c = _cert(ca, k, None, ca=True)
        cas[ca] = (c.subject, k)
        (d / f"{ca}.pem").write_bytes(_pem(c))
        out[ca] = d / f"{ca}.pem"
    for name, by, expired in (("server", "ca", False), ("client", "ca", False), ("expired-client", "ca", True),
                              ("expired-server", "ca", True), ("stranger", "other-ca", False)):
        k = _key()
        (d / f"{name}.pem").write_bytes(_pem(_cert(name, k, cas[by], expired=expired)))
        (d / f"{name}.key").write_bytes(_key_pem(k))
        out[name], out[f"{name}.key"] = d / f"{name}.pem", d / f"{name}.key"
    return out


@pytest.fixture(scope="module")
def servers(pki: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[NodeServer, RouterServer, NodeServer]]:
    bg = Background()
    tmp = tmp_path_factory.mktemp("probe-tls")
    mtls = {"tls_cert": str(pki["server"]), "tls_key": str(pki["server.key"]), "tls_client_ca": str(pki["ca"])}
    node = start_node(bg, tmp, serve=mtls)
    router = start_router(bg, tmp, **mtls)
    stale = start_node(bg, tmp, serve={"tls_cert": str(pki["expired-server"]),
                                       "tls_key": str(pki["expired-server.key"])})
    try:
        yield node, router, stale
    finally:
        for s in (stale, router, node):
            bg.run(s.stop(0.1))
        bg.close()


def channel(target: str, pki: dict[str, Path], trust: str | None = "ca", client: str | None = "client") -> grpc.Channel:
    if trust is None:
        return grpc.insecure_channel(target)
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki[trust].read_bytes(),
        private_key=pki[f"{client}.key"].read_bytes() if client else None,
        certificate_chain=pki[client].read_bytes() if client else None)
    return grpc.secure_channel(target, creds)


# case -> (trusted CA, client certificate); None: plaintext / no certificate
CASES = {
    "plaintext": (None, None),
    "wrong-ca": ("other-ca", "client"),
    "no-client-cert": ("ca", None),
    "client-cert-of-another-ca": ("ca", "stranger"),
    "expired-client-cert": ("ca", "expired-client"),
}


def node_call(ch: grpc.Channel, token: str = "ops") -> C:
    try:
        pb_grpc.HiCacheStub(ch).Stats(pb.StatsRequest(), metadata=bearer(token), timeout=3)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined, no-any-return]
    return C.OK


def router_call(ch: grpc.Channel, token: str = "ops") -> C:
    try:
        rpb_grpc.RouterStub(ch).ListNodes(rpb.ListNodesRequest(), metadata=bearer(token), timeout=3)
    except grpc.RpcError as e:
        return e.code()  # type: ignore[attr-defined, no-any-return]
    return C.OK


def test_node_tls_matrix(servers: tuple[NodeServer, RouterServer, NodeServer], pki: dict[str, Path]) -> None:
    node, _, _ = servers
    target = f"127.0.0.1:{node.port}"
    with channel(target, pki) as good:
        assert node_call(good) == C.OK
        assert node_call(good, "tok-nobody") == C.UNAUTHENTICATED  # the certificate does not replace the token
        for case, (trust, client) in CASES.items():
            with channel(target, pki, trust, client) as ch:
                assert node_call(ch) == C.UNAVAILABLE, case
            assert_whole(node, good, case)


def test_router_tls_matrix(servers: tuple[NodeServer, RouterServer, NodeServer], pki: dict[str, Path]) -> None:
    _, router, _ = servers
    target = f"127.0.0.1:{router.port}"
    with channel(target, pki) as good:
        assert router_call(good) == C.OK
        assert router_call(good, "tok-nobody") == C.UNAUTHENTICATED
    for case, (trust, client) in CASES.items():
        with channel(target, pki, trust, client) as ch:
            assert router_call(ch) == C.UNAVAILABLE, case
    assert len(router.router.inflight) == 0


def test_an_expired_server_certificate_is_refused_by_the_client(
        servers: tuple[NodeServer, RouterServer, NodeServer], pki: dict[str, Path]) -> None:
    node, _, stale = servers
    with channel(f"127.0.0.1:{stale.port}", pki, "ca", None) as ch:
        assert node_call(ch) == C.UNAVAILABLE
    with channel(f"127.0.0.1:{node.port}", pki) as good:
        assert_whole(node, good, "expired server")


# case -> (cert, key, client CA) of the pki fixture, and the field named
BAD_FILES = {
    "garbage-key": (("server", "garbage.key", ""), "tls_key"),
    "key-of-another-cert": (("server", "stranger.key", ""), "tls_key"),
    "key-as-cert": (("server.key", "server.key", ""), "tls_cert"),
    "ca-is-a-key": (("server", "server.key", "client.key"), "tls_client_ca"),
}


@pytest.mark.parametrize("command", ["serve", "route"])
def test_bad_certificate_files_stop_the_server_in_one_line(command: str, pki: dict[str, Path],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    garbage = pki["ca"].parent / "garbage.key"
    garbage.write_text("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    files = {**pki, "garbage.key": garbage}
    section = "serve" if command == "serve" else "router"
    for case, ((cert, key, ca), field) in BAD_FILES.items():
        conf = garbage.parent / f"{command}-{case}.yaml"
        conf.write_text(yaml.safe_dump({section: {"port": 0, "metrics_port": 0, "tls_cert": str(files[cert]),
                                                  "tls_key": str(files[key]),
                                                  "tls_client_ca": str(files[ca]) if ca else ""}}))
        args = ["--config", str(conf)] + (["--node", "n0=127.0.0.1:1"] if command == "route" else [])
        assert main([command, *args]) == 2, case
        err = capsys.readouterr().err.strip()
        named = {"tls_cert": cert, "tls_key": key, "tls_client_ca": ca}[field]
        assert err.startswith(f"hicache {command}: ") and f"{section}.{field}: {files[named]}: " in err, (case, err)
        assert "\n" not in err and "bind" not in err, (case, err)
