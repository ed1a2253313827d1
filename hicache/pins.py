"""Pinned prefixes (:meth:`hicache.cache.HiCache.pin`): cached pages kept where they are until unpinned.

Contract:

* A pin locks the L1 prefix it found and pins the L2 run continuing it, exactly as a request does, so
  eviction never takes them; it holds no pages of its own, and what requests compute from them is unchanged.
* The pages pins hold are counted per tier, overlapping pins each time; a pin that would take them past
  ``cache.max_pinned_fraction`` of a tier is refused with :class:`CacheFullError`.
* Every method is called under the cache's tree lock; pins are not kept across restarts.
"""

from __future__ import annotations

from hicache.cache_types import CacheFullError, PinInfo
from hicache.keys import Namespace
from hicache.radix import RadixTree, TreeMatch, TreeNode


class Pins:
    """The pins of one cache, by id (oldest first), and the pages they hold on (L1, L2)."""

    def __init__(self, tree: RadixTree, l1_pages: int, l2_pages: int, max_fraction: float) -> None:
        self.tree = tree
        self.capacity = (l1_pages, l2_pages)
        self.max_fraction = max_fraction
        self.held: dict[int, tuple[TreeNode | None, TreeNode | None, PinInfo]] = {}  # id -> L1 node, L2 node, info
        self.pinned = [0, 0]  # pages pins hold on L1, L2
        self._ids = 0

    def __len__(self) -> int:
        return len(self.held)

    def pin(self, m: TreeMatch, ns: Namespace) -> PinInfo:
        """Pin what match ``m`` found of ``ns``; ``ValueError`` when it found nothing cached."""
        if m.l1_pages + m.l2_pages == 0:
            raise ValueError("pin: no page of this prefix is cached")
        frac, (cap1, cap2) = self.max_fraction, self.capacity
        l1, l2 = self.pinned[0] + m.l1_pages, self.pinned[1] + m.l2_pages
        if l1 > frac * cap1 or l2 > frac * cap2:
            raise CacheFullError(f"pin: pins would hold {l1} L1 / {l2} L2 pages, over "
                                 f"cache.max_pinned_fraction={frac} of {cap1} / {cap2}")
        host = m.host_nodes[-1] if m.host_nodes else None
        self.tree.lock(m.l1_node)
        self.tree.pin_host(host)
        self._ids += 1
        info = PinInfo(self._ids, m.l1_pages, m.l2_pages, ns.describe())
        self.held[info.pin_id] = (m.l1_node, host, info)
        self.pinned = [l1, l2]
        return info

    def unpin(self, pin_id: int) -> PinInfo:
        """Drop pin ``pin_id``; ``KeyError`` for an unknown id."""
        if pin_id not in self.held:
            raise KeyError(f"unpin: no pin {pin_id}")
        node, host, info = self.held.pop(pin_id)
        self.tree.unlock(node)
        self.tree.unpin_host(host)
        self.pinned = [self.pinned[0] - info.l1_pages, self.pinned[1] - info.l2_pages]
        return info

    def infos(self) -> list[PinInfo]:
        """The pins held now, oldest first."""
        return [info for _, _, info in self.held.values()]
