"""One node's feed into the router: namespace check, event stream with resync, queue-depth polls.

:class:`NodeFeed` runs two tasks per node on the router's event loop:

* the event loop: ``GetPoolInfo`` (the node's namespace digest must equal the router's, or the node is
  never routed to), then ``WatchEvents``: its first snapshot rebuilds the node's part of the index, every
  later event is applied in order. A sequence gap or any other out-of-contract message (the index
  answers RESYNC) drops the node's entries and reopens the stream, whose new snapshot rebuilds them. A
  stream that breaks drops them too (the node may have restarted with an empty cache) and reconnects
  with exponential backoff (``reconnect_max_s`` cap);
* the stats loop: ``Stats`` every ``stats_interval_s``; ``open_requests`` is the node's queue depth.
  When two polls in a row fail, the event stream is restarted (a silently dead connection would
  otherwise leave the index stale).

Transport failures of both loops (UNAVAILABLE / DEADLINE_EXCEEDED) feed the node's circuit breaker; a
snapshot received or a poll answered counts as a success.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from hicache.client import AsyncHiCacheClient, RetryPolicy
from hicache.router.config import NodeSpec, RouterConfig
from hicache.router.core import Router
from hicache.router.index import Applied

log = logging.getLogger("hicache.router")
RECONNECT_BASE_S = 0.05


def node_client(spec: NodeSpec, rc: RouterConfig) -> AsyncHiCacheClient:
    """The router's client of one node. One attempt per call: the feed has its own backoff and the node's
    circuit breaker must see every failure, not the last of several retries.

    Its channel's own wait between connection attempts is capped at ``reconnect_max_s`` too, so a node
    back after a long outage is reached as soon as the feed tries again (see ``ChannelSettings``)."""
    return AsyncHiCacheClient(spec.address, token=rc.node_token, timeout_s=max(2.0, 2 * rc.stats_interval_s),
                              retry=RetryPolicy(attempts=1), root_certificates=rc.node_tls_ca,
                              client_cert=rc.node_client_cert, client_key=rc.node_client_key,
                              reconnect_max_s=rc.reconnect_max_s)


def _describe(e: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code(), f"{e.code().name}: {e.details()}"
    return grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"


class NodeFeed:
    def __init__(self, router: Router, spec: NodeSpec) -> None:
        self.router = router
        self.spec = spec
        self.rc = router.rconfig
        self.client = node_client(spec, self.rc)
        self.reconnects = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stream: asyncio.Task[bool] | None = None
        self._kicked = False  # the stats loop cancelled the stream (not the feed closing)
        self._closing = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._events_loop(), name=f"feed-{self.spec.name}"),
                       asyncio.create_task(self._stats_loop(), name=f"stats-{self.spec.name}")]

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await self.client.close()

    async def _events_loop(self) -> None:
        name = self.spec.name
        backoff = RECONNECT_BASE_S
        while True:
            self._stream = asyncio.create_task(self._stream_once())
            try:
                synced = await self._stream
            except asyncio.CancelledError:
                if self._closing or not self._kicked:
                    raise  # the feed itself is closing
                self._kicked = False
                synced, why = False, "restarted after failed stats polls"
                self.router.disconnected(name, why)
            except Exception as e:  # any failure: forget the node's pages and reconnect
                code, why = _describe(e)
                self.router.record(name, code, why)
                self.router.disconnected(name, why)
                synced = False
                log.warning("node %s: event stream: %s", name, why, exc_info=not isinstance(e, grpc.aio.AioRpcError))
            self.reconnects += 1
            backoff = RECONNECT_BASE_S if synced else min(self.rc.reconnect_max_s, backoff * 2)
            await asyncio.sleep(backoff)

    async def _stream_once(self) -> bool:
        """Check the namespace, follow the stream until it ends or needs a resync; True if it synced."""
        name = self.spec.name
        info = await self.client.pool_info()
        self.router.set_namespace_digest(name, info.namespace_digest,
                                         f"model={info.model} revision={info.revision} "
                                         f"layout={info.layout.describe()} tp={info.tp_rank}/{info.tp_size}")
        synced = False
        async for ev in self.client.watch_events(max_queue=self.rc.event_queue):
            res = self.router.apply_event(name, ev)
            if res is Applied.RESYNC:
                return synced
            if not synced and ev.kind == "snapshot" and res is Applied.APPLIED:
                synced = True
                self.router.record(name, grpc.StatusCode.OK)
                log.info("node %s: in sync at event %d (server %s)", name, ev.sequence, ev.server_id)
        self.router.disconnected(name, "event stream ended")
        return synced

    async def _stats_loop(self) -> None:
        name = self.spec.name
        failed = 0
        while True:
            try:
                stats = await self.client.stats(timeout_s=max(1.0, self.rc.stats_interval_s))
            except Exception as e:  # a poll that fails in any way must not end the loop
                code, why = _describe(e)
                self.router.record(name, code, why)
                failed += 1
                if failed == 2 and self._stream is not None and not self._stream.done():
                    self._kicked = True
                    self._stream.cancel()
            else:
                failed = 0
                self.router.report_queue(name, stats.open_requests)
                self.router.record(name, grpc.StatusCode.OK)
            await asyncio.sleep(self.rc.stats_interval_s)
