"""The cache's accounting of tiers and metrics: what each tier holds now, and what became of each request's hits.

Contract:

* :class:`Accounting` is the one writer of the cache's gauges and hit / unserved counters (the request and
  admin paths of :class:`hicache.cache.HiCache` write the other counters where the event happens). Every
  method is called under the tree lock, except :meth:`Accounting.export_tenants` (a scrape's, after
  :meth:`Accounting.update_gauges` under it). Counts are tokens (pages times the page size).
* A counted match opens a tally per run it found below L1 (:meth:`Accounting.open_tallies`): an
  :class:`L2Tally` for the L2 run, an :class:`L3Tally` for the L3 run. Each is counted exactly once, at the
  first of the request's load back, commit (L2) or release, and then dropped from the request
  (:meth:`Accounting.count_l2`, :meth:`Accounting.count_l3`): ``hicache_hit_tokens_total{tier}`` its served
  pages, ``hicache_l2_unserved_tokens_total{reason}`` / ``hicache_l3_unserved_tokens_total{reason}`` the rest.
  A peek (:meth:`hicache.cache.HiCache.peek`) opens no request and is not counted at all.
* The store's own counters (:meth:`hicache.storage.base.StorageBackend.stats`) are folded into the metrics
  as they grow, at every gauge update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.cache_types import Request
    from hicache.metrics import Metrics
    from hicache.pool import DevicePool, HostPool
    from hicache.storage.base import StorageBackend
    from hicache.storage.writeback import Writeback

L2_UNSERVED_REASONS = ("no_room", "not_loaded")
L3_UNSERVED_REASONS = ("not_fetched", "missing", "cut_short", "dropped")


@dataclass
class L2Tally:
    """One request's L2 run, pages ``[first, first + pages)`` of its prompt, until it is counted.

    At match time the run (the pages continuing the request's L1 prefix on L2) is pinned, so it stays on L2;
    the request only gets it once its load back (L2 -> L1) lands it in its prefix. Page by page it ends in
    exactly one of:

    * ``served`` -- part of the request's prefix on L1 after its load back (loaded by it, or found already
      loaded by another request): ``hicache_hit_tokens_total{tier="l2"}``;
    * ``no_room`` -- not loaded back because its load back found no room on L1 (every L1 page locked by
      requests in flight: :class:`~hicache.cache_types.CacheFullError`), and no later load back landed it;
    * ``not_loaded`` -- the request never loaded it back: released first (a client gone, a Match whose
      ``load`` failed for another reason, an engine that recomputed), or it committed its own pages for
      those tokens first.
    """

    first: int  # first page of the run (the L1 hit at match)
    pages: int  # pages of the run
    no_room: bool = False  # a load back of it failed for lack of L1 room

    def outcome(self, usable: int) -> dict[str, int]:
        """The split, in pages, given ``usable``: the length of the request's prefix on L1 after its load
        back (0 when it never loaded back). Keys ``served`` and :data:`L2_UNSERVED_REASONS`; the values add
        up to ``pages``."""
        served = min(self.pages, max(0, usable - self.first))
        rest = self.pages - served
        return {"served": served, "no_room": rest if self.no_room else 0,
                "not_loaded": 0 if self.no_room else rest}


@dataclass
class L3Tally:
    """One request's L3 run, pages ``[first, first + pages)`` of its prompt, and its prefetch's outcome.

    At match time the store only says which pages it holds (``batch_exists``); whether the request gets
    them is decided later, by its prefetch and by its load back. Page by page the run ends in exactly one of:

    * ``served`` -- landed on L2 through the request's prefetch and part of its usable prefix after its
      load back (``hicache_hit_tokens_total{tier="l3"}``);
    * ``not_fetched`` -- no prefetch read it: none was started (below ``storage.prefetch_threshold_tokens``,
      no L2, over ``storage.prefetch_max_inflight_bytes``, no room on L2, or never asked for), or the
      request's tokens no longer reached it when one was;
    * ``missing`` -- the store did not return it (absent, damaged, foreign, or the store failing) or an
      earlier page of the run (a prefix stops at its first missing page);
    * ``cut_short`` -- the prefetch was stopped before it landed (``storage.prefetch_policy``'s wait ended,
      the request was released, the node closed);
    * ``dropped`` -- it landed but the request could not use it (released before its load back, its tokens
      changed, its prefix or the page left the cache first, no room on L1).

    Every page the match counted on L3 (``hicache_l3_matched_tokens_total``) is counted once so. Page counts,
    not tokens; every field only grows towards the outcome (``fetch_pages`` is set once, when a prefetch
    starts; ``landed``/``missed``/``kept`` when it ends)."""

    first: int  # first page of the run (the L1 + L2 hit at match)
    pages: int  # pages the store reported present
    fetch_first: int = 0  # first page the prefetch asked for (>= first)
    fetch_pages: int = 0  # pages it asked for (0: none started); they lie within the run
    landed: int = 0  # leading pages of those read and verified before it stopped
    missed: bool = False  # it stopped because the store did not return the next page (else it was stopped)
    kept: int = 0  # leading landed pages that entered the cache for this request

    def outcome(self, usable: int) -> dict[str, int]:
        """The split, in pages, given ``usable``: the length of the request's prefix on L1 after its load
        back (0 when it never loaded the prefetch back). Keys ``served`` and :data:`L3_UNSERVED_REASONS`;
        the values add up to ``pages``."""
        fetched = min(self.fetch_pages, self.pages)
        landed = min(self.landed, fetched)
        kept = min(self.kept, landed)
        served = min(kept, max(0, usable - self.fetch_first))
        return {"served": served, "not_fetched": self.pages - fetched,
                "missing": fetched - landed if self.missed else 0,
                "cut_short": 0 if self.missed else fetched - landed,
                "dropped": landed - served}


class Accounting:
    """Gauges of the tiers and the counting of matches and their runs, for one cache."""

    def __init__(self, metrics: Metrics, page_size: int, device_pool: DevicePool, host_pool: HostPool | None,
                 writeback: Writeback | None, storage: StorageBackend | None) -> None:
        """``host_pool`` is None without L2 (its pages then count as 0 used)."""
        self.metrics = metrics
        self.page_size = page_size
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.writeback = writeback
        self.storage = storage
        self._storage_seen: dict[str, int] = {}  # the store's counters already folded in, by field

    def update_gauges(self, pinned: Sequence[int], prefetch_inflight_bytes: int) -> None:
        """Pages used and pinned per tier, prefetch bytes in flight, the writeback queue; the store's
        counters brought up to date. ``pinned``: pages pins hold on (L1, L2)."""
        m = self.metrics
        m.used["l1"].set(self.device_pool.allocator.used_pages)
        m.used["l2"].set(self.host_pool.allocator.used_pages if self.host_pool is not None else 0)
        m.pinned["l1"].set(pinned[0])
        m.pinned["l2"].set(pinned[1])
        m.prefetch_inflight_bytes.set(prefetch_inflight_bytes)
        if self.writeback is not None:
            m.writeback_queue.set(self.writeback.queued_pages)
        if self.storage is not None:
            st = self.storage.stats()
            seen = self._storage_seen
            for f, counter in m.storage.items():
                now = getattr(st, f)
                if now > seen.get(f, 0):
                    counter.inc(now - seen.get(f, 0))
                    seen[f] = now

    def export_tenants(self, pages: Mapping[str, tuple[int, int]], shares: Mapping[str, float]) -> None:
        """At a scrape: each named tenant's pages (L1, L2) and its share."""
        m = self.metrics
        for tenant, (l1, l2) in pages.items():
            m.tenant_pages.labels(tenant, "l1").set(l1)
            m.tenant_pages.labels(tenant, "l2").set(l2)
            m.tenant_share.labels(tenant).set(shares[tenant])

    def open_tallies(self, req: Request) -> None:
        """At a counted match: a tally for each run the request found on L2 and L3."""
        if req.l2_pages:
            req.l2 = L2Tally(req.l1_pages, req.l2_pages)
        if req.l3_pages:
            req.l3 = L3Tally(req.l1_pages + req.l2_pages, req.l3_pages)

    def count_match(self, req: Request) -> None:
        """The lookup, its L1 hit, the L3 pages the store reported and the match's latency, once: a no-op
        for a request already counted or never to be (``req.uncounted`` None)."""
        if req.uncounted is None:
            return
        mt = self.metrics
        mt.lookups.inc()
        mt.lookup_tokens.inc(req.num_pages * self.page_size)
        mt.hit["l1"].inc(req.l1_pages * self.page_size)
        if req.l3_pages:
            mt.l3_matched_tokens.inc(req.l3_pages * self.page_size)
        mt.match_seconds.observe(req.uncounted)
        req.uncounted = None

    def count_l2(self, req: Request, usable: int) -> None:
        """Count the request's L2 run, if it is still open, given ``usable`` (:meth:`L2Tally.outcome`)."""
        tally, req.l2 = req.l2, None
        if tally is not None:
            self._count_tier("l2", tally.outcome(usable), self.metrics.l2_unserved)

    def count_l3(self, req: Request, usable: int) -> None:
        """Count the request's L3 run, if it is still open, given ``usable`` (:meth:`L3Tally.outcome`)."""
        tally, req.l3 = req.l3, None
        if tally is not None:
            self._count_tier("l3", tally.outcome(usable), self.metrics.l3_unserved)

    def _count_tier(self, tier: str, outcome: dict[str, int], unserved: Mapping[str, Any]) -> None:
        self.metrics.hit[tier].inc(outcome.pop("served") * self.page_size)
        for reason, pages in outcome.items():
            if pages:
                unserved[reason].inc(pages * self.page_size)
