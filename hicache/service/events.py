"""The event hub behind WatchEvents: tree changes -> numbered events -> subscribers.

The cache calls :meth:`EventHub.on_tree_event` under its tree lock, in order, from whatever thread
changed the tree. The hub numbers events 1, 2, 3, ... (gap-free, per server run; ``server_id`` changes on
restart), converts each to one protobuf :class:`Event` and hands it to the event loop, which appends it
to every subscriber's bounded queue.

A subscriber starts with a snapshot of the whole tree taken under the tree lock together with the
sequence number of the last event it reflects (:meth:`HiCache.snapshot`'s ``at`` hook), then receives
every later event in order. A subscriber whose queue overflows is marked behind: its queue is dropped
and it gets a fresh snapshot, so a consumer never sees a gap it does not know about.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import AsyncIterator, Callable

from hicache.proto_gen.hicache.v1 import hicache_pb2 as pb
from hicache.radix_types import TreeEvent

SNAPSHOT_RUNS_PER_MESSAGE = 512
_KINDS = {"stored": pb.Event.STORED, "removed": pb.Event.REMOVED, "tier": pb.Event.TIER_CHANGED}


def page_run(ev: TreeEvent) -> pb.PageRun:
    tiers = []
    if ev.on_device:
        tiers.append(pb.TIER_L1)
    if ev.on_host:
        tiers.append(pb.TIER_L2)
    return pb.PageRun(namespace_digest=ev.ns, parent_key=ev.parent_key, page_keys=ev.page_keys,
                      tokens=ev.tokens, tiers=tiers)


class Subscriber:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self.queue: collections.deque[pb.Event] = collections.deque()
        self.behind = False
        self.closed = False
        self.wakeup = asyncio.Event()


class EventHub:
    def __init__(self, loop: asyncio.AbstractEventLoop, server_id: str) -> None:
        self.server_id = server_id
        self.sequence = 0  # last event numbered (under _lock)
        self._lock = threading.Lock()
        self._loop = loop
        self._subs: set[Subscriber] = set()
        self._closed = False

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    @property
    def queued(self) -> int:
        return sum(len(s.queue) for s in self._subs)

    # called under the cache's tree lock, any thread
    def on_tree_event(self, ev: TreeEvent) -> None:
        with self._lock:
            self.sequence += 1
            seq = self.sequence
            if not self._subs:
                return
        msg = pb.Event(sequence=seq, kind=_KINDS[ev.kind], runs=[page_run(ev)], server_id=self.server_id)
        with contextlib.suppress(RuntimeError):  # the loop is closed (shutdown): nobody listens any more
            self._loop.call_soon_threadsafe(self._dispatch, msg)

    def _dispatch(self, msg: pb.Event) -> None:
        for s in self._subs:
            if s.behind:
                continue
            if len(s.queue) >= s.max_queue:
                s.behind = True
                s.queue.clear()
            else:
                s.queue.append(msg)
            s.wakeup.set()

    def close(self) -> None:
        """End every subscription (shutdown)."""
        self._closed = True
        for s in self._subs:
            s.closed = True
            s.wakeup.set()

    async def stream(self, snapshot: Callable[[Callable[[], None]], list[TreeEvent]],
                     max_queue: int) -> AsyncIterator[pb.Event]:
        """Yield a snapshot, then every event, re-snapshotting after falling behind.

        ``snapshot(at)`` returns the tree's runs and calls ``at()`` under the same tree-lock hold
        (``HiCache.snapshot``); it runs on a worker thread.
        """
        sub = Subscriber(max_queue)
        self._subs.add(sub)
        try:
            while not sub.closed and not self._closed:
                sub.behind = False
                sub.queue.clear()
                at_seq = [0]

                def mark(box: list[int] = at_seq) -> None:
                    with self._lock:
                        box[0] = self.sequence

                runs = await asyncio.to_thread(snapshot, mark)
                snap_seq = at_seq[0]
                for i in range(0, max(len(runs), 1), SNAPSHOT_RUNS_PER_MESSAGE):
                    part = runs[i:i + SNAPSHOT_RUNS_PER_MESSAGE]
                    yield pb.Event(sequence=snap_seq, kind=pb.Event.SNAPSHOT, runs=[page_run(r) for r in part],
                                   server_id=self.server_id,
                                   snapshot_continues=i + SNAPSHOT_RUNS_PER_MESSAGE < len(runs))
                while not sub.closed and not sub.behind:
                    if not sub.queue:
                        sub.wakeup.clear()
                        await sub.wakeup.wait()
                        continue
                    msg = sub.queue.popleft()
                    if msg.sequence <= snap_seq:
                        continue  # already in the snapshot
                    yield msg
        finally:
            self._subs.discard(sub)
