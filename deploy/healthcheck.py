#!/usr/bin/env python3
"""Container health check: asks a hicache node (or router) ``grpc.health.v1.Health/Check``.

    hicache-healthcheck [--addr HOST:PORT] [--service NAME] [--timeout S]
                        [--tls-ca PEM [--tls-name NAME] [--tls-cert PEM --tls-key PEM]]

Exit status 0 when the answer is SERVING, 1 otherwise (NOT_SERVING, unreachable, timeout), so it fits
Docker's ``HEALTHCHECK`` and Kubernetes ``exec`` probes. The address defaults to ``127.0.0.1`` and the
port in ``HICACHE_SERVE__PORT`` (else 50051); the health service needs no bearer token. ``--tls-ca``
speaks TLS and verifies the server certificate against that CA (``--tls-name`` overrides the name checked);
``--tls-cert``/``--tls-key`` present a client certificate to a server that requires one (mTLS).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hicache-healthcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--addr", default=f"127.0.0.1:{os.environ.get('HICACHE_SERVE__PORT', '50051')}")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds")
    p.add_argument("--tls-ca", metavar="PEM", help="use TLS, trusting this CA")
    p.add_argument("--tls-name", help="server name to verify (default: the host in --addr)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS)")
    p.add_argument("--tls-key", metavar="PEM", help="client key (mTLS)")
    args = p.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        p.error("--tls-cert needs --tls-ca")
    return args


def check(addr: str, service: str = "", timeout: float = 3.0, tls_ca: str | None = None,
          tls_name: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> str:
    """The serving status name (``SERVING``, ``NOT_SERVING``, ...) or ``UNREACHABLE: <reason>``."""
    if tls_ca:
        pair = (Path(tls_key).read_bytes(), Path(tls_cert).read_bytes()) if tls_cert and tls_key else (None, None)
        creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes(), private_key=pair[0],
                                             certificate_chain=pair[1])
        options = [("grpc.ssl_target_name_override", tls_name)] if tls_name else []
        channel = grpc.secure_channel(addr, creds, options=options)
    else:
        channel = grpc.insecure_channel(addr)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"UNREACHABLE: {e.code().name} {e.details() or ''}".strip()
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    status = check(args.addr, args.service, args.timeout, args.tls_ca, args.tls_name, args.tls_cert, args.tls_key)
    print(f"{args.addr} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
