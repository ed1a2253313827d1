"""The node server: grpc.aio on uvloop around one :class:`hicache.cache.HiCache`.

``NodeServer(config).start()`` builds the L1 pool (shared with clients on this host when
``serve.shared_pool``), the cache, the event hub and the gRPC server with:

* ``hicache.v1.HiCache`` (:mod:`.servicer`), ``grpc.health.v1.Health`` and server reflection;
* max message sizes (``serve.max_message_bytes``), bounded concurrency (``serve.max_concurrency``);
* TLS (``serve.tls_cert``/``tls_key``), mTLS (``serve.tls_client_ca``), bearer tokens (``serve.auth_token``,
  ``serve.auth_tokens_file``: :mod:`.auth`), checked before any request is read;
* Prometheus ``/metrics`` on ``serve.metrics_host:serve.metrics_port`` (0: off; loopback by default), behind
  ``serve.metrics_token`` when set, over HTTPS with the node's certificate with ``serve.metrics_tls``.

Requests idle for ``request_ttl_s`` (:data:`~hicache.service.requests.DEFAULT_REQUEST_TTL_S` by default) are
released: a client that died cannot hold its L1 pages for longer.

``stop()`` is the graceful shutdown SIGTERM triggers: health goes NOT_SERVING, event streams end, the
server stops accepting and lets in-flight RPCs finish (up to ``serve.shutdown_grace_s``), open requests
are released, then ``cache.close()`` flushes pending L3 writebacks and every page not written is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import uuid

import grpc

from hicache.cache import HiCache
from hicache.config import HiCacheConfig
from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.proto_gen.hicache.v1 import hicache_pb2_grpc as pb_grpc
from hicache.service.auth import Authenticator, AuthInterceptor, server_credentials
from hicache.service.decode import DecodeGuard
from hicache.service.events import EventHub
from hicache.service.metrics_http import MetricsServer, ServiceMetrics
from hicache.service.preflight import process_uptime_s
from hicache.service.requests import DEFAULT_REQUEST_TTL_S
from hicache.service.servicer import HiCacheServicer
from hicache.service.shared_pool import SharedPool
from hicache.storage.base import StorageBackend
from hicache.storage.writeback import FlushReport

log = logging.getLogger("hicache.service")

# Health and reflection are dependencies of the package; a host with a bare grpcio still serves the API
# (with a warning) rather than not at all.
try:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:  # pragma: no cover - grpcio-health-checking missing
    health = health_pb2 = health_pb2_grpc = None  # type: ignore[assignment]
try:
    from grpc_reflection.v1alpha import reflection
except ImportError:  # pragma: no cover - grpcio-reflection missing
    reflection = None  # type: ignore[assignment]
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["HiCache"].full_name


STORAGE_PROBE_S = 15.0  # how often a node checks that its L3 store answers (hicache_storage_up)

class NodeServer:
    def __init__(self, config: HiCacheConfig, storage: StorageBackend | None = None,
                 request_ttl_s: float = DEFAULT_REQUEST_TTL_S, storage_probe_s: float = STORAGE_PROBE_S) -> None:
        self.config = config
        self._storage = storage
        self.request_ttl_s = request_ttl_s
        self.storage_probe_s = storage_probe_s
        self._prober: asyncio.Task[None] | None = None
        self.storage_up: bool | None = None  # L3 answered the last probe (None: no L3, or not probed yet)
        self.port = 0
        self.metrics_port = 0
        self.server_id = uuid.uuid4().hex[:16]
        self.cache: HiCache | None = None
        self.shared: SharedPool | None = None
        self._metrics_http: MetricsServer | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._stopped: FlushReport | bool | None = False

    async def start(self) -> None:
        cfg = self.config
        if cfg.serve.shared_pool:
            self.shared = SharedPool(cfg.layout.to_layout(), cfg.l1_pages, cfg.cache.device)
        try:
            self.cache = HiCache(cfg, storage=self._storage,
                                 device_pool=self.shared.pool if self.shared is not None else None)
            await self._start_serving()
        except BaseException:  # a port in use, a bad certificate: release what was built (the shared memory)
            if self._metrics_http is not None:
                self._metrics_http.close()
            if self.cache is not None:
                self.cache.close()
            if self.shared is not None:
                self.shared.close()
            raise

    async def _start_serving(self) -> None:
        cfg = self.config
        s = cfg.serve
        assert self.cache is not None
        self.hub = EventHub(asyncio.get_running_loop(), self.server_id)
        self.cache.add_listener(self.hub.on_tree_event)
        self.metrics = ServiceMetrics(self.cache.metrics.registry)
        auth = Authenticator.for_serve(s.auth_token, s.auth_tokens_file)
        self.servicer = HiCacheServicer(self.cache, s, self.metrics, self.hub, self.shared, self.request_ttl_s,
                                        auth)
        # authentication first: a call without a known token is refused before anything reads its request
        interceptors: list[grpc.aio.ServerInterceptor] = [] if auth is None else [AuthInterceptor(auth)]
        interceptors.append(DecodeGuard())
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        pb_grpc.add_HiCacheServicer_to_server(self.servicer, self.server)
        self.health = None
        names = [SERVICE_NAME]
        if health is not None:
            self.health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
            names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        else:  # pragma: no cover
            log.warning("grpcio-health-checking is not installed: no grpc.health.v1 service")
        if reflection is not None:
            reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self.server)
        else:  # pragma: no cover
            log.warning("grpcio-reflection is not installed: no server reflection")
        addr = f"{s.host}:{s.port}"
        if s.tls_cert:
            self.port = self.server.add_secure_port(addr, server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca))
        else:
            self.port = self.server.add_insecure_port(addr)
        if self.port == 0:
            raise OSError(f"serve: cannot bind {addr}")
        if s.metrics_port:
            self._metrics_http = MetricsServer(self.cache.metrics.registry, s.metrics_host, s.metrics_port,
                                               token=s.metrics_token, certfile=s.tls_cert if s.metrics_tls else "",
                                               keyfile=s.tls_key if s.metrics_tls else "")
            self.metrics_port = self._metrics_http.port
        # Everything built so far lives as long as the server: move it out of the collector's view so
        # full collections stay short (tail latency), and collect young objects less often.
        gc.collect()
        gc.freeze()
        await self.server.start()
        for name in ("", SERVICE_NAME):
            if self.health is not None:
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._reaper = asyncio.create_task(self._expire_loop())
        if self.cache.storage is not None:  # serve anyway: L3 is paused until the store answers again
            await self._probe_store(first=True)
            self._prober = asyncio.create_task(self._probe_loop())
        log.info("hicache serve: %s on %s:%d (pool %s, %d L1 pages, layout %s)", self.server_id, s.host, self.port,
                 self.shared.kind if self.shared else "private", cfg.l1_pages, cfg.layout.to_layout().describe())

    @property
    def metrics_url(self) -> str:
        """Where ``/metrics`` is served ("": nowhere)."""
        return self._metrics_http.url if self._metrics_http is not None else ""

    async def _probe_store(self, first: bool = False) -> None:
        """One round trip to L3 (on a worker thread): sets ``hicache_storage_up`` and logs each change."""
        assert self.cache is not None and self.cache.storage is not None
        store = self.cache.storage
        why = await asyncio.get_running_loop().run_in_executor(None, store.probe)
        was, self.storage_up = self.storage_up, why is None
        self.cache.metrics.storage_up.set(1 if self.storage_up else 0)
        if why and (first or was):
            log.warning("L3 %s does not answer (%s); serving from L1/L2, L3 resumes when it does",
                        store.url_safe, why)
        elif not why and not first and not was:
            log.info("L3 %s answers again", store.url_safe)

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.storage_probe_s)
            try:
                await self._probe_store()
            except Exception:  # a bug in a backend's probe must not end the loop
                log.exception("L3 probe failed")

    async def _expire_loop(self) -> None:
        period = max(0.5, min(60.0, self.request_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            n = await self.servicer.expire_idle()
            if n:
                log.warning("released %d requests idle for more than %.0f s", n, self.request_ttl_s)

    async def stop(self, grace_s: float | None = None) -> FlushReport | None:
        """Graceful shutdown; returns the L3 flush report (None without L3). Idempotent."""
        if self._stopped is not False:
            return self._stopped if isinstance(self._stopped, FlushReport) else None
        assert self.cache is not None
        grace = self.config.serve.shutdown_grace_s if grace_s is None else grace_s
        log.info("shutting down: finishing in-flight RPCs (grace %.1f s)", grace)
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        self.hub.close()
        for task in (self._reaper, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.server.stop(grace)
        self.cache.remove_listener(self.hub.on_tree_event)
        released = await self.servicer.release_all()
        if released:
            log.info("released %d requests still open", released)
        report = await asyncio.to_thread(self.cache.close)
        self._log_flush(report)
        if self._metrics_http is not None:
            self._metrics_http.close()
        if self.shared is not None:
            self.shared.close()
        self._stopped = report if report is not None else True
        return report

    @staticmethod
    def _log_flush(report: FlushReport | None) -> None:
        if report is None:
            log.info("no L3 store: nothing to flush")
            return
        lost = report.failed_pages + report.dropped_pages + report.pending_pages
        log.info("L3 flush: %d pages written", report.written_pages)
        if lost:
            log.error("L3 flush: %d pages NOT written (store refused %d, dropped on a full queue %d, still queued "
                      "at the deadline %d)", lost, report.failed_pages, report.dropped_pages, report.pending_pages)


async def serve_until_signal(config: HiCacheConfig, ready: asyncio.Event | None = None, announce: bool = True,
                             request_ttl_s: float = DEFAULT_REQUEST_TTL_S) -> FlushReport | None:
    """Run until SIGTERM / SIGINT, then shut down gracefully. Prints one ``listening on`` line when up."""
    node = NodeServer(config, request_ttl_s=request_ttl_s)
    await node.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        extra = f" metrics {node.metrics_url}" if node.metrics_url else ""
        print(f"hicache serve: listening on {config.serve.host}:{node.port}{extra} after {process_uptime_s():.1f} s",
              flush=True)
    if ready is not None:
        ready.set()
    await stop.wait()
    return await node.stop()


def run(config: HiCacheConfig, request_ttl_s: float = DEFAULT_REQUEST_TTL_S) -> int:
    """Blocking entry point: :func:`serve_until_signal` on uvloop (asyncio's loop without it)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        log.warning("uvloop is not installed: serving on the default asyncio loop")
        asyncio.run(serve_until_signal(config, request_ttl_s=request_ttl_s))
    else:
        uvloop.run(serve_until_signal(config, request_ttl_s=request_ttl_s))
    return 0
