"""What became of the pages a request matched on L2: loaded back onto L1 for it, or why not.

At match time the L2 run (the pages continuing the request's L1 prefix on L2) is pinned, so it stays on L2;
the request only gets it once its load back (L2 -> L1) lands it in its prefix. An :class:`L2Tally`
follows one request's L2 run from match to that end and splits it, page by page, into:

* ``served`` -- part of the request's prefix on L1 after its load back (loaded by it, or found already
  loaded by another request): ``hicache_hit_tokens_total{tier="l2"}``;
* ``no_room`` -- not loaded back because its load back found no room on L1 (every L1 page locked by
  requests in flight: :class:`~hicache.cache_types.CacheFullError`), and no later load back landed it;
* ``not_loaded`` -- the request never loaded it back: released first (a client gone, a Match whose
  ``load`` failed for another reason, an engine that recomputed), or it committed its own pages for
  those tokens first.

The last two are ``hicache_l2_unserved_tokens_total{reason}``. Every page a counted match found on L2 ends
in exactly one of the three, once the request has loaded back, committed or been released; a peek
(:meth:`hicache.cache.HiCache.peek`) opens no request and is not counted at all.
"""

from __future__ import annotations

from dataclasses import dataclass

UNSERVED_REASONS = ("no_room", "not_loaded")


@dataclass
class L2Tally:
    """One request's L2 run, pages ``[first, first + pages)`` of its prompt, until it is counted."""

    first: int  # first page of the run (the L1 hit at match)
    pages: int  # pages of the run
    no_room: bool = False  # a load back of it failed for lack of L1 room

    def outcome(self, usable: int) -> dict[str, int]:
        """The split, in pages, given ``usable``: the length of the request's prefix on L1 after its load
        back (0 when it never loaded back). Keys ``served`` and :data:`UNSERVED_REASONS`; the values add
        up to ``pages``."""
        served = min(self.pages, max(0, usable - self.first))
        rest = self.pages - served
        return {"served": served, "no_room": rest if self.no_room else 0,
                "not_loaded": 0 if self.no_room else rest}
