"""A RadixTree driven request by request as the cache drives it, for the eviction-policy tests.

A plain module (not a conftest) so every test file imports the same one.
"""

from __future__ import annotations

import numpy as np

from hicache.radix import RadixTree, TreeNode

NS = b"ns"


def tb(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def keys(tokens: list[int], page: int) -> list[bytes]:
    """The page keys of ``tokens``: each full page named by its whole prefix."""
    return [tb(tokens[: (i + 1) * page]) for i in range(len(tokens) // page)]


def content(tag: int, pages: int, page: int) -> list[int]:
    """``pages`` pages of tokens unique to ``tag``."""
    return [tag * 1000 + i for i in range(pages * page)]


class TreeCache:
    """A tree of ``capacity`` L1 pages (and an unbounded L2 when ``backup``) served request by request as
    the cache does: match and lock the hit prefix, evict what the new pages need, insert, unlock."""

    def __init__(self, policy: str, capacity: int, page: int, backup: bool = False) -> None:
        self.page = page
        self.tree = RadixTree(page, policy)
        self.free = list(range(capacity))
        self.backup = backup
        self.host_ids = iter(range(10**9))
        self.evicted: list[int] = []  # L1 page indices freed, in order

    def _backup(self, node: TreeNode) -> bool:
        if self.backup:
            self.tree.set_host(node, np.asarray([next(self.host_ids) for _ in range(node.n_pages)]))
        return self.backup

    def serve(self, tokens: list[int]) -> int:
        """Pages of ``tokens`` hit on L1. Without L2, no page inserted past the hit was in the tree."""
        b = tb(tokens)
        m = self.tree.match(NS, b)
        hit = m.l1_pages
        self.tree.lock(m.l1_node)
        try:
            need = len(tokens) // self.page - hit
            if need > len(self.free):
                for arr in self.tree.evict_device(need - len(self.free), self._backup):
                    self.evicted.extend(int(x) for x in arr)
                    self.free.extend(int(x) for x in arr)
            if need > len(self.free):  # everything else is locked: cache nothing new
                return hit
            new = [self.free.pop() for _ in range(need)]
            dev = np.concatenate([m.device_indices, np.asarray(new, dtype=np.int64)])
            if need:
                res = self.tree.insert(NS, b, keys(tokens, self.page), device=dev)
                if not self.backup:
                    assert res is not None and not res.reused[hit:].any()
        finally:
            self.tree.unlock(m.l1_node)
        self.tree.check_invariants()
        return hit

    def cached(self, tokens: list[int]) -> int:
        return self.tree.match(NS, tb(tokens), touch=False).l1_pages
