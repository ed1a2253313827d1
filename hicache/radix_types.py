"""The radix tree's data types: :class:`TreeNode`, and what the tree's operations return or tell listeners.

A :class:`TreeNode` is a run of whole pages: tokens, one chained page key per page, its L1 (``device``)
and/or L2 (``host``) page indices (int64 arrays of ``n_pages`` entries, or None), its locks and pins, and
the usage eviction policies order by. The invariants the tree keeps over its nodes are
:mod:`hicache.radix`'s. :class:`TreeMatch` is what :meth:`~hicache.radix.RadixTree.match` found,
:class:`InsertResult` what :meth:`~hicache.radix.RadixTree.insert` did, and a :class:`TreeEvent` what a
listener is told of a run that changed tiers.

This module imports neither the tree nor the eviction policies: what needs only the types (the event hub,
the request state) does not load them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

EMPTY = np.empty(0, dtype=np.int64)


class TreeNode:
    """A run of whole pages under its parent: tokens, page keys, L1 and/or L2 page indices, the locks and
    pins that keep it from eviction, and the usage eviction policies order by (``last_access``,
    ``hit_count``, ``priority``). Roots hold no pages and are always locked."""

    __slots__ = (
        "children",
        "device",
        "hit_count",
        "host",
        "host_pin",
        "key",
        "last_access",
        "load_handle",
        "lock_ref",
        "meta",
        "page_keys",
        "parent",
        "priority",
    )

    def __init__(self, parent: TreeNode | None, key: bytes, page_keys: list[bytes]) -> None:
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.key = key  # tokens of this node's pages, uint32 LE
        self.page_keys = page_keys  # one chained key per page
        self.device: np.ndarray | None = None  # L1 page indices (int64), or None
        self.host: np.ndarray | None = None  # L2 page indices (int64), or None
        self.lock_ref = 0  # device locks: protects L1 pages of this node and its ancestors
        self.host_pin = 0  # host pins: protects L2 pages from L2 eviction
        self.hit_count = 0
        self.last_access = 0
        self.priority = 0
        self.load_handle: Any = None  # pending L2->L1 load writing this node's device pages
        self.meta: Any = None  # owned by a stateful eviction policy (hicache.eviction.EvictionPolicy)

    @property
    def n_pages(self) -> int:
        """Pages in this node's run (0 for a root)."""
        return len(self.page_keys)

    def __repr__(self) -> str:
        return (
            f"TreeNode(pages={self.n_pages}, l1={self.device is not None}, l2={self.host is not None}, "
            f"lock={self.lock_ref}, pin={self.host_pin}, hits={self.hit_count})"
        )


class TreeMatch(NamedTuple):
    """What :meth:`RadixTree.match` found: the L1 run from the root, then the L2 run continuing it."""

    node: TreeNode | None  # deepest matched node (L1 or L2); None when nothing matched
    l1_node: TreeNode | None  # deepest node of the L1 run; None when L1 matched nothing
    device_indices: np.ndarray  # L1 page indices of the matched L1 prefix, in order
    host_indices: np.ndarray  # L2 page indices of the pages continuing it on L2, in order
    host_nodes: list[TreeNode]  # nodes of that L2 continuation, root side first
    pending: list[Any]  # load handles to wait on before reading the L1 pages

    @property
    def l1_pages(self) -> int:
        """Pages of the matched L1 prefix."""
        return len(self.device_indices)

    @property
    def l2_pages(self) -> int:
        """Pages continuing the L1 prefix on L2."""
        return len(self.host_indices)


class TreeEvent(NamedTuple):
    """What a listener (``RadixTree.listeners``) is told when a run of pages changes tiers.

    Emitted under the caller's tree lock, in order; listeners must be quick and must not call back
    into the tree.
    """

    kind: str  # "stored" (entered the tree) | "tier" (gained or lost a tier) | "removed" (left the tree)
    ns: bytes  # namespace digest of the run's root
    parent_key: bytes  # page key just before the run (b"" when the run starts at the root)
    page_keys: tuple[bytes, ...]  # one key per page of the run
    tokens: bytes  # the run's tokens, uint32 LE
    on_device: bool  # on L1 after the change
    on_host: bool  # on L2 after the change


class InsertResult(NamedTuple):
    """What :meth:`RadixTree.insert` did, per page of the inserted tokens."""

    node: TreeNode  # node ending at the last inserted page
    reused: np.ndarray  # bool per page: True where the tree already held the page on that tier
    new_pages: int  # pages now held on that tier that were not before

