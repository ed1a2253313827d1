"""``reuse_lru``: LRU with leaves of origins that are seldom reused first (the default until ``hedge_lru``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from hicache.eviction.base import EvictionPolicy, peak_pages, register_policy, remember

if TYPE_CHECKING:
    from hicache.radix import RadixTree, TreeNode


class _Birth:
    """One leaf's insertion: its origin class, whether a later request reused it, and whether (part of) it
    left the tree unused first."""

    __slots__ = ("origin", "reused", "wasted")

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.reused = False
        self.wasted = False


class _Seen:
    """``TreeNode.meta`` under :class:`ReuseLRU`: the node's birth (shared by the halves of a split) and
    whether a request has hit this node's own pages."""

    __slots__ = ("birth", "hit")

    def __init__(self, birth: _Birth, hit: bool) -> None:
        self.birth = birth
        self.hit = hit


@register_policy("reuse_lru")
class ReuseLRU(EvictionPolicy):
    """LRU, except that leaves which are probably never used again go first (LRU among them); what is
    "probably" is learned online, per origin of a leaf, from what happened to earlier leaves.

    Contract. A new leaf is classed by where it hangs when inserted: ``fresh`` (under the root: new
    content from its first page), ``extend`` (under a node that had no other child: a conversation's
    next turn) or ``branch`` (beside siblings: a new question under shared documents, a new tail under
    a shared prompt). A leaf is *settled* when a later request hits it (reused) or when it leaves the
    tree unhit (wasted). For each origin the policy keeps the share of settled leaves that were reused,
    decayed (``REUSE_DECAY``: the last few hundred outcomes count; prior: one reuse in two, so an origin
    starts out neutral and leaves still waiting for their outcome do not count). A node is *probation*
    when no request has hit it yet and its origin's reuse share is below ``ONE_OFF_SHARE``; probation
    nodes are evicted before all others, LRU within each group. Nodes of origins that are mostly reused
    (a conversation's newest turn), and every node a request hit, are kept by plain recency.

    A reuse that comes after the leaf was already evicted still counts (its wasted outcome becomes a
    reuse), and protects the re-inserted content: the policy remembers the page keys of the last
    ``GHOST_FACTOR`` x (most pages the tree ever held) pages it removed (a ghost list, as in ARC / 2Q);
    a new leaf holding one of them counts as a reuse of that earlier birth and starts out hit. Without
    the ghost, an origin whose leaves are evicted before their reuse would look never-reused and stay
    in probation for good.

    Why: on traces where new content is mostly requested once (Mooncake: about a third of new
    documents come back, tails under a shared prefix almost never) plain LRU spends most of its
    capacity on content never asked for again; on RAG / few-shot it evicts the fresh question tails
    first, without scanning siblings; on multi-turn chat, where a new leaf is nearly always continued,
    it orders as LRU does. Online: it uses only past requests. Held out (``benchmarks/policy_eval.py``):
    on the Mooncake trace at 5-10% of the working set it is the best online policy measured (+1.3 / +2.6
    points over LRU), but where one origin's outcome does not predict the next leaf's -- flat RAG
    popularity, drifting popularity -- it loses up to 8 points to LRU, so it is no longer the default.

    Cost: O(1) per key and per touched node (three origins); inserting a leaf looks its page keys up
    in the ghost list (O(pages), like hashing them); the ghost holds at most ``GHOST_FACTOR`` x peak
    pages keys (32 bytes each).
    """

    ONE_OFF_SHARE = 0.5  # below this reuse share a never-hit leaf is more likely wasted than used
    REUSE_DECAY = 1 / 256  # weight lost per birth: the share follows the last few hundred leaves
    GHOST_FACTOR = 2.0  # ghost list length, in multiples of the most pages the tree has held

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.reuses: dict[str, float] = {"fresh": 0.0, "extend": 0.0, "branch": 0.0}
        self.wasted: dict[str, float] = {"fresh": 0.0, "extend": 0.0, "branch": 0.0}
        self.ghost: OrderedDict[bytes, _Birth] = OrderedDict()
        self.peak_pages = 1

    def reuse_share(self, origin: str) -> float:
        """Decayed share of ``origin``'s settled leaves that a later request reused (prior: 1 in 2)."""
        return (self.reuses[origin] + 1.0) / (self.reuses[origin] + self.wasted[origin] + 2.0)

    def _settle(self, origin: str, reused: bool) -> None:
        keep = 1.0 - self.REUSE_DECAY
        for o in self.reuses:
            self.reuses[o] *= keep
            self.wasted[o] *= keep
        if reused:
            self.reuses[origin] += 1.0
        else:
            self.wasted[origin] += 1.0

    def probation(self, node: TreeNode) -> bool:
        m = node.meta
        return m is not None and not m.hit and self.reuse_share(m.birth.origin) < self.ONE_OFF_SHARE

    def key(self, node: TreeNode) -> Any:
        return (not self.probation(node), node.last_access)

    def _reused(self, birth: _Birth) -> None:
        if not birth.reused:
            birth.reused = True
            if birth.wasted:  # settled as wasted when it left the tree; the ghost list saw it again
                self.wasted[birth.origin] = max(0.0, self.wasted[birth.origin] - 1.0)
            self._settle(birth.origin, True)

    def on_match(self, node: TreeNode, now: int) -> None:
        m = node.meta
        if m is not None:
            m.hit = True
            self._reused(m.birth)

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        if not created:
            return
        parent = node.parent
        assert parent is not None
        origin = "fresh" if parent.parent is None else "extend" if len(parent.children) == 1 else "branch"
        hit = False
        for pk in node.page_keys:
            earlier = self.ghost.pop(pk, None)
            if earlier is not None:
                self._reused(earlier)
                hit = True
                break
        node.meta = _Seen(_Birth(origin), hit)
        self.peak_pages = peak_pages(self.tree, self.peak_pages)

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _Seen(m.birth, m.hit)

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is None:
            return
        birth = m.birth
        if not birth.reused and not birth.wasted:  # left unused: its origin wasted the pages
            birth.wasted = True
            self._settle(birth.origin, False)
        remember(self.ghost, node.page_keys, m.birth, int(self.GHOST_FACTOR * self.peak_pages))
