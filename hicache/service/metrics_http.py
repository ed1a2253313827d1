"""Service metrics (RPC latency histograms, in-flight RPCs, open requests, event queues) and ``/metrics``.

They are registered into the cache's own registry, so one scrape of ``/metrics`` returns the cache's
figures (hit tokens per tier, pool use, writeback queue, ...) and the service's together.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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


class MetricsServer:
    """``GET /metrics`` on ``host:port`` from a daemon thread (prometheus_client's WSGI server)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._server: WSGIServer
        self._thread: threading.Thread
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as e:  # say which port: a node or router binds two (a port in use would not say)
            raise OSError(e.errno, e.strerror, f"metrics http://{host}:{port}") from None

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
