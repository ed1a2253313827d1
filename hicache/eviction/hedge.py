"""``hedge_lru``, the default policy: LRU, hedged by miniature simulations of probation orders."""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from hicache.eviction.base import EvictionPolicy, register_policy, remember

if TYPE_CHECKING:
    from hicache.radix import RadixTree, TreeNode


class _Hit:
    """``TreeNode.meta`` under :class:`HedgeLRU`: whether a request hit the node since it entered the tree
    (or it came back from the ghost list), and the node's sampled page hashes, cached: ``sample`` holds
    the ``crc32`` of the keys of ``keys`` (the node's ``page_keys`` list when it was taken; a split gives
    the node a new one) that rate ``rate`` samples, in page order."""

    __slots__ = ("hit", "keys", "rate", "sample")

    def __init__(self, hit: bool) -> None:
        self.hit = hit
        self.keys: list[bytes] | None = None
        self.rate = 0
        self.sample: list[int] = []


class Shadow:
    """A page-level simulation of one order on sampled page hashes: LRU over all pages, except that while
    pages never hit since they came in (probation) hold more than ``share`` of the capacity, the least
    recent of them goes first (``share`` None: plain LRU). A page that comes back while the ghost list
    (the last ``capacity`` pages evicted) remembers it starts hit. Without a share nothing depends on
    probation or on the ghost list: neither is kept."""

    __slots__ = ("ghost", "pages", "probation", "share")

    def __init__(self, share: float | None) -> None:
        self.share = share
        self.pages: OrderedDict[int, None] = OrderedDict()  # least recent first
        self.probation: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def hits(self, path: list[int]) -> int:
        """Sampled pages of a request (root side first) this order would have served: the leading run held."""
        k = 0
        for h in path:
            if h not in self.pages:
                break
            k += 1
        return k

    def serve(self, path: list[int], capacity: int) -> None:
        """Access ``path`` (leaf side first, so a parent ends up more recent than its children), then evict
        down to ``capacity``."""
        pages, prob, ghost = self.pages, self.probation, self.ghost
        if self.share is None:
            for h in reversed(path):
                pages[h] = None
                pages.move_to_end(h)
        else:
            for h in reversed(path):
                if h in pages:
                    pages.move_to_end(h)
                    prob.pop(h, None)
                    continue
                pages[h] = None
                if ghost.pop(h, 0) is not None:
                    prob[h] = None
        self.trim(capacity)

    def access(self, path: list[int], capacity: int) -> int:
        """``hits(path)``, then ``serve(path, capacity)``, in one pass (leaf first): the leading run held
        ends at the root-most page that was missing before the pass. A hash seen twice in ``path`` (a crc32
        collision) that the pass itself brought in still counts as missing."""
        pages = self.pages
        move = pages.move_to_end
        last = None  # the root-most page missing before the pass
        added: set[int] = set()
        if self.share is None:
            for h in reversed(path):
                if h in pages:
                    move(h)
                    if h in added:
                        last = h
                else:
                    pages[h] = None
                    added.add(h)
                    last = h
        else:
            prob, ghost = self.probation, self.ghost
            for h in reversed(path):
                if h in pages:
                    move(h)
                    if h in prob:
                        del prob[h]
                    if h in added:
                        last = h
                elif h in ghost:
                    pages[h] = None
                    del ghost[h]
                    added.add(h)
                    last = h
                else:
                    pages[h] = None
                    prob[h] = None
                    added.add(h)
                    last = h
        if last is None:  # all held
            if len(pages) > capacity or len(self.ghost) > capacity:
                self.trim(capacity)
            return len(path)
        self.trim(capacity)
        return path.index(last)

    def trim(self, capacity: int) -> None:
        """Evict down to ``capacity`` pages (and forget ghosts beyond as many)."""
        pages, prob, ghost = self.pages, self.probation, self.ghost
        if self.share is None:
            while len(pages) > capacity:
                pages.popitem(last=False)
            return
        budget = self.share * capacity
        while len(pages) > capacity:
            if len(prob) > budget:
                h, _ = prob.popitem(last=False)
                del pages[h]
            else:
                h, _ = pages.popitem(last=False)
                prob.pop(h, None)
            ghost[h] = None
        while len(ghost) > capacity:
            ghost.popitem(last=False)

    def thin(self, mask: int, capacity: int) -> None:
        """Keep only the hashes of the sparser sample ``h & mask == 0`` (orders are kept), then trim to the
        capacity scaled alike."""
        for d in (self.pages, self.probation, self.ghost):
            for h in [h for h in d if h & mask]:
                del d[h]
        self.trim(capacity)

    def __len__(self) -> int:
        return len(self.pages)


