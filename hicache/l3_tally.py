"""What became of the pages a request matched on L3: served from L3, or why not.

At match time the store only says which pages it holds (``batch_exists``); whether the request gets
them is decided later, by its prefetch (the store may no longer have a page, or return it damaged or
foreign; the policy's wait may end first; the request may be released first) and by its load back
(a landed page must still be in the cache and reach L1). An :class:`L3Tally` follows one request's L3
run from match to that end and splits it, page by page, into:

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

The last four are ``hicache_l3_unserved_tokens_total{reason}``. Every page the match counted on L3
(``hicache_l3_matched_tokens_total``) ends in exactly one of the five, once the request has loaded its
prefetch back or been released.
"""

from __future__ import annotations

from dataclasses import dataclass

UNSERVED_REASONS = ("not_fetched", "missing", "cut_short", "dropped")


@dataclass
class L3Tally:
    """One request's L3 run, pages ``[first, first + pages)`` of its prompt, and its prefetch's outcome.

    Page counts, not tokens; every field only grows towards the outcome (``fetch_pages`` is set once, when
    a prefetch starts; ``landed``/``missed``/``kept`` when it ends)."""

    first: int  # first page of the run (the L1 + L2 hit at match)
    pages: int  # pages the store reported present
    fetch_first: int = 0  # first page the prefetch asked for (>= first)
    fetch_pages: int = 0  # pages it asked for (0: none started); they lie within the run
    landed: int = 0  # leading pages of those read and verified before it stopped
    missed: bool = False  # it stopped because the store did not return the next page (else it was stopped)
    kept: int = 0  # leading landed pages that entered the cache for this request

    def outcome(self, usable: int) -> dict[str, int]:
        """The split, in pages, given ``usable``: the length of the request's prefix on L1 after its load
        back (0 when it never loaded the prefetch back). Keys ``served`` and :data:`UNSERVED_REASONS`;
        the values add up to ``pages``."""
        fetched = min(self.fetch_pages, self.pages)
        landed = min(self.landed, fetched)
        kept = min(self.kept, landed)
        served = min(kept, max(0, usable - self.fetch_first))
        return {"served": served, "not_fetched": self.pages - fetched,
                "missing": fetched - landed if self.missed else 0,
                "cut_short": 0 if self.missed else fetched - landed,
                "dropped": landed - served}
