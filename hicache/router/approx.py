"""The router's approximate index: each node's cache predicted from the router's own decisions.

With ``router.index: approximate`` the router opens no event stream and polls nothing: the nodes can be
any engine that takes the requests it routes (an engine with its own prefix cache and no hicache node
beside it), or hicache nodes whose event streams are not to be used. When the router sends a request to
a node, it assumes the node now holds the request's full prompt pages on L1, and it forgets them when

* ``ttl_s`` passes without any request touching them again (the node has likely evicted them), or
* the node's predicted pages exceed ``capacity_pages`` (least recently touched first), or
* the node's circuit breaker opens, or reopens from half-open (the node may have restarted with an empty
  cache), or
* the route is withdrawn (:meth:`hicache.router.core.Router.withdraw`: decided after the client's deadline,
  so the request never reached the node): the pages that route newly predicted are forgotten, if it is the
  latest route (the servicer withdraws right after deciding). An earlier route's pages stay, since later
  routes may have predicted pages below them; the pages a withdrawn route merely touched again keep their
  new touch time, and what its capacity eviction forgot stays forgotten (an under-prediction).

A request that fails on its node (Complete with an error code) keeps its prediction until one of the
above: the router keeps no route's pages once it has decided the next one. Such a prefix draws the next
request that shares it to that node once more, which then does hold it.

Routing on a prediction can be wrong both ways: a page the node evicted early is a miss the router did not
foresee, a page it still holds after the TTL is a hit the router does not count on. Neither changes what
the node computes, only where a request goes. An event-fed index (``router.index: events``, the default)
knows; this one guesses, without any traffic between the router and the nodes.

Prefix-closed by construction: a request's keys are touched leaf first, root last, so a page is always
touched no earlier than every page below it, and the least recently touched page of a node is never the
parent of one it keeps. Eviction and expiry therefore only ever cut a path's tail; so does a withdrawal,
since nothing is predicted below pages that were not predicted before the latest route.

Single-threaded by contract, like :class:`~hicache.router.index.KVIndex`, which it writes into.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from hicache.router.index import L1, KVIndex


class ApproxIndex:
    """Per node: the page keys the router predicts it holds, least recently touched first."""

    def __init__(self, index: KVIndex, ttl_s: float, capacity_pages: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages must be >= 1, got {capacity_pages}")
        self.index = index
        self.ttl_s = ttl_s
        self.capacity_pages = capacity_pages
        self.clock = clock
        self._lru: dict[str, OrderedDict[bytes, float]] = {}  # node -> key -> last touched
        self.expired = 0  # pages forgotten because their TTL passed
        self.evicted = 0  # pages forgotten because the node's predicted pages hit capacity_pages
        self.dropped = 0  # pages forgotten because the node was dropped
        self.withdrawn = 0  # pages forgotten because the route that predicted them was withdrawn

    def record(self, node: str, keys: Sequence[bytes]) -> list[bytes]:
        """``node`` was sent a request whose full pages have ``keys`` (root first): predict it holds them.
        Returns the keys this predicted anew and still predicts (a tail of ``keys``: pass them to
        :meth:`forget` to take this back before anything else is recorded)."""
        if not keys:
            return []
        new: list[bytes] = []
        now = self.clock()
        lru = self._lru.get(node)
        if lru is None:
            lru = self._lru[node] = OrderedDict()
        st = self.index.feed(node)
        for key in reversed(keys):  # leaf first: the root ends up the most recently touched
            if key in lru:
                lru.move_to_end(key)
            else:
                self.index.set_page(node, st, key, L1)
                new.append(key)
            lru[key] = now
        while len(lru) > self.capacity_pages:
            key, _ = lru.popitem(last=False)
            self.index.set_page(node, st, key, 0)
            self.evicted += 1
        return [k for k in new if k in lru]

    def forget(self, node: str, keys: Sequence[bytes]) -> None:
        """Take back what the latest :meth:`record` for ``node`` predicted anew (the keys it returned): those
        are the tail of a prefix-closed prediction with nothing predicted below them, so cutting them keeps
        it prefix-closed. Keys no longer predicted are skipped."""
        lru = self._lru.get(node)
        if not lru:
            return
        st = self.index.feed(node)
        for key in keys:
            if lru.pop(key, None) is not None:
                self.index.set_page(node, st, key, 0)
                self.withdrawn += 1

    def expire(self) -> None:
        """Forget every node's pages not touched for ``ttl_s``."""
        cutoff = self.clock() - self.ttl_s
        for node, lru in self._lru.items():
            st = None
            while lru:
                key, touched = next(iter(lru.items()))
                if touched > cutoff:
                    break
                del lru[key]
                st = st or self.index.feed(node)
                self.index.set_page(node, st, key, 0)
                self.expired += 1

    def drop(self, node: str) -> None:
        """Forget everything predicted for ``node``."""
        lru = self._lru.pop(node, None)
        if lru:
            self.dropped += len(lru)
            self.index.drop(node)

    def pages(self, node: str) -> int:
        """Pages predicted on ``node``."""
        return len(self._lru.get(node, ()))

    def check(self) -> None:
        """Integrity check (tests call it): the LRU order agrees with touch times, and the index holds
        exactly the predicted keys, each as an L1 page of its node."""
        for node, lru in self._lru.items():
            times = list(lru.values())
            assert times == sorted(times), f"{node}: LRU order disagrees with touch times"
            assert len(lru) <= self.capacity_pages, f"{node}: {len(lru)} pages over {self.capacity_pages}"
            held = self.index.feed(node).pages
            assert held.keys() == lru.keys(), f"{node}: index and prediction differ"
            assert all(m == L1 for m in held.values()), f"{node}: a predicted page is not L1"
