"""Load per node: requests the router sent and not yet completed, and the queue depth nodes report.

A counter that only ever goes up (completions never reported) or never moves (a node that never
reports) would pin or starve a node, so:

* every routed request counts at once on its node (no report needed for the counter to move) and stops
  counting on ``finish`` (the client's Complete) or when it is older than ``ttl_s`` (a client that
  crashed, a timeout): :meth:`InflightTracker.expire` runs before every decision;
* a reported queue depth is trusted for ``stale_after_s`` only; after that it counts as 0 and the
  router's own counter is the load.

The load of a node is ``max(in_flight, queue_depth)``: the node's open requests include the router's
own, so adding the two would count them twice; other clients' requests show up in the queue depth.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple


class Inflight(NamedTuple):
    node: str
    deadline: float
    started: float  # when it was routed (the tracker's clock)
    key: Hashable = None  # the client's name for the request (None: unnamed)


class InflightTracker:
    """Routes in flight per node, each until its completion or ``ttl_s``."""

    LATE_CAP = 1 << 16  # routes past their TTL kept for a late completion

    def __init__(self, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._clock = clock
        self._routes: collections.OrderedDict[str, Inflight] = collections.OrderedDict()  # deadline order
        # routes dropped at the TTL, for another TTL (at most LATE_CAP): a completion arriving then still
        # says how the node did (a slow call that failed is a failure), though it no longer counts as load
        self._late: collections.OrderedDict[str, Inflight] = collections.OrderedDict()
        self._counts: collections.Counter[str] = collections.Counter()
        self._named: dict[Hashable, tuple[str, Any]] = {}  # request key -> (route id, what name() kept)
        # routes completed, for a TTL (at most LATE_CAP): a repeated Complete (a retry after its reply was
        # lost) is told it was taken, and changes nothing
        self._done: collections.OrderedDict[str, Inflight] = collections.OrderedDict()
        self._ids = itertools.count(1)
        self._prefix = f"{int(time.time() * 1000) & 0xFFFFFFFF:08x}"
        self.expired = 0  # routes dropped at the TTL

    def start(self, node: str) -> str:
        """Count one request on ``node``; returns its route id."""
        rid = f"{self._prefix}-{next(self._ids)}"
        now = self._clock()
        self._routes[rid] = Inflight(node, now + self.ttl_s, now)
        self._counts[node] += 1
        return rid

    def name(self, route_id: str, key: Hashable, kept: Any = None) -> None:
        """Let ``key`` (the client's name for the request) find ``route_id``, and ``kept``, through
        :meth:`named` while the route is in flight (a later route of the same key takes the name over)."""
        r = self._routes.get(route_id)
        if r is None or key is None:
            raise KeyError(f"route {route_id!r} is not in flight, or no key")
        self._routes[route_id] = r._replace(key=key)
        self._named[key] = (route_id, kept)

    def named(self, key: Hashable) -> tuple[str, Any] | None:
        """The route id of the request named ``key`` still in flight, and what :meth:`name` kept with it."""
        return self._named.get(key)

    def finish(self, route_id: str, remember: bool = True) -> Inflight | None:
        """Stop counting ``route_id``; returns its record (None: unknown or expired). ``remember``: keep it
        for :meth:`finished` (a completion; not a route taken back)."""
        r = self._routes.pop(route_id, None)
        if r is None:
            return None
        self._dec(r.node)
        self._unname(route_id, r)
        if remember:
            self._remember(route_id, r)
        return r

    def _remember(self, route_id: str, r: Inflight) -> None:
        self._done[route_id] = r._replace(deadline=self._clock() + self.ttl_s)
        self._done.move_to_end(route_id)
        while len(self._done) > self.LATE_CAP:
            self._done.popitem(last=False)

    def finished(self, route_id: str) -> Inflight | None:
        """The record of ``route_id`` if it was completed less than a TTL ago."""
        return self._done.get(route_id)

    def _unname(self, route_id: str, r: Inflight) -> None:
        if r.key is not None and self._named.get(r.key, ("",))[0] == route_id:
            del self._named[r.key]

    def finish_late(self, route_id: str) -> Inflight | None:
        """The record of ``route_id`` if it was dropped at the TTL less than another TTL ago (once only:
        :meth:`finished` has it after that)."""
        r = self._late.pop(route_id, None)
        if r is not None:
            self._remember(route_id, r)
        return r

    def expire(self) -> int:
        """Drop routes past their deadline (kept aside for :meth:`finish_late`); returns how many."""
        now = self._clock()
        n = 0
        while self._routes:
            rid, r = next(iter(self._routes.items()))
            if r.deadline > now:
                break
            del self._routes[rid]
            self._dec(r.node)
            self._unname(rid, r)
            self._late[rid] = r._replace(deadline=r.deadline + self.ttl_s)
            n += 1
        for kept in (self._late, self._done):
            while kept:
                rid, r = next(iter(kept.items()))
                if r.deadline > now and len(kept) <= self.LATE_CAP:
                    break
                del kept[rid]
        self.expired += n
        return n

    def _dec(self, node: str) -> None:
        self._counts[node] -= 1
        if self._counts[node] <= 0:
            del self._counts[node]

    def count(self, node: str) -> int:
        return self._counts.get(node, 0)

    def __len__(self) -> int:
        return len(self._routes)


class QueueDepth:
    """The last queue depth a node reported, trusted for ``stale_after_s``."""

    def __init__(self, stale_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._depth = 0
        self._at = float("-inf")

    def report(self, depth: int) -> None:
        self._depth = max(0, int(depth))
        self._at = self._clock()

    @property
    def value(self) -> int:
        return self._depth if self._clock() - self._at <= self.stale_after_s else 0
