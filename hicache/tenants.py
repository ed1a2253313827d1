"""Tenant shares (``cache.tenant_shares``): the pages of a tier beyond which a tenant's pages are evicted first.

Contract:

* The tree knows namespace digests only; :class:`TenantShares` remembers whose namespace each digest is
  (:meth:`TenantShares.note`, before the namespace may gain pages), for tenants a share applies to (named, or
  ``"*"``). A namespace with pages in the tree is never forgotten, so its tenant's share applies to them as
  long as they stay; of the others, at most about :data:`TENANT_MEMORY` are remembered.
* A share is a fraction of each tier's capacity, taken as the decimal the config wrote; :meth:`TenantShares.caps`
  turns it into pages per namespace for the eviction of one tier (``cache.tenant_shares`` is the eviction
  policy's to honour: :meth:`hicache.radix.RadixTree.evict_device` / ``evict_host``).
* Every method is called under the tree lock; nothing here takes a lock of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction

from hicache.keys import Namespace
from hicache.radix import RadixTree, TreeNode

TENANT_MEMORY = 1 << 16  # namespaces without pages whose tenant is remembered


class TenantShares:
    """The shares of one cache and the tenant of each namespace they apply to."""

    def __init__(self, shares: Mapping[str, float]) -> None:
        self.shares = dict(shares)  # tenant ("*": any other) -> its fraction of each tier
        self.tenant_of: dict[bytes, str] = {}  # namespace digest -> tenant, most recently noted last
        self._share_pages: dict[int, dict[str, int]] = {}  # tier capacity -> tenant -> its cap in pages

    def note(self, ns: Namespace, roots: Mapping[bytes, TreeNode]) -> None:
        """Before ``ns`` may gain pages (a match, a commit, a prefetch landing): remember its tenant when a
        share applies to it, most recent last. ``roots``: the tree's namespaces with pages. Once more than
        :data:`TENANT_MEMORY` namespaces without pages are remembered, the oldest are forgotten, down to half
        of it."""
        shares = self.shares
        if not shares or (ns.tenant not in shares and "*" not in shares):
            return
        known = self.tenant_of
        known.pop(ns.digest, None)
        known[ns.digest] = ns.tenant
        if len(known) > TENANT_MEMORY + len(roots):
            idle = [d for d in known if d not in roots and d != ns.digest]
            for d in idle[: len(idle) - TENANT_MEMORY // 2]:
                del known[d]

    def caps(self, capacity: int, roots: Mapping[bytes, TreeNode]) -> dict[bytes, int] | None:
        """Per namespace of ``roots``, the pages of a tier of ``capacity`` pages beyond which its tenant's
        pages are evicted first; None without shares. 0.29 of 100 pages is 29, where ``0.29 * 100`` is
        28.999...: the share is read as a decimal."""
        if not self.shares:
            return None
        per_tenant = self._share_pages.get(capacity)
        if per_tenant is None:
            per_tenant = self._share_pages[capacity] = {
                t: int(Fraction(repr(float(s))) * capacity) for t, s in self.shares.items()}
        caps = {}
        default = per_tenant.get("*")
        for digest in roots:
            tenant = self.tenant_of.get(digest)
            cap = None if tenant is None else per_tenant.get(tenant, default)
            if cap is not None:
                caps[digest] = cap
        return caps

    def pages(self, tree: RadixTree) -> dict[str, tuple[int, int]]:
        """Pages (L1, L2) each tenant named in the shares holds in ``tree`` now (``"*"`` is no tenant)."""
        out = dict.fromkeys((t for t in self.shares if t != "*"), (0, 0))
        for digest in tree.roots:
            tenant = self.tenant_of.get(digest)
            if tenant in out:
                l1, l2 = tree.namespace_pages(digest)
                out[tenant] = (out[tenant][0] + l1, out[tenant][1] + l2)
        return out
