"""The node-level half of :class:`hicache.cache.HiCache`'s surface: pins, eviction and clearing, flush,
integrity checks, tree events, stats, tenant usage and close, and the helpers both halves share.

Contract:

* :class:`CacheAdmin` is HiCache's base: it holds no state of its own and adds no constructor; it reads what
  :meth:`HiCache.__init__ <hicache.cache.HiCache>` builds (the attributes declared below) and is never used
  alone. The request lifecycle (match to release) stays in :mod:`hicache.cache`.
* Each method takes the tree lock for its whole bookkeeping, as the request methods do; ``flush`` and ``close``
  wait for the L3 writeback outside it.
* The private attributes ``_tenant_of``, ``_backups``, ``_l3_writing`` and ``_prefetch_inflight_bytes`` read
  the components' state where audits and tests look for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, Self

import numpy as np

from hicache.accounting import Accounting
from hicache.cache_types import PinInfo, Request
from hicache.config import HiCacheConfig
from hicache.keys import Namespace, tokens_to_bytes
from hicache.l3_prefetch import L3Prefetch
from hicache.layout import KVLayout
from hicache.pins import Pins
from hicache.pool import DevicePool, HostPool
from hicache.radix import RadixTree, TreeEvent, TreeNode
from hicache.storage.base import StorageBackend
from hicache.storage.prefetch import Prefetcher
from hicache.storage.writeback import FlushReport, Writeback
from hicache.tenants import TenantShares
from hicache.tiers import Tiers
from hicache.transfer import TransferEngine, TransferHandle


class CacheAdmin:
    """Pins, maintenance, events and stats of a :class:`hicache.cache.HiCache` (its base class)."""

    config: HiCacheConfig
    layout: KVLayout
    page_size: int
    ns: Namespace
    device_pool: DevicePool
    host_pool: HostPool
    transfer: TransferEngine
    has_l2: bool
    tree: RadixTree
    storage: StorageBackend | None
    prefetcher: Prefetcher | None
    writeback: Writeback | None
    _lock: threading.RLock
    _tenants: TenantShares
    _tiers: Tiers
    _accounting: Accounting
    _pins: Pins
    _prefetch: L3Prefetch

    def _check_ns(self, ns: Namespace) -> None:
        if ns.layout != self.layout:
            raise ValueError(f"namespace layout {ns.layout.describe()} does not match the pool's "
                             f"{self.layout.describe()}")

    def _full_pages(self, tokens: Sequence[int] | np.ndarray) -> bytes:
        """The tokens of the full pages of ``tokens``, uint32 LE (a trailing partial page is never cached)."""
        tb = tokens_to_bytes(tokens)
        return tb[: len(tb) - len(tb) % (self.page_size * 4)]

    def _note_tenant(self, ns: Namespace) -> None:
        self._tenants.note(ns, self.tree.roots)

    def _caps(self, capacity: int) -> dict[bytes, int] | None:
        """Per namespace in the tree, its tenant's cap on a tier of ``capacity`` pages (:meth:`TenantShares.caps`)."""
        return self._tenants.caps(capacity, self.tree.roots)

    @property
    def _tenant_of(self) -> dict[bytes, str]:
        return self._tenants.tenant_of

    @property
    def _backups(self) -> list[tuple[TransferHandle, TreeNode, list[bytes], np.ndarray]]:
        return self._tiers.backups

    @property
    def _l3_writing(self) -> int:
        return self._tiers.l3_writing

    @property
    def _prefetch_inflight_bytes(self) -> int:
        return self._prefetch.inflight_bytes

    def tenant_pages(self) -> dict[str, tuple[int, int]]:
        """Pages (L1, L2) each tenant named in ``cache.tenant_shares`` holds now (``"*"`` is no tenant)."""
        with self._lock:
            return self._tenants.pages(self.tree)

    def _refresh_metrics(self) -> None:
        """At a scrape: gauges and L3 counters as they are now (the tree lock guards the bookkeeping)."""
        with self._lock:
            self._update_gauges()
        if self._tenants.shares:
            self._accounting.export_tenants(self.tenant_pages(), self._tenants.shares)

    def _update_gauges(self) -> None:
        self._accounting.update_gauges(self._pins.pinned, self._prefetch.inflight_bytes)

    # ------------------------------------------------------------------ pins
    def pin(self, tokens: Sequence[int] | np.ndarray, ns: Namespace | None = None) -> PinInfo:
        """Keep the cached prefix of ``tokens`` where it is until :meth:`unpin`: its L1 pages are never
        evicted from L1, nor the L2 run continuing them from L2 (a system prompt, a few-shot block, the
        documents every query reads).

        Pins what is cached now, as :meth:`match` finds it (an L3 run is not fetched: match, prefetch and
        load it first). The pages stay in the tree as any other: requests hit them and pins do not change
        what they compute. Pins are not kept across restarts.

        ``ValueError`` when no page of the prefix is cached; :class:`CacheFullError` when the pages pins
        hold would pass ``cache.max_pinned_fraction`` of L1 or L2 (overlapping pins count each time).
        """
        ns = ns or self.ns
        self._check_ns(ns)
        tb = self._full_pages(tokens)
        with self._lock:
            self._tiers.reap()
            self._note_tenant(ns)
            info = self._pins.pin(self.tree.match(ns.digest, tb), ns)
            self._update_gauges()
            return info

    def unpin(self, pin_id: int) -> PinInfo:
        """Let the pages of pin ``pin_id`` be evicted again (by the eviction policy, in its own time);
        ``KeyError`` for an unknown id."""
        with self._lock:
            info = self._pins.unpin(pin_id)
            self._update_gauges()
            return info

    def pins(self) -> list[PinInfo]:
        """The pins held now, oldest first."""
        with self._lock:
            return self._pins.infos()

    # ------------------------------------------------------------------ maintenance
    def evict(self, l1_pages: int = 0, l2_pages: int = 0) -> tuple[int, int]:
        """Evict explicitly (tests, admin); returns pages freed per tier."""
        with self._lock:
            self._tiers.reap(wait=True)
            a = self._tiers.evict_device(l1_pages) if l1_pages else 0
            b = self._tiers.evict_host(l2_pages) if l2_pages else 0
            self._update_gauges()
            return a, b

    def clear(self, namespaces: Collection[Namespace] | None = None) -> tuple[int, int]:
        """Drop every L1 and L2 page that no request holds, no pin keeps and no copy in flight uses (of the
        ``namespaces`` alone, when given: a tenant's pages); returns the pages freed on (L1, L2). The store
        (L3) is not touched. No backup is started, whatever the write policy; backups already in flight are
        finished first (and queued for L3), and so are L2 -> L1 loads still writing pages it drops (a request
        released before its load landed). For a cold start between benchmark runs, or after a mistake such as
        serving different weights under the same model revision (fix the revision: L3 still has pages under
        those keys)."""
        with self._lock:
            freed = self._tiers.clear(None if namespaces is None else {ns.digest for ns in namespaces})
            self._update_gauges()
            return freed

    def flush(self, timeout_s: float | None = None) -> FlushReport | None:
        """Wait for in-flight backups and L3 writebacks; report what could not be written."""
        with self._lock:
            self._tiers.reap(wait=True)
        return self.writeback.flush(timeout_s) if self.writeback is not None else None

    def check_integrity(self, requests: Sequence[Request] = ()) -> None:
        """free + cached + in flight == capacity on both pools, and the tree's invariants hold.

        ``requests``: live requests, whose owned pages count as in flight.
        """
        with self._lock:
            self._tiers.check_integrity(requests)

    # ------------------------------------------------------------------ events
    def add_listener(self, fn: Callable[[TreeEvent], None]) -> None:
        """Call ``fn(event)`` for every run of pages stored in, removed from or changing tier in the tree.

        ``fn`` runs under the tree lock, in order, on whichever thread changed the tree: it must be quick
        and must not call back into the cache.
        """
        with self._lock:
            self.tree.listeners.append(fn)

    def remove_listener(self, fn: Callable[[TreeEvent], None]) -> None:
        """Stop calling ``fn`` (from :meth:`add_listener`); ``ValueError`` when it is not registered."""
        with self._lock:
            self.tree.listeners.remove(fn)

    def snapshot(self, at: Callable[[], None] | None = None) -> list[TreeEvent]:
        """Every run in the tree as a "stored" event, parents before children; ``at()`` runs under the
        same lock hold, so a listener can note where in its event stream the snapshot stands."""
        with self._lock:
            if at is not None:
                at()
            return [self.tree.event("stored", n) for n in self.tree.nodes()]

    def stats(self) -> dict[str, Any]:
        """Pool, tree and pin figures taken under the tree lock: page counts per tier (total, used, cached;
        locked on L1), ``writeback_queue_pages``, pins, and ``storage`` (the store's counters, or None).
        Finished L1 -> L2 backups are folded in first, so pages a backup no longer uses do not count as
        locked."""
        with self._lock:
            self._tiers.reap()
            return {
                "l1_pages_total": self.device_pool.num_pages,
                "l1_pages_used": self.device_pool.allocator.used_pages,
                "l1_pages_cached": self.tree.device_pages,
                "l2_pages_total": self.config.l2_pages,
                "l2_pages_used": self.host_pool.allocator.used_pages if self.has_l2 else 0,
                "l2_pages_cached": self.tree.host_pages,
                "l1_pages_locked": self.tree.locked_device_pages,
                "writeback_queue_pages": self.writeback.queued_pages if self.writeback else 0,
                "pins": len(self._pins),
                "pinned_l1_pages": self._pins.pinned[0],
                "pinned_l2_pages": self._pins.pinned[1],
                "storage": self.storage.stats() if self.storage else None,
            }

    def close(self) -> FlushReport | None:
        """Flush (the L3 queue for up to ``serve.shutdown_grace_s``), stop the background workers, close the
        store and release the L2 buffer; the cache is unusable afterwards. Returns the final report (pages
        still queued when the grace ran out count as pending; None without L3 writeback). The grace is the
        whole wait: what is left then is abandoned, not flushed again."""
        report = self.flush(timeout_s=self.config.serve.shutdown_grace_s)
        if self.writeback is not None:
            report = self.writeback.close(timeout_s=0.0)
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.transfer.close()
        if self.storage is not None:
            self.storage.close()
        self.host_pool.release()
        return report

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