@register_policy("hedge_lru")
class HedgeLRU(EvictionPolicy):
    """LRU, except while miniature simulations show that a probation order would have hit more.

    Contract. The policy simulates, page by page, on a sample of the page keys (``crc32(key)`` divisible
    by a power of two chosen so that a simulation holds ``SHADOW_PAGES`` to twice that many pages, at the
    tree's L1 capacity scaled alike: the most L1 pages the tree has held), LRU and one probation order
    per share in ``SHARES`` (:class:`Shadow`). A request is the pages of a match followed by the insert
    that continues it; each order is credited with the leading run of the request's sampled pages it
    held. Per probation order the policy keeps the decayed sum ``S`` of (its hits - LRU's hits) per
    request and the decayed sum ``V`` of their squares (half-life ``HALF_LIFE`` requests). It orders the
    tree as LRU until some order's ``S`` exceeds ``Z * sqrt(V)`` (a z-test that it is ahead), then as
    the order with the largest such ``S``, and goes back to LRU once the followed order's ``S`` drops to
    zero. On the tree, a probation order is ``(not (unhit and unhit pages > share * L1 peak), last
    access)``, smallest first: nodes no request hit since they came in go first while they hold more
    than their share, everything else by recency. A node re-inserted while the tree's ghost list (page
    keys of the last L1-peak pages that left the tree) remembers one of its pages starts hit. Keys are
    taken when an eviction starts; one eviction call uses one order. No randomness: the same requests
    give the same order.

    Why: LRU is what SGLang and vLLM ship, and on multi-turn chat and agent traffic nothing online beats
    it by much; where one-off prompts flood the cache (RAG tails, fresh documents asked once) protecting
    what was hit pays several points, and the wrong share loses as many elsewhere. A learned order that
    fits one trace hurts on the next one (``reuse_lru``, ``tail_lru``); here the decision is measured on
    the traffic itself, against LRU as the counterfactual, so an order that does not help is never
    followed for long. Held-out figures: ``benchmarks/policy_eval.py``.

    Cost: per request O(sampled pages x (1 + len(SHARES))) dict operations (one pass per order) and a
    list extend per node touched: a node's sampled hashes are cached on it (one crc32 per page when it
    enters the tree or is split, a filter of the cache when the rate goes up); keys O(1); memory about
    ``(1 + 3 x len(SHARES)) x 2 x SHADOW_PAGES`` ints (LRU keeps no probation or ghost list), the sampled
    hashes of the tree's pages and the ghost list's page keys. ``benchmarks/policy_cost.py`` times it.
    """

    SHARES: tuple[float, ...] = (0.3, 0.1)  # probation budgets simulated beside LRU, shares of the L1 peak
    Z = 1.5  # evidence (z-score of the decayed hit difference) needed to leave LRU; fit leave-one-out
    HALF_LIFE = 1024.0  # requests
    SHADOW_PAGES = 512  # sampled pages a simulation holds: between this and twice it (all pages below)

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.peak = 1  # most L1 pages the tree has held
        self.unhit_pages = 0  # pages of tree nodes not hit since they came in
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.rate = 1  # a page is simulated when crc32(key) % rate == 0
        self.lru = Shadow(None)
        self.shadows = [Shadow(s) for s in self.SHARES]
        self.score = [0.0] * len(self.SHARES)  # S: decayed sum of (its hits - LRU's hits)
        self.spread = [0.0] * len(self.SHARES)  # V: decayed sum of their squares
        self.keep = 0.5 ** (1.0 / self.HALF_LIFE)
        self.leader: int | None = None  # index into SHARES, None: LRU
        self.switches = 0
        self._now = -1  # clock of the hook group being collected
        self._kind = ""  # "m": a match's pages, "i": an insert's
        self._buf: list[int] = []
        self._pending: list[int] | None = None  # a match's sampled pages, waiting for its insert

    # ------------------------------------------------------------------ order
    def key(self, node: TreeNode) -> Any:
        i = self.leader
        if i is None:
            return (True, node.last_access)
        m = node.meta
        unhit = m is not None and not m.hit
        return (not (unhit and self.unhit_pages > self.SHARES[i] * self.peak), node.last_access)

    @property
    def following(self) -> float | None:
        """The probation share the tree is ordered by now (None: LRU)."""
        return None if self.leader is None else self.SHARES[self.leader]

    # ------------------------------------------------------------------ the request stream
    def _sample(self, node: TreeNode) -> None:
        """Append the node's sampled page hashes to the group's: cached on the node, taken again after a
        split (new ``page_keys``), thinned when the rate went up (a sparser sample of the same hashes)."""
        m, rate, keys = node.meta, self.rate, node.page_keys
        if m is None:
            mask = rate - 1
            self._buf += [h for h in map(zlib.crc32, keys) if not h & mask]
            return
        if m.keys is not keys or m.rate > rate:
            m.keys, m.rate = keys, rate
            mask = rate - 1
            m.sample = [h for h in map(zlib.crc32, keys) if not h & mask]
        elif m.rate != rate:
            m.rate = rate
            mask = rate - 1
            m.sample = [h for h in m.sample if not h & mask]
        self._buf += m.sample

    def _group(self, now: int, kind: str) -> None:
        """Hooks of one tree call share its clock: a new clock closes the previous group. A match group
        waits for the insert that follows it (the same request, whose path starts with it)."""
        if now == self._now:
            return
        buf, prev = self._buf, self._kind
        self._now, self._kind, self._buf = now, kind, []
        if prev == "m":
            if self._pending is not None:
                self._request(self._pending)
            self._pending = buf
        elif prev == "i":
            p = self._pending
            self._pending = None
            if p is not None and buf[: len(p)] != p:
                self._request(p)
            self._request(buf)

    def _request(self, path: list[int]) -> None:
        mask = self.rate - 1
        if mask:  # a match's pages wait for its insert, which may raise the rate
            path = [h for h in path if not h & mask]
        if not path:
            return
        cap = max(1, self.peak // self.rate)
        keep, score, spread = self.keep, self.score, self.spread
        base = self.lru.access(path, cap)
        for i, sh in enumerate(self.shadows):
            d = sh.access(path, cap) - base
            score[i] = score[i] * keep + d
            spread[i] = spread[i] * keep + d * d
        lead = self.leader
        if lead is not None and self.score[lead] <= 0.0:
            lead = None
        best = 0.0 if lead is None else self.score[lead]
        for i, s in enumerate(self.score):
            if s > best and s > self.Z * math.sqrt(self.spread[i]):
                lead, best = i, s
        if lead != self.leader:
            self.switches += 1
            self.leader = lead

    def _grow(self) -> None:
        p = self.tree.device_pages
        if p <= self.peak:
            return
        self.peak = p
        while p >= 2 * self.SHADOW_PAGES * self.rate:
            self.rate *= 2
            for sh in (self.lru, *self.shadows):
                sh.thin(self.rate - 1, max(1, p // self.rate))

    # ------------------------------------------------------------------ hooks
    def on_match(self, node: TreeNode, now: int) -> None:
        self._group(now, "m")
        self._sample(node)
        m = node.meta
        if m is not None and not m.hit:
            m.hit = True
            self.unhit_pages -= node.n_pages

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        self._group(now, "i")
        self._sample(node)
        if not created:
            return
        self._grow()
        back = False
        for pk in node.page_keys:
            if self.ghost.pop(pk, 0) is None:
                back = True
        node.meta = _Hit(back)
        if not back:
            self.unhit_pages += node.n_pages

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _Hit(m.hit)  # the pages only change nodes: the unhit page count stays
            m.keys = None  # lower loses its first pages: sampled again when next touched

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is None:
            return
        if not m.hit:
            self.unhit_pages -= node.n_pages
        remember(self.ghost, node.page_keys, None, self.peak)
