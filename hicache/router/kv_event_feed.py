"""One serving engine's KV events into the router: a ZeroMQ subscriber with gap replay.

:class:`EngineFeed` runs one task per engine on the router's event loop. It subscribes to the engine's
KV-event publisher (``router.kv_events``: vLLM's ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'``, SGLang's ``--kv-events-config``) and applies every
batch in sequence order through :class:`~hicache.router.kv_events.EngineBlocks`.

Sequence numbers are the publisher's, from 0, one per batch:

* the first batch received, or a gap after it: with a replay endpoint (``router.kv_events_replay``, the
  publisher's ``replay_endpoint``), the missing batches are asked for (from 0 on the first batch: the
  engine's cache as far back as its buffer goes) and applied in order before the batch that revealed the
  gap; what the publisher no longer buffers stays missing. A gap left unfilled is counted (``lost``) and
  what the router knows of the engine is *kept*: unlike a hicache node, an engine sends no snapshot, so
  forgetting would leave the router blind to the engine's cache until every block came round again,
  while a block kept in error costs one recompute at most;
* a sequence that goes back (the engine restarted, with an empty cache) forgets the engine's blocks first.

The subscription reconnects by itself (ZeroMQ does). A socket monitor tells the link's state: the node
counts as connected while the publisher's connection is up (an idle engine publishes nothing and is still
connected); when it drops, the engine's blocks are forgotten (a restarted engine may come back with a
higher sequence than its old run reached, and it will never remove the old run's blocks), and the first
batch after the reconnect catches up through the replay. A replay endpoint that does not answer is left
alone for a while (``REPLAY_BACKOFF_S``, doubling), so a down endpoint does not stall the feed on every gap.

The engine's load: its Prometheus metrics page (``http://ADDRESS/metrics``, ``router.engine_metrics_path``)
is read every ``stats_interval_s``; its running and waiting requests are the node's queue depth, as a hicache
node's Stats ``open_requests`` is, so ``cache_aware`` weighs cached prefix against load for engines too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import urllib.error
import urllib.request
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from hicache.router.config import NodeSpec
from hicache.router.core import Router
from hicache.router.kv_events import EngineBlocks, EngineEventError, decode_batch

log = logging.getLogger("hicache.router")
REPLAY_TIMEOUT_S = 1.0  # the longest wait for the next replayed batch
REPLAY_BACKOFF_S = 5.0  # after a replay endpoint did not answer, no replay is asked for this long (doubling)
REPLAY_BACKOFF_MAX_S = 60.0
RECEIVE_QUEUE = 100_000  # batches the subscription may queue while a replay is under way (ZeroMQ's RCVHWM)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


# gauges of the engines' open requests: vLLM's, SGLang's (running and queued)
QUEUE_GAUGES = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting", "sglang:num_running_reqs",
                          "sglang:num_queue_reqs"})


def engine_queue_depth(url: str, timeout_s: float) -> int | None:
    """The engine's open requests: the sum of the ``QUEUE_GAUGES`` its metrics page shows (None: it shows
    none of them). Blocking; ``urllib.error.HTTPError`` for an HTTP error, ``OSError`` / ``ValueError`` when
    the page cannot be fetched or read."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        text = resp.read(1 << 24).decode("utf-8", "replace")
    total, seen = 0.0, False
    try:
        for family in text_string_to_metric_families(text):
            if family.name in QUEUE_GAUGES:
                for sample in family.samples:
                    total += sample.value
                    seen = True
    except Exception as e:  # the parser raises several types for text it cannot read
        raise ValueError(f"unreadable metrics page: {type(e).__name__}: {e}") from None
    return int(total) if seen and math.isfinite(total) else None


def _zmq() -> Any:
    import zmq  # imported here: a router that follows no engine never loads it
    import zmq.asyncio

    return zmq


