"""A policy with ghost lists of evicted pages: ``arc`` (adaptive recency / frequency)."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from hicache.eviction.base import EvictionPolicy, peak_pages, register_policy, remember

if TYPE_CHECKING:
    from hicache.radix import RadixTree, TreeNode


class _ArcMeta:
    """``TreeNode.meta`` under :class:`ARC`: whether the node is in T2 (hit since it entered the tree)."""

    __slots__ = ("t2",)

    def __init__(self, t2: bool) -> None:
        self.t2 = t2


@register_policy("arc")
class ARC(EvictionPolicy):
    """ARC (Megiddo and Modha, adaptive replacement cache) on the leaves of the prefix tree, counted in pages.

    Contract. Every node the policy saw enter the tree is in one of two lists: T1, nodes no request has
    hit since they entered, and T2, nodes hit at least once. Two ghost lists remember the page keys of
    pages that left the tree: B1 those that left from T1, B2 those from T2, each at most the most pages
    the tree has held (``peak``), oldest forgotten first. A new leaf holding a page of B1 raises the
    target size ``p`` of T1 by ``max(1, |B2| / |B1|)`` x its pages (recency would have kept it); one
    holding a page of B2 lowers ``p`` by ``max(1, |B1| / |B2|)`` x its pages (frequency would have); both
    kinds start in T2 and leave the ghost list. ``0 <= p <= peak``. Order: while T1 holds more than ``p``
    pages, T1 nodes go first, otherwise T2 nodes first; least recently used first within each list.
    Keys are taken when an eviction starts (the tree heaps them once), so one eviction call uses one
    order. Nodes the policy never saw (none in practice) count as T2.

    Why: ARC splits the cache between new content and content that proved itself, and learns the split
    from its own mistakes, with no tuning. Held out (``benchmarks/policy_eval.py``): 1-2 points ahead
    of LRU on the Mooncake trace and where one-off prompts flood the cache, up to 2 points behind it on
    multi-turn chat and RAG with flat popularity, where its frequency list keeps what recency would drop.

    Cost: O(1) per key and hook; inserting or removing a leaf is O(its pages) ghost look-ups; the ghosts
    hold at most 2 x ``peak`` page keys.
    """

    def bind(self, tree: RadixTree) -> None:
        self.tree = tree
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.t1_pages = 0  # pages of T1 nodes in the tree
        self.p = 0.0  # target pages of T1
        self.peak = 1

    def in_t2(self, node: TreeNode) -> bool:
        m = node.meta
        return m is None or bool(m.t2)

    def key(self, node: TreeNode) -> Any:
        t1_first = self.t1_pages > self.p
        return (self.in_t2(node) == t1_first, node.last_access)

    def on_match(self, node: TreeNode, now: int) -> None:
        m = node.meta
        if m is not None and not m.t2:
            m.t2 = True
            self.t1_pages -= node.n_pages

    def on_insert(self, node: TreeNode, now: int, created: bool) -> None:
        if not created:
            return
        g1 = g2 = 0  # pages of the leaf found in B1 / B2
        for pk in node.page_keys:
            if self.b1.pop(pk, 0) is None:
                g1 += 1
            elif self.b2.pop(pk, 0) is None:
                g2 += 1
        self.peak = peak_pages(self.tree, self.peak)
        b1, b2 = max(len(self.b1), 1), max(len(self.b2), 1)
        self.p += max(b2 / b1, 1.0) * g1 - max(b1 / b2, 1.0) * g2
        self.p = min(float(self.peak), max(0.0, self.p))
        if not (g1 or g2):
            self.t1_pages += node.n_pages
        node.meta = _ArcMeta(bool(g1 or g2))

    def on_split(self, upper: TreeNode, lower: TreeNode) -> None:
        m = lower.meta
        if m is not None:
            upper.meta = _ArcMeta(m.t2)  # the pages only change nodes: T1's page count stays

    def on_remove(self, node: TreeNode) -> None:
        m = node.meta
        if m is None:
            return
        if not m.t2:
            self.t1_pages -= node.n_pages
        remember(self.b2 if m.t2 else self.b1, node.page_keys, None, self.peak)
