"""The router's ``/metrics`` over HTTPS (``router.metrics_tls``) with the router's own certificate
(``router.tls_cert`` / ``tls_key``), behind ``router.metrics_token``; refused at config time without a
certificate to serve, as the node's ``serve.metrics_tls`` is."""

from __future__ import annotations

import asyncio
import http.client
import os
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cli_procs import free_port
from router_helpers import node_config
from service.test_metrics_endpoint import get
from service.test_security import make_pki

from hicache.cli import main as cli_main
from hicache.config import ConfigError
from hicache.router.config import NodeSpec, RouterConfig, load_router_config
from hicache.router.server import RouterServer

NEEDS_OPENSSL = pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                                   reason="needs the openssl command")


@NEEDS_OPENSSL
def test_router_metrics_are_https_with_the_router_certificate_and_token(tmp_path: Path) -> None:
    make_pki(tmp_path)
    rc = RouterConfig(port=0, metrics_port=free_port(), metrics_tls=True, metrics_token="scrape-me",
                      tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"),
                      nodes=[NodeSpec("n0", "127.0.0.1:1")], index="approximate")

    def check(router: RouterServer) -> None:
        url = router.metrics_url
        assert url == f"https://127.0.0.1:{router.metrics_port}/metrics"
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        status, text = get(url, "scrape-me", context=ctx)
        assert status == 200 and "hicache_router_inflight" in text
        assert get(url, context=ctx)[0] == 401
        assert get(url, "wrong", context=ctx)[0] == 401
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # the router's own cert
            get(url, "scrape-me", context=ssl.create_default_context())
        with pytest.raises((OSError, http.client.HTTPException)):  # plaintext to the HTTPS port
            get(url.replace("https://", "http://"), "scrape-me")

    async def main() -> None:
        router = RouterServer(node_config(), rc)
        await router.start()
        try:
            await asyncio.to_thread(check, router)
        finally:
            await router.stop(0.1)

    asyncio.run(main())


def test_router_metrics_stay_http_without_metrics_tls() -> None:
    async def main() -> None:
        rc = RouterConfig(port=0, metrics_port=free_port(), nodes=[NodeSpec("n0", "127.0.0.1:1")],
                          index="approximate")
        router = RouterServer(node_config(), rc)
        await router.start()
        try:
            assert router.metrics_url.startswith("http://127.0.0.1:")
            status, text = await asyncio.to_thread(get, router.metrics_url)
            assert status == 200 and "hicache_router_inflight" in text
        finally:
            await router.stop(0.1)

    asyncio.run(main())


def test_router_metrics_tls_without_a_certificate_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^router\.metrics_tls: must be set only with router\.tls_cert") as ei:
        RouterConfig(metrics_tls=True)
    assert ei.value.field == "router.metrics_tls"
    with pytest.raises(ConfigError, match=r"router\.metrics_tls"):
        load_router_config(None, env={"HICACHE_ROUTER__METRICS_TLS": "true", "HICACHE_ROUTER__NODES": "n0=h:1"})
    assert RouterConfig(metrics_tls=True, tls_cert="c.pem", tls_key="k.pem").metrics_tls


def test_hicache_route_refuses_metrics_tls_without_a_certificate_in_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    saved = {k: v for k, v in os.environ.items() if k.startswith("HICACHE_")}
    for k in saved:
        del os.environ[k]
    os.environ["HICACHE_ROUTER__METRICS_TLS"] = "true"
    try:
        assert cli_main(["route", "--node", "n0=127.0.0.1:1", "--port", "0"]) == 2
    finally:
        del os.environ["HICACHE_ROUTER__METRICS_TLS"]
        os.environ.update(saved)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "router.metrics_tls" in err, err
    assert "HICACHE_ROUTER__METRICS_TLS" in err, err  # blamed on the variable that set it