class EngineFeed:
    def __init__(self, router: Router, spec: NodeSpec, endpoint: str, replay: str = "", topic: str = "") -> None:
        self.router = router
        self.spec = spec
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay, topic
        self.blocks: EngineBlocks = router.engines[spec.name]
        self.last_seq: int | None = None
        self._zmq = _zmq()
        self._ctx = self._zmq.asyncio.Context()
        self._tasks: list[asyncio.Task[None]] = []
        self._replay_after = 0.0  # loop time before which no replay is tried (the endpoint timed out)
        self._replay_backoff = REPLAY_BACKOFF_S

    @property
    def metrics_url(self) -> str:
        """Where the engine's Prometheus metrics are read ("" : not read, ``router.engine_metrics_path``)."""
        path = self.router.rconfig.engine_metrics_path
        return f"http://{self.spec.address}{path}" if path else ""

    def start(self) -> None:
        sub = self._socket(self._zmq.SUB)
        sub.setsockopt(self._zmq.RCVHWM, RECEIVE_QUEUE)
        sub.setsockopt(self._zmq.SUBSCRIBE, self.topic.encode())
        monitor = sub.get_monitor_socket(self._zmq.EVENT_HANDSHAKE_SUCCEEDED | self._zmq.EVENT_DISCONNECTED)
        sub.connect(self.endpoint)
        log.info("engine %s: following KV events at %s", self.spec.name, self.endpoint)
        self._tasks = [asyncio.create_task(self._receive(sub), name=f"engine-{self.spec.name}"),
                       asyncio.create_task(self._watch(monitor), name=f"engine-link-{self.spec.name}")]
        if self.metrics_url:
            self._tasks.append(asyncio.create_task(self._load_loop(), name=f"engine-load-{self.spec.name}"))

    async def _load_loop(self) -> None:
        """The engine's open requests (running + waiting, from its Prometheus metrics) as the node's queue
        depth, every ``stats_interval_s``. A poll that cannot reach the engine is a transport failure for
        its breaker, as a hicache node's failed Stats poll is; an HTTP error (no such page, say) stops the
        polls, the engine still routed to on the router's own in-flight count."""
        name, url = self.spec.name, self.metrics_url
        interval = self.router.rconfig.stats_interval_s
        unreadable = False
        while True:
            try:
                depth = await asyncio.to_thread(engine_queue_depth, url, max(1.0, interval))
            except urllib.error.HTTPError as e:
                log.warning("engine %s: %s answered HTTP %d: its load is not read (router.engine_metrics_path)",
                            name, url, e.code)
                return
            except OSError as e:  # refused, timed out, reset: the engine may be down
                self.router.record(name, grpc.StatusCode.UNAVAILABLE, f"metrics {url}: {e}")
            except ValueError as e:  # the engine answered: not a failure of the engine, its load unknown
                if not unreadable:
                    log.warning("engine %s: %s: %s", name, url, e)
                unreadable = True
            else:
                if depth is not None:
                    self.router.report_queue(name, depth)
                self.router.record(name, grpc.StatusCode.OK)
            await asyncio.sleep(interval)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await t
                except Exception:  # a feed that failed must not keep the router from stopping
                    log.exception("engine %s: feed task failed", self.spec.name)
        self._ctx.destroy(linger=0)

    def _socket(self, kind: int) -> Any:
        sock = self._ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.IPV6, 1)  # tcp://[::1]:PORT and host names with IPv6 addresses
        return sock

    async def _receive(self, sub: Any) -> None:
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self.on_message(frames)
                except Exception:  # one bad message must not end the feed
                    log.exception("engine %s: KV event message dropped", self.spec.name)
        finally:
            sub.close(linger=0)

    async def _watch(self, monitor: Any) -> None:
        """The link to the publisher: connected once a handshake succeeds; a disconnect ends the engine's
        run as far as the router can tell (a restarted engine may come back with a higher sequence than the
        old run reached), so its blocks are forgotten and the next batch catches up through the replay."""
        from zmq.utils.monitor import parse_monitor_message

        zmq = self._zmq
        st = self.router.nodes[self.spec.name]
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    st.connected = True
                elif event == zmq.EVENT_DISCONNECTED:
                    st.connected = False
                    if self.last_seq is not None or self.blocks.blocks:
                        log.warning("engine %s: disconnected from %s: its blocks are forgotten until it is back",
                                    self.spec.name, self.endpoint)
                        self.blocks.restarts += 1
                        self.blocks.clear()
                    self.last_seq = None
        finally:
            monitor.close(linger=0)

    async def on_message(self, frames: list[bytes]) -> None:
        """One published message ``[topic, sequence, payload]``."""
        name = self.spec.name
        if len(frames) < 2 or len(frames[-2]) != 8:
            self.blocks.refused["malformed"] += 1
            return
        seq = int.from_bytes(frames[-2], "big")
        last = self.last_seq
        if last is not None and seq <= last:
            log.warning("engine %s: event sequence went back (%d after %d): engine restarted, its blocks "
                        "forgotten", name, seq, last)
            self.blocks.restarts += 1
            self.blocks.clear()
            last = None
        first = 0 if last is None else last + 1
        if seq > first and (last is not None or self.replay_endpoint):
            got = await self.replay(first, seq - 1)
            for s, payload in got:
                self._apply(s, payload)
            if last is not None:
                filled = len(got) == seq - first  # a run ending at seq - 1: every missing batch came
                self.blocks.gaps["replayed" if filled else "lost"] += 1
                if not filled:
                    log.warning("engine %s: KV events %d..%d lost (replay gave %d)", name, first, seq - 1, len(got))
        self._apply(seq, frames[-1])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EngineEventError as e:  # its removals are lost as surely as a batch never received
            self.blocks.refused["malformed"] += 1
            self.blocks.gaps["lost"] += 1
            log.warning("engine %s: event batch %d unreadable: %s", self.spec.name, seq, e)
        else:
            self.blocks.apply(batch)
        self.last_seq = seq
        self.router.index.feed(self.spec.name).sequence = seq

    async def replay(self, first: int, last: int) -> list[tuple[int, bytes]]:
        """The batches of ``first..last`` the publisher still buffers: a run without a hole, from the
        oldest it holds (later than ``first`` once its buffer has moved on). It sends everything from
        ``first`` on, then an end marker; a batch missing from the run ends it. Nothing when no replay
        endpoint is set, or while one that timed out is left alone (backing off up to a minute)."""
        loop = asyncio.get_running_loop()
        if not self.replay_endpoint or loop.time() < self._replay_after:
            return []
        sock = self._socket(self._zmq.DEALER)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            want = first
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    if not out:  # no answer at all: leave the endpoint alone for a while
                        self._replay_after = loop.time() + self._replay_backoff
                        self._replay_backoff = min(REPLAY_BACKOFF_MAX_S, 2 * self._replay_backoff)
                        log.warning("engine %s: no replay from %s within %.1f s", self.spec.name,
                                    self.replay_endpoint, REPLAY_TIMEOUT_S)
                    break
                frames = await sock.recv_multipart()
                self._replay_backoff = REPLAY_BACKOFF_S
                if len(frames) < 3 or frames[-2] == END_OF_REPLAY or not frames[-1]:
                    break
                s = int.from_bytes(frames[-2], "big")
                if s < want:
                    continue
                if s > last or (out and s != want):
                    break
                out.append((s, frames[-1]))
                want = s + 1
        finally:
            sock.close(linger=0)
        return out
