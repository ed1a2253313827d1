"""One radix tree over all tiers, keyed by tokens, aligned to pages: :class:`RadixTree`.

Every non-root node (:class:`~hicache.radix_types.TreeNode`) holds a run of whole pages: its tokens (uint32
LE bytes), one page key per page, and where those pages live: ``device`` (L1 page indices) and/or ``host``
(L2 page indices). The tree matches, inserts, moves runs between tiers (telling ``listeners`` of every
change, :class:`~hicache.radix_types.TreeEvent`), locks and pins paths; eviction is
:class:`~hicache.radix_evict.TreeEviction`'s, the half of the tree that frees pages.

Invariants (``check_invariants`` verifies them; the property tests call it after every step):

* every non-root node is on L1, L2 or both (a node on neither is removed);
* L1 is prefix-closed: a node on L1 has its parent on L1 (or is a child of a root);
* a node with ``lock_ref > 0`` is on L1 and its parent's ``lock_ref`` is at least as large
  (``lock`` protects the whole path to the root);
* ``device_pages``/``host_pages`` equal the sums over nodes.

Matching compares tokens, never hashes alone. Eviction order comes from :mod:`hicache.eviction`.
The tree is *not* thread-safe: the cache serialises every call under its one tree lock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from hicache.eviction import make_policy
from hicache.radix_evict import TreeEviction
from hicache.radix_types import EMPTY, InsertResult, TreeEvent, TreeMatch, TreeNode

__all__ = ["EMPTY", "InsertResult", "RadixTree", "TreeEvent", "TreeMatch", "TreeNode"]


class RadixTree(TreeEviction):
    """Page-aligned radix tree with one root per namespace digest."""

    def __init__(self, page_size: int, policy: str = "lru") -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be >= 1, got {page_size}")
        self.page_size = page_size
        self.stride = page_size * 4
        self.roots: dict[bytes, TreeNode] = {}
        self.policy_name = policy
        self.policy = make_policy(policy)
        self.policy.bind(self)
        self._policy = self.policy.key
        self._observe = self.policy.observes  # call the policy's hooks (stateful policies only)
        self._clock = itertools.count(1)
        self.device_pages = 0  # pages on L1 held by the tree
        self.host_pages = 0  # pages on L2 held by the tree
        self.locked_device_pages = 0  # L1 pages of nodes with lock_ref > 0
        self.listeners: list[Callable[[TreeEvent], None]] = []  # told of every tier change (TreeEvent)

    # ------------------------------------------------------------------ lookup
    def _root(self, ns: bytes, create: bool) -> TreeNode | None:
        root = self.roots.get(ns)
        if root is None and create:
            root = TreeNode(None, b"", [])
            root.lock_ref = 1  # roots are never evicted
            self.roots[ns] = root
        return root

    def _diverge_page(self, node_key: bytes, tokens: bytes, pos: int) -> int:
        """Number of whole pages of ``node_key`` equal to ``tokens[pos:]``."""
        n = min(len(node_key), len(tokens) - pos) // 4
        a = np.frombuffer(node_key, dtype="<u4", count=n)
        b = np.frombuffer(tokens, dtype="<u4", count=n, offset=pos)
        neq = np.flatnonzero(a != b)
        same = int(neq[0]) if len(neq) else n
        return same // self.page_size

    def _split(self, node: TreeNode, pages: int) -> TreeNode:
        """Split ``node`` after ``pages`` pages; return the new upper node. Arrays are copied, not viewed."""
        cut = pages * self.stride
        parent = node.parent
        assert parent is not None and 0 < pages < node.n_pages
        upper = TreeNode(parent, node.key[:cut], node.page_keys[:pages])
        upper.device = None if node.device is None else node.device[:pages].copy()
        upper.host = None if node.host is None else node.host[:pages].copy()
        upper.lock_ref, upper.host_pin = node.lock_ref, node.host_pin
        upper.hit_count, upper.last_access, upper.priority = node.hit_count, node.last_access, node.priority
        upper.load_handle = node.load_handle
        if self._observe:
            self.policy.on_split(upper, node)
        node.key = node.key[cut:]
        node.page_keys = node.page_keys[pages:]
        node.device = None if node.device is None else node.device[pages:].copy()
        node.host = None if node.host is None else node.host[pages:].copy()
        node.parent = upper
        parent.children[upper.key[: self.stride]] = upper
        upper.children[node.key[: self.stride]] = node
        return upper

    def _walk(self, root: TreeNode, tokens: bytes) -> Iterator[TreeNode]:
        """Yield the nodes fully matching a prefix of ``tokens``, splitting a partial match."""
        node, pos, end, stride = root, 0, len(tokens) - len(tokens) % self.stride, self.stride
        while pos < end:
            child = node.children.get(tokens[pos : pos + stride])
            if child is None:
                return
            klen = len(child.key)
            if tokens[pos : pos + klen] != child.key:
                child = self._split(child, self._diverge_page(child.key, tokens, pos))
                klen = len(child.key)
            yield child
            node, pos = child, pos + klen

    def match(self, ns: bytes, tokens: bytes, touch: bool = True) -> TreeMatch:
        """Longest cached prefix of ``tokens``: the L1 run from the root, then how far L2 continues it.

        ``touch`` updates recency and hit counts on the matched path (a lookup that only peeks passes
        False). The result's arrays are fresh copies the caller may keep.
        """
        root = self.roots.get(ns)
        if root is None:
            return TreeMatch(None, None, EMPTY, EMPTY, [], [])
        dev: list[np.ndarray] = []
        host: list[np.ndarray] = []
        host_nodes: list[TreeNode] = []
        pending: list[Any] = []
        last = l1 = None
        now = next(self._clock) if touch else 0
        for node in self._walk(root, tokens):
            if node.device is not None and not host_nodes:
                dev.append(node.device)
                l1 = node
                if node.load_handle is not None:
                    if node.load_handle.done():
                        node.load_handle = None
                    else:
                        pending.append(node.load_handle)
            elif node.host is not None:
                host.append(node.host)
                host_nodes.append(node)
            else:
                break
            last = node
            if touch:
                node.last_access = now
                node.hit_count += 1
                if self._observe:
                    self.policy.on_match(node, now)
        return TreeMatch(
            last,
            l1,
            np.concatenate(dev) if dev else EMPTY,
            np.concatenate(host) if host else EMPTY,
            host_nodes,
            pending,
        )

    # ------------------------------------------------------------------ insert
    def insert(
        self,
        ns: bytes,
        tokens: bytes,
        page_keys: list[bytes],
        device: np.ndarray | None = None,
        host: np.ndarray | None = None,
        start_page: int = 0,
    ) -> InsertResult | None:
        """Insert the full pages of ``tokens`` with their L1 (``device``) *or* L2 (``host``) indices.

        The indices cover pages ``start_page..``; pages before ``start_page`` must already be in the
        tree (on any tier) and are only touched; if they are not, nothing is inserted and None is
        returned. Pages the tree already holds on that tier are kept; ``reused[i]`` is True for those
        (and for every page before ``start_page``), and the caller still owns (and must free) its own
        page ``i``. An L1 insert over an L2-only node gives the node the caller's L1 page (the node is
        upgraded, which keeps L1 prefix-closed because the walk goes root-first). An L2 insert only
        adds L2 pages to nodes that lack them and never creates L1 state.
        """
        if (device is None) == (host is None):
            raise ValueError("insert: give exactly one of device or host indices")
        idx = np.asarray(device if device is not None else host, dtype=np.int64)
        n_pages = len(tokens) // self.stride
        if len(idx) != n_pages - start_page or len(page_keys) != n_pages or start_page < 0:
            raise ValueError(f"insert: {n_pages} pages of tokens from page {start_page} but {len(idx)} indices "
                             f"and {len(page_keys)} keys")
        on_device = device is not None
        if on_device and start_page:
            raise ValueError("insert: L1 inserts start at page 0")
        root = self._root(ns, create=True)
        assert root is not None
        reused = np.zeros(n_pages, dtype=bool)
        reused[:start_page] = True
        now = next(self._clock)
        node, page, new_pages = root, 0, 0
        for node in self._walk(root, tokens[: n_pages * self.stride]):
            n = node.n_pages
            if page < start_page < page + n:
                self._split(node, start_page - page)  # node keeps the part from start_page on
                page = start_page
                n = node.n_pages
            if page >= start_page:
                attr = node.device if on_device else node.host
                if attr is None:
                    self._set_tier(node, on_device, idx[page - start_page : page - start_page + n].copy())
                    new_pages += n
                else:
                    reused[page : page + n] = True
            node.last_access = now
            node.hit_count += 1
            if self._observe:
                self.policy.on_insert(node, now, False)
            page += n
        if page < start_page:
            if root.parent is None and not root.children:
                del self.roots[ns]
            return None
        if page < n_pages:
            leaf = TreeNode(node, tokens[page * self.stride : n_pages * self.stride], page_keys[page:])
            leaf.last_access, leaf.hit_count = now, 1
            self._set_tier(leaf, on_device, idx[page - start_page :].copy())
            node.children[leaf.key[: self.stride]] = leaf
            if self._observe:
                self.policy.on_insert(leaf, now, True)
            new_pages += n_pages - page
            node = leaf
        return InsertResult(node, reused, new_pages)

    # ------------------------------------------------------------------ tiers and events
    def event(self, kind: str, node: TreeNode) -> TreeEvent:
        """The :class:`TreeEvent` describing ``node`` now (``node`` must still hang from its root)."""
        root = node
        while root.parent is not None:
            root = root.parent
        ns = next((k for k, r in self.roots.items() if r is root), b"")
        parent = node.parent
        parent_key = parent.page_keys[-1] if parent is not None and parent.page_keys else b""
        return TreeEvent(kind, ns, parent_key, tuple(node.page_keys), node.key, node.device is not None,
                         node.host is not None)

    def _emit(self, kind: str, node: TreeNode) -> None:
        if self.listeners:
            ev = self.event(kind, node)
            for fn in self.listeners:
                fn(ev)

    def _set_tier(self, node: TreeNode, on_device: bool, idx: np.ndarray) -> None:
        known = node.device is not None or node.host is not None
        if on_device:
            node.device = idx
            self.device_pages += len(idx)
            if node.lock_ref > 0:
                self.locked_device_pages += len(idx)
        else:
            node.host = idx
            self.host_pages += len(idx)
        self._emit("tier" if known else "stored", node)

    def set_host(self, node: TreeNode, host: np.ndarray) -> None:
        """Record an L2 backup of an L1 node (write-through / write-back)."""
        if node.host is not None or len(host) != node.n_pages:
            raise ValueError("set_host: node already backed up, or wrong number of pages")
        self._set_tier(node, False, np.asarray(host, dtype=np.int64))

    def set_device(self, node: TreeNode, device: np.ndarray, load_handle: Any = None) -> None:
        """Record L1 pages loaded back for an L2-only node whose parent is on L1."""
        parent = node.parent
        if node.device is not None or len(device) != node.n_pages:
            raise ValueError("set_device: node already on L1, or wrong number of pages")
        if parent is not None and parent.parent is not None and parent.device is None:
            raise ValueError("set_device: parent is not on L1 (load the path root-first)")
        self._set_tier(node, True, np.asarray(device, dtype=np.int64))
        node.load_handle = load_handle

    def drop_host(self, node: TreeNode) -> np.ndarray:
        """Forget the L2 copy of an L1 node (e.g. an L2 page found damaged); returns its L2 pages."""
        if node.host is None or node.device is None or node.host_pin:
            raise ValueError("drop_host: node must be on L1 and L2 and not pinned")
        host, node.host = node.host, None
        self.host_pages -= node.n_pages
        self._emit("tier", node)
        return host

    # ------------------------------------------------------------------ locks
    def lock(self, node: TreeNode | None) -> None:
        """Protect ``node`` and its ancestors from L1 eviction (they must be on L1)."""
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                if node.device is None:
                    raise ValueError("lock: node is not on L1")
                self.locked_device_pages += node.n_pages
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode | None) -> None:
        """Undo one :meth:`lock` of ``node`` (the whole path); ``ValueError`` when it is not locked."""
        while node is not None and node.parent is not None:
            if node.lock_ref <= 0:
                raise ValueError("unlock: node is not locked (double release?)")
            node.lock_ref -= 1
            if node.lock_ref == 0 and node.device is not None:
                self.locked_device_pages -= node.n_pages
            node = node.parent

    def pin_host(self, node: TreeNode | None) -> None:
        """Protect the L2 pages of ``node`` and its ancestors from L2 eviction (while they load or are
        written to L3). Like ``lock`` it covers the whole path, so a later split keeps both halves pinned."""
        while node is not None and node.parent is not None:
            node.host_pin += 1
            node = node.parent

    def unpin_host(self, node: TreeNode | None) -> None:
        """Undo one :meth:`pin_host` of ``node`` (the whole path); ``ValueError`` when it is not pinned."""
        while node is not None and node.parent is not None:
            if node.host_pin <= 0:
                raise ValueError("unpin_host: node is not pinned")
            node.host_pin -= 1
            node = node.parent

    # ------------------------------------------------------------------ walks
    def nodes(self, ns: bytes | None = None) -> Iterator[TreeNode]:
        """Every non-root node of every namespace (or of namespace digest ``ns`` only), each after its parent."""
        if ns is None:
            stack = list(self.roots.values())
        else:
            root = self.roots.get(ns)
            stack = [] if root is None else [root]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def namespace_pages(self, ns: bytes) -> tuple[int, int]:
        """Pages (L1, L2) the tree holds under namespace digest ``ns``."""
        l1 = l2 = 0
        for node in self.nodes(ns):
            l1 += node.n_pages if node.device is not None else 0
            l2 += node.n_pages if node.host is not None else 0
        return l1, l2

    # ------------------------------------------------------------------ integrity
    def check_invariants(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        dev = host = locked = 0
        for node in self.nodes():
            assert node.parent is not None
            assert node.device is not None or node.host is not None, f"{node} on no tier"
            assert len(node.key) == node.n_pages * self.stride and node.n_pages > 0
            assert node.parent.children.get(node.key[: self.stride]) is node
            if node.device is not None:
                assert len(node.device) == node.n_pages
                dev += node.n_pages
                p = node.parent
                assert p.parent is None or p.device is not None, "L1 not prefix-closed"
                if node.lock_ref:
                    locked += node.n_pages
            else:
                assert node.lock_ref == 0, "locked node off L1"
            if node.host is not None:
                assert len(node.host) == node.n_pages
                host += node.n_pages
            if node.parent.parent is not None:
                assert node.parent.lock_ref >= node.lock_ref, "lock does not cover the path"
                assert node.parent.host_pin >= node.host_pin, "pin does not cover the path"
        assert dev == self.device_pages, (dev, self.device_pages)
        assert host == self.host_pages, (host, self.host_pages)
        assert locked == self.locked_device_pages, (locked, self.locked_device_pages)

    def all_device_pages(self) -> np.ndarray:
        """The L1 page indices the tree holds, concatenated (int64, in no particular order)."""
        arrs = [n.device for n in self.nodes() if n.device is not None]
        return np.concatenate(arrs) if arrs else EMPTY

    def all_host_pages(self) -> np.ndarray:
        """The L2 page indices the tree holds, concatenated (int64, in no particular order)."""
        arrs = [n.host for n in self.nodes() if n.host is not None]
        return np.concatenate(arrs) if arrs else EMPTY
