"""Helpers of the ``cache.tenant_shares`` tests: a small cache with shares, prompts, one request as an
engine runs it, and what a tenant's namespace holds."""

from __future__ import annotations

from typing import Any

from hicache.cache import HiCache
from kvhelpers import small_config, write_kv

PS = 4  # tokens per page (small_config)
L1_PAGES = 16


def make(shares: dict[str, float] | None, l1: int = L1_PAGES, l2: int = 0, storage: str = "",
         model: dict[str, Any] | None = None, **cache: Any) -> HiCache:
    sections: dict[str, dict[str, Any]] = {
        "cache": {"l1_tokens": l1 * PS, "l2_tokens": l2 * PS, "eviction_policy": "lru",
                  "tenant_shares": shares or {}, **cache}}
    if storage:
        sections["storage"] = {"url": storage}
    if model:
        sections["model"] = model
    return HiCache(small_config(**sections))


def prompt(tag: int, pages: int) -> list[int]:
    return [tag * 1000 + i for i in range(pages * PS)]


def compute(cache: HiCache, tokens: list[int], ns: Any, seed: int) -> list[Any]:
    """Serve a prompt the cache does not hold: allocate, write its KV, commit, release."""
    req = cache.match(tokens, ns)
    assert req.hit_pages == 0
    pages = cache.alloc(req, len(tokens) // PS)
    kv = write_kv(cache, pages, seed)
    cache.commit(req, tokens, pages)
    cache.release(req)
    return kv


def hits(cache: HiCache, tokens: list[int], ns: Any) -> tuple[int, int]:
    """(L1, L2) pages of the prefix found; releases the lookup."""
    req = cache.match(tokens, ns, l3=False)
    try:
        return req.l1_pages, req.l2_pages
    finally:
        cache.release(req)


def held(cache: HiCache, ns: Any) -> tuple[int, int]:
    """(L1, L2) pages the tree holds under ``ns``, counted node by node."""
    root = cache.tree.roots.get(ns.digest)
    l1 = l2 = 0
    stack = list(root.children.values()) if root is not None else []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        l1 += node.n_pages if node.device is not None else 0
        l2 += node.n_pages if node.host is not None else 0
    return l1, l2
