"""One serving engine's KV events into the router: a ZeroMQ subscriber with gap replay.

:class:`EngineFeed` runs one task per engine on the router's event loop. It subscribes to the engine's
KV-event publisher (``router.kv_events``: vLLM's ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557"}'``, SGLang's ``--kv-events-config``) and applies every
batch in sequence order through :class:`~hicache.router.engine_events.EngineBlocks`.

Sequence numbers are the publisher's, from 0, one per batch:

* the first batch received, or a gap after it: with a replay endpoint (``router.kv_events_replay``, the
  publisher's ``replay_endpoint``), the missing batches are asked for (from 0 on the first batch: the
  engine's cache as far back as its buffer goes) and applied in order before the batch that revealed the
  gap; what the publisher no longer buffers stays missing. A gap left unfilled is counted (``lost``) and
  what the router knows of the engine is *kept*: unlike a hicache node, an engine sends no snapshot, so
  forgetting would leave the router blind to the engine's cache until every block came round again,
  while a block kept in error costs one recompute at most;
* a sequence that goes back (the engine restarted, with an empty cache) forgets the engine's blocks first.

The subscription reconnects by itself (ZeroMQ does); the node counts as connected once a batch arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from hicache.router.config import NodeSpec
from hicache.router.core import Router
from hicache.router.engine_events import EngineBlocks, EngineEventError, decode_batch

log = logging.getLogger("hicache.router")
REPLAY_TIMEOUT_S = 1.0  # the longest wait for the next replayed batch
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


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
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"engine-{self.spec.name}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._ctx.destroy(linger=0)

    async def _run(self) -> None:
        zmq = self._zmq
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        sub.connect(self.endpoint)
        log.info("engine %s: following KV events at %s", self.spec.name, self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                try:
                    await self.on_message(frames)
                except Exception:  # one bad message must not end the feed
                    log.exception("engine %s: KV event message dropped", self.spec.name)
        finally:
            sub.close(linger=0)

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
            got = await self.replay(first, seq - 1) if self.replay_endpoint else []
            for s, payload in got:
                self._apply(s, payload)
            if last is not None:
                filled = len(got) == seq - first  # a run ending at seq - 1: every missing batch came
                self.blocks.gaps["replayed" if filled else "lost"] += 1
                if not filled:
                    log.warning("engine %s: KV events %d..%d lost (replay gave %d)", name, first, seq - 1, len(got))
        self._apply(seq, frames[-1])
        st = self.router.nodes[name]
        st.connected = True

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except EngineEventError as e:
            self.blocks.refused["malformed"] += 1
            log.warning("engine %s: event batch %d unreadable: %s", self.spec.name, seq, e)
        else:
            self.blocks.apply(batch)
        self.last_seq = seq
        self.router.index.feed(self.spec.name).sequence = seq

    async def replay(self, first: int, last: int) -> list[tuple[int, bytes]]:
        """The batches of ``first..last`` the publisher still buffers: a run without a hole, from the
        oldest it holds (later than ``first`` once its buffer has moved on). It sends everything from
        ``first`` on, then an end marker; a batch missing from the run ends it."""
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out: list[tuple[int, bytes]] = []
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            want = first
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    break
                frames = await sock.recv_multipart()
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
