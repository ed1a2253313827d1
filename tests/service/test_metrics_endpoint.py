"""The node's ``/metrics``: its own bind address (loopback by default, whatever ``serve.host``), an optional
bearer token (``serve.metrics_token``: 401 without it), HTTPS with the node's certificate
(``serve.metrics_tls``)."""

from __future__ import annotations

import asyncio
import http.client
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hicache.config import HiCacheConfig, config_from_dict
from hicache.service.server import NodeServer

from .service_harness import free_port
from .test_security import make_pki


def node_config(**serve: Any) -> Any:
    return config_from_dict({
        "layout": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32", "page_size": 4},
        "cache": {"l1_tokens": 256, "l2_tokens": 256},
        "serve": {"port": 0, "metrics_port": free_port(), "shared_pool": False, "shutdown_grace_s": 1.0,
                  **serve},
    })


def get(url: str, token: str = "", context: ssl.SSLContext | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def run(config: Any, check: Any) -> None:
    async def main() -> None:
        node = NodeServer(config)
        await node.start()
        try:
            await asyncio.to_thread(check, node)
        finally:
            await node.stop(0.1)

    asyncio.run(main())


def test_metrics_bind_loopback_by_default_whatever_serve_host() -> None:
    assert HiCacheConfig().serve.metrics_host == "127.0.0.1"

    def check(node: NodeServer) -> None:
        assert node._metrics_http is not None
        assert node._metrics_http._server.server_address[0] == "127.0.0.1"  # not serve.host's 0.0.0.0
        assert node.metrics_url == f"http://127.0.0.1:{node.metrics_port}/metrics"
        status, text = get(node.metrics_url)
        assert status == 200 and "hicache_rpc_inflight" in text

    run(node_config(host="0.0.0.0"), check)


def test_a_metrics_token_is_required_when_set() -> None:
    def check(node: NodeServer) -> None:
        assert get(node.metrics_url)[0] == 401
        assert get(node.metrics_url, "wrong")[0] == 401
        status, text = get(node.metrics_url, "scrape-me")
        assert status == 200 and "hicache_open_requests" in text

    # the gRPC token is another: it does not open /metrics
    run(node_config(metrics_token="scrape-me", auth_token="grpc-token"), check)


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command")
def test_metrics_are_https_under_tls(tmp_path: Path) -> None:
    make_pki(tmp_path)

    def check(node: NodeServer) -> None:
        assert node.metrics_url.startswith("https://127.0.0.1:")
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        status, text = get(node.metrics_url, "t", context=ctx)
        assert status == 200 and "hicache_rpc_inflight" in text
        assert get(node.metrics_url, context=ctx)[0] == 401
        with pytest.raises((OSError, http.client.HTTPException)):  # plaintext to the HTTPS port
            get(node.metrics_url.replace("https://", "http://"), "t")

    run(node_config(tls_cert=str(tmp_path / "server.pem"), tls_key=str(tmp_path / "server.key"),
                    metrics_tls=True, metrics_token="t"), check)


def test_metrics_settings_that_cannot_work_are_refused() -> None:
    from hicache.config import ConfigError

    with pytest.raises(ConfigError, match=r"serve\.metrics_tls"):
        node_config(metrics_tls=True)  # no certificate to serve
    with pytest.raises(ConfigError, match=r"serve\.metrics_token") as ei:
        node_config(metrics_token="has space")
    assert "has space" not in str(ei.value)
