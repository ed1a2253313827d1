"""Eviction from the radix tree: :class:`TreeEviction`, the half of :class:`hicache.radix.RadixTree` that
frees pages.

:meth:`~TreeEviction.evict_device` frees L1 pages from unlocked L1 nodes with no L1 child, in the order of
the tree's eviction policy (:mod:`hicache.eviction`: the smallest key goes first); a node already on L2 is
downgraded to host-only, one that is not is offered to ``backup`` (write-back) first and dropped when it is
still on no other tier (skipped when it has L2-only children). :meth:`~TreeEviction.evict_host` frees L2
pages from leaves that are on neither L1 nor pinned, removing them from the tree. Both take per-namespace
caps (a tenant's share of the tier): a namespace over its cap loses pages first, in policy order among
them, until it is back at its cap; then every namespace's pages go together in policy order. ``only``
limits eviction to some namespaces (a tenant's Clear). Both return the freed page arrays: the caller gives
them back to the pool. A parent that becomes evictable joins the candidates as its child leaves.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import numpy as np

from hicache.eviction import EvictionPolicy
from hicache.radix_types import TreeNode


class TreeEviction:
    """Eviction over the tree :class:`hicache.radix.RadixTree` builds; what it uses of the tree is below."""

    roots: dict[bytes, TreeNode]
    stride: int
    device_pages: int
    host_pages: int
    policy: EvictionPolicy
    _policy: Callable[[TreeNode], Any]
    _observe: bool

    def nodes(self, ns: bytes | None = None) -> Iterator[TreeNode]:
        raise NotImplementedError

    def _emit(self, kind: str, node: TreeNode) -> None:
        raise NotImplementedError

    def _l1_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and node.device is not None
            and node.lock_ref == 0
            and not any(c.device is not None for c in node.children.values())
        )

    def _candidates(self, evictable: Callable[[TreeNode], bool], on_device: bool,
                    caps: Mapping[bytes, int] | None, only: Collection[bytes] | None = None
                    ) -> tuple[list[tuple[Any, ...]], dict[bytes, int]]:
        """The eviction heap over every ``evictable`` node (of the namespace digests ``only``, when given), and
        per namespace with a cap in ``caps`` the pages it holds on the tier beyond that cap. Entries are
        ``(first, policy key, id, node, ns)``: ``first`` is 0 for a namespace over its cap (its pages go
        first), else 1."""
        heap: list[tuple[Any, ...]] = []
        over: dict[bytes, int] = {}
        for ns in self.roots:
            if only is not None and ns not in only:
                continue
            cap = caps.get(ns) if caps else None
            held = 0
            found = []
            for node in self.nodes(ns):
                if cap is not None and (node.device if on_device else node.host) is not None:
                    held += node.n_pages
                if evictable(node):
                    found.append(node)
            if cap is not None and held > cap:
                over[ns] = held - cap
            first = 0 if ns in over else 1
            heap.extend((first, self._policy(n), id(n), n, ns) for n in found)
        heapq.heapify(heap)
        return heap, over

    def _next_victim(self, heap: list[tuple[Any, ...]], over: dict[bytes, int],
                     evictable: Callable[[TreeNode], bool]) -> tuple[TreeNode, bytes] | None:
        """Pop the next node to evict: still evictable, and ranked first only while its namespace is still
        over its cap (one that came back under it is ranked again with the rest)."""
        while heap:
            first, _, _, node, ns = heapq.heappop(heap)
            if not evictable(node):
                continue
            if first == 0 and over.get(ns, 0) <= 0:
                heapq.heappush(heap, (1, self._policy(node), id(node), node, ns))
                continue
            return node, ns
        return None

    @staticmethod
    def _push(heap: list[tuple[Any, ...]], over: dict[bytes, int], key: Any, node: TreeNode, ns: bytes) -> None:
        heapq.heappush(heap, (0 if over.get(ns, 0) > 0 else 1, key, id(node), node, ns))

    def evict_device(self, n_pages: int, backup: Callable[[TreeNode], bool],
                     caps: Mapping[bytes, int] | None = None, only: Collection[bytes] | None = None
                     ) -> list[np.ndarray]:
        """Free at least ``n_pages`` L1 pages (fewer if not enough are evictable), policy order.

        ``caps``: L1 pages per namespace digest (a tenant's share). A namespace holding more than its cap
        loses pages first, in policy order among them, until it is back at its cap; then every namespace's
        pages are evicted together in policy order. Without caps: policy order over all. ``only``: evict
        pages of these namespace digests alone (a tenant's Clear).

        Candidates are unlocked L1 nodes with no L1 child. A candidate already on L2 is downgraded to
        host-only. One that is not is first offered to ``backup(node)`` (write-back); if that gives it
        L2 pages it is downgraded, else it is dropped when it is a leaf and skipped when it has
        (L2-only) children. A node whose L2 -> L1 load (``load_handle``) has not landed yet is waited
        for first, so a freed page is never still being written. Returns the freed L1 page arrays; the
        caller returns them to the pool.
        """
        heap, over = self._candidates(self._l1_evictable, True, caps, only)
        freed: list[np.ndarray] = []
        count = 0
        while count < n_pages:
            victim = self._next_victim(heap, over, self._l1_evictable)
            if victim is None:
                break
            node, ns = victim
            if node.host is None:
                backup(node)
            if node.host is None and node.children:
                continue
            assert node.device is not None
            if node.load_handle is not None and not node.load_handle.done():
                # An L2 -> L1 load may still be writing these pages: unlocked pages can still be
                # loading when the request that loaded them was released before the load landed. Let
                # it land before the pages go back to the pool, or the copy would overwrite what
                # their next owner writes there. A load that failed writes nothing more either (its
                # error is its requester's to see): the pages are dropped all the same.
                with contextlib.suppress(Exception):
                    node.load_handle.wait()
            freed.append(node.device)
            count += node.n_pages
            if ns in over:
                over[ns] -= node.n_pages
            self.device_pages -= node.n_pages
            node.device = None
            node.load_handle = None
            if node.host is not None:
                self._emit("tier", node)
            parent = node.parent
            if node.host is None:
                self._remove(node)
            assert parent is not None
            if self._l1_evictable(parent):
                self._push(heap, over, self._policy(parent), parent, ns)
        return freed

    def _l2_evictable(self, node: TreeNode) -> bool:
        return (
            node.parent is not None
            and not node.children
            and node.device is None
            and node.host is not None
            and node.host_pin == 0
        )

    def evict_host(self, n_pages: int, caps: Mapping[bytes, int] | None = None,
                   only: Collection[bytes] | None = None) -> list[np.ndarray]:
        """Free at least ``n_pages`` L2 pages from leaves that are not on L1 and not pinned.

        The nodes are removed from the tree (L3, if any, still has them). ``caps``: L2 pages per namespace
        digest, and ``only``, as for :meth:`evict_device`. Returns the freed L2 arrays.
        """
        heap, over = self._candidates(self._l2_evictable, False, caps, only)
        freed: list[np.ndarray] = []
        count = 0
        while count < n_pages:
            victim = self._next_victim(heap, over, self._l2_evictable)
            if victim is None:
                break
            node, ns = victim
            assert node.host is not None
            freed.append(node.host)
            count += node.n_pages
            if ns in over:
                over[ns] -= node.n_pages
            parent = node.parent
            self._remove(node)
            if parent is not None and self._l2_evictable(parent):
                self._push(heap, over, self._policy(parent), parent, ns)
        return freed

    def _remove(self, node: TreeNode) -> None:
        """Detach a leaf; its L2 pages (if any) are accounted as freed by the caller."""
        assert not node.children and node.device is None and node.parent is not None
        if node.host is not None:
            self.host_pages -= node.n_pages
            node.host = None
        self._emit("removed", node)
        if self._observe:
            self.policy.on_remove(node)
        parent = node.parent
        del parent.children[node.key[: self.stride]]
        node.parent = None
        if parent.parent is None and not parent.children:
            for ns, root in list(self.roots.items()):
                if root is parent:
                    del self.roots[ns]

