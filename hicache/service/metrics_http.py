"""Service metrics (RPC latency histograms, in-flight RPCs, open requests, event queues) and ``/metrics``.

They are registered into the cache's own registry, so one scrape of ``/metrics`` returns the cache's
figures (hit tokens per tier, pool use, writeback queue, ...) and the service's together.

:class:`MetricsServer` serves them over HTTP from daemon threads, on its own address (a node's
``serve.metrics_host``, loopback by default: the page tells anyone who reads it what the node serves),
optionally behind a bearer token (``Authorization: Bearer <token>``, what Prometheus' ``authorization``
scrape setting sends; 401 without it) and over HTTPS (a certificate and key).
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import sys
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

RPC_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)


class ServiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.rpc_seconds = Histogram("hicache_rpc_seconds", "RPC handling time, by method (each MatchStream "
                                     "message under Match; MatchStream: a whole stream)", ["method"],
                                     registry=r, buckets=RPC_BUCKETS)
        self.rpc_total = Counter("hicache_rpcs", "RPCs finished, by method and status code (those refused at "
                                 "serve.max_concurrency are in hicache_rpc_rejected_total)", ["method", "code"],
                                 registry=r)
        self.rpc_inflight = Gauge("hicache_rpc_inflight", "RPCs being handled (queue depth)", registry=r)
        self.rpc_rejected = Counter("hicache_rpc_rejected", "RPCs refused with RESOURCE_EXHAUSTED (concurrency)",
                                    registry=r)
        self.open_requests = Gauge("hicache_open_requests", "Requests matched and not yet released", registry=r)
        self.expired_requests = Counter("hicache_expired_requests", "Requests released after idling past the TTL",
                                        registry=r)
        self.event_subscribers = Gauge("hicache_event_subscribers", "WatchEvents streams", registry=r)
        self.event_queue = Gauge("hicache_event_queue_depth", "Events queued for subscribers, all together",
                                 registry=r)
        self.event_sequence = Gauge("hicache_event_sequence", "Sequence number of the last event", registry=r)


WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]
HANDLER_TIMEOUT_S = 30.0  # a scrape connection idle this long (a stalled TLS handshake, say) is closed


class _Handler(WSGIRequestHandler):
    timeout = HANDLER_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged (one line per scrape otherwise)."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that is not one (plaintext to HTTPS, a dropped or stalled connection) is not reported."""
        if not isinstance(sys.exc_info()[1], ssl.SSLError | ConnectionError | TimeoutError):
            super().handle_error(request, client_address)


def _bearer(app: WsgiApp, token: str) -> WsgiApp:
    """``app`` behind ``Authorization: Bearer <token>`` (401 otherwise)."""
    want = hashlib.sha256(f"Bearer {token}".encode()).digest()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        got = hashlib.sha256(environ.get("HTTP_AUTHORIZATION", "").encode("latin-1")).digest()
        if hmac.compare_digest(got, want):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                            ("WWW-Authenticate", 'Bearer realm="hicache metrics"')])
        return [b"missing or wrong bearer token (header 'Authorization: Bearer <token>')\n"]

    return guarded


class MetricsServer:
    """``GET /metrics`` on ``host:port`` from daemon threads; with ``token``, only for requests carrying
    ``Authorization: Bearer <token>``; with ``certfile``/``keyfile``, over HTTPS."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, token: str = "",
                 certfile: str = "", keyfile: str = "") -> None:
        app: WsgiApp = make_wsgi_app(registry)
        if token:
            app = _bearer(app, token)
        scheme = "https" if certfile else "http"
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            server_class = type("MetricsWSGIServer", (_Server,), {"address_family": family})
            self._server: WSGIServer = make_server(host, port, app, server_class, handler_class=_Handler)
        except OSError as e:  # say which port: a node or router binds two (a port in use would not say)
            raise OSError(e.errno, e.strerror, f"metrics {scheme}://{host}:{port}") from None
        if certfile:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                ctx.load_cert_chain(certfile, keyfile or None)
            except (OSError, ssl.SSLError):
                self._server.server_close()
                raise
            # the handshake runs in the connection's own thread (on its first read), not in accept()
            tls = ctx.wrap_socket(self._server.socket, server_side=True, do_handshake_on_connect=False)
            setattr(self._server, "socket", tls)  # noqa: B010 - typeshed types the attribute as a plain socket
        self.scheme = scheme
        self.url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, name="hicache-metrics", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
