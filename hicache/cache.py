"""The cache orchestrator: a request's life over one radix tree of L1 / L2 / L3.

A request's life (README, "Using the library")::

    req = cache.match(tokens)          # hit lengths per tier; locks the L1 prefix, pins the L2 run
    cache.prefetch(req)                # optional: start L3 -> L2 for the L3 run (if worth it)
    load = cache.load_back(req)        # L2 (+ prefetched L3) -> L1, layer by layer; load.wait_layer(i)
    pages = cache.alloc(req, n)        # L1 pages for the new tokens (evicts under pressure)
    cache.commit(req, tokens, pages)   # insert; back up per write policy; L2 -> L3 in background
    cache.release(req)                 # unlock / unpin; frees anything the request still owns

This module holds that lifecycle and the cache's construction. The rest is composed, each a small class
the cache holds and drives under its tree lock: page moves between tiers (:mod:`hicache.tiers`), the cache's
side of L3 prefetch (:mod:`hicache.l3_prefetch`), tenant shares (:mod:`hicache.tenants`), gauges and hit
accounting (:mod:`hicache.accounting`) and pins (:mod:`hicache.pins`). The node-level surface (pins, evict,
clear, flush, stats, events, close) is the base class :class:`hicache.cache_admin.CacheAdmin`.

Threading model:

* Every public method may be called from any thread; the tree, both allocators' bookkeeping and every
  request's state are protected by one re-entrant lock, ``self._lock`` (the *tree lock*), which the
  components share. Calls hold it for bookkeeping, never across an L3 round trip; some also wait under it
  for L1 -> L2 copies already in flight (``evict``, ``clear``, ``flush``, an allocation under pressure, a
  ``write_back`` eviction), for an L2 -> L1 load still writing pages an L1 eviction frees (its request was
  released before the load landed) and, with ``writeback_when_full: block``, for room in the L3 writeback
  queue.
* Background work: the transfer engine's worker/streams copy pages; the prefetcher's threads read L3
  into host pages a :class:`PrefetchTask` owns; one writeback thread writes L2 pages (pinned in the tree
  until written) to L3. Their completions are folded in under the tree lock (:meth:`hicache.tiers.Tiers.reap`).
* A :class:`Request` is used by one caller at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from hicache.accounting import Accounting
from hicache.cache_admin import CacheAdmin
from hicache.cache_types import CacheFullError, CommitResult, LoadResult, MultiHandle, PinInfo, Request
from hicache.config import HiCacheConfig
from hicache.keys import Namespace, page_keys_from_bytes
from hicache.l3_prefetch import L3Prefetch
from hicache.metrics import Metrics
from hicache.pins import Pins
from hicache.pool import DevicePool
from hicache.radix import EMPTY, RadixTree, TreeNode
from hicache.storage.base import StorageBackend, StorageContext, create_backend
from hicache.storage.prefetch import Prefetcher
from hicache.storage.writeback import Writeback
from hicache.tenants import TenantShares
from hicache.tiers import SELECTIVE_THRESHOLD, Tiers, make_pools

__all__ = ["CacheFullError", "CommitResult", "HiCache", "LoadResult", "PinInfo", "Request"]


class HiCache(CacheAdmin):
    """Three-tier KV cache for one model shard (one KV layout, any number of tenants)."""

    def __init__(self, config: HiCacheConfig, storage: StorageBackend | None = None,
                 metrics: Metrics | None = None, device_pool: DevicePool | None = None) -> None:
        """``storage`` overrides ``config.storage.url``; ``device_pool`` lets a caller supply an L1 pool
        it allocated itself (e.g. in shared memory or CUDA IPC-exportable), of the config's layout."""
        self.config = config
        self.layout = config.layout.to_layout()
        self.page_size = self.layout.page_size
        self.ns = config.namespace()
        c, s = config.cache, config.storage
        self.device_pool, self.host_pool, self.transfer = make_pools(config, device_pool)
        self.has_l2 = config.l2_pages > 0
        self.tree = RadixTree(self.page_size, c.eviction_policy)
        self.metrics = metrics or Metrics()
        self.write_policy = c.write_policy
        self._lock = threading.RLock()
        if storage is None and s.url:
            ctx = StorageContext(self.ns.digest, self.layout, self.ns.model, self.ns.tp_rank,
                                 self.ns.tp_size, c.host_layout, s.compression, s.compression_level)
            storage = create_backend(s.url, ctx, **s.options)
        self.storage = storage
        self.prefetcher = Prefetcher() if storage is not None else None
        self.writeback = (Writeback(storage, self.host_pool, s.writeback_queue_pages, s.io_batch_pages,
                                    s.writeback_when_full, observe=self.metrics.storage_op["set"].observe,
                                    on_retry_dropped=self.metrics.writeback_retry_dropped_pages.inc)
                          if storage is not None and self.has_l2 else None)
        self._tenants = TenantShares(c.tenant_shares)
        self._tiers = Tiers(config, self.tree, self.device_pool, self.host_pool, self.transfer, self.writeback,
                            self.metrics, self._tenants, self._lock)
        self._accounting = Accounting(self.metrics, self.page_size, self.device_pool,
                                      self.host_pool if self.has_l2 else None, self.writeback, storage)
        self._pins = Pins(self.tree, self.device_pool.num_pages, config.l2_pages, c.max_pinned_fraction)
        self._prefetch = L3Prefetch(config, storage, self.prefetcher, self.tree, self.host_pool, self._tiers,
                                    self._tenants, self.metrics, self._lock)
        self.metrics.on_collect = self._refresh_metrics
        if storage is not None:
            self.metrics.export_storage_up()
        self.metrics.pool_total.labels("l1").set(self.device_pool.num_pages)
        self.metrics.pool_total.labels("l2").set(config.l2_pages)
        self._update_gauges()

    # ------------------------------------------------------------------ helpers
    def namespace(self, tenant: str | None = None) -> Namespace:
        """The cache's namespace (``tenant`` None), or the same model, revision, layout and TP under ``tenant``."""
        return self.ns if tenant is None else self.ns.with_tenant(tenant)

    def _check_open(self, req: Request) -> None:
        if req.released:
            raise ValueError("request already released")

    def _lookup(self, tokens: Sequence[int] | np.ndarray, ns: Namespace | None, keys: bool,
                l3: bool) -> tuple[Namespace, bytes, list[bytes]]:
        """A match's or peek's inputs: the namespace (checked), the full pages' tokens as bytes, and their
        page keys (only when asked for or when the store will be asked)."""
        ns = ns or self.ns
        self._check_ns(ns)
        tb = self._full_pages(tokens)
        wanted = keys or (l3 and self.storage is not None)
        return ns, tb, page_keys_from_bytes(ns.digest, tb, self.page_size) if wanted else []

    def _ask_store(self, req: Request, l3: bool) -> None:
        """How far the store continues the request's L1 + L2 hit (``req.l3_pages``), when asked."""
        done = req.l1_pages + req.l2_pages
        if l3 and self.storage is not None and done < len(req.keys):
            t_ex = time.perf_counter()
            req.l3_pages = self.storage.batch_exists(req.keys[done:])
            self.metrics.storage_op["exists"].observe(time.perf_counter() - t_ex)

    # ------------------------------------------------------------------ request API
    def match(self, tokens: Sequence[int] | np.ndarray, ns: Namespace | None = None, *,
              l3: bool = True, keys: bool = True, count: bool = True, defer_count: bool = False) -> Request:
        """Longest cached prefix of ``tokens``: pages on L1, continued on L2, continued on L3.

        Locks the L1 prefix and pins the L2 run until :meth:`release`. ``l3=False`` skips the store.
        Only full pages are matched; a trailing partial page is never cached. ``keys=False`` skips
        hashing the page keys when the store is not asked (``Request.keys`` stays empty; :meth:`commit`
        computes them when it needs them) -- the cheap path for lookups that only want hit lengths.
        ``count=False`` leaves the lookup out of the hit-rate and match-latency metrics (a peer writing
        pages in, not a prompt looked up; a peek, :meth:`peek`).

        Counted: the lookup, and the L1 prefix as an L1 hit (it is locked for the request and handed over now);
        with ``defer_count``, only once :meth:`count_match` says the caller got the request (a node's Match that
        also loads, which may still fail; released before that, it counts nothing). The L2 run is counted when
        the request's load back lands it (a hit) or when the request commits its own pages or is released first
        (``hicache_l2_unserved_tokens_total``); the L3 run once its prefetch has been loaded back, or at release
        (:class:`hicache.accounting.L3Tally`).
        """
        t0 = time.perf_counter()
        ns, tb, pkeys = self._lookup(tokens, ns, keys, l3)
        with self._lock:
            self._tiers.reap()
            self._note_tenant(ns)
            m = self.tree.match(ns.digest, tb)
            self.tree.lock(m.l1_node)
            pin = m.host_nodes[-1] if m.host_nodes else None
            self.tree.pin_host(pin)
            if self.write_policy == "write_through_selective":
                self._tiers.back_up_path(m.l1_node, SELECTIVE_THRESHOLD)
            self._update_gauges()
        req = Request(ns, tb, pkeys, m.l1_pages, m.l2_pages, 0, m.device_indices, m.l1_node, pin,
                      list(m.host_nodes), list(m.pending))
        self._ask_store(req, l3)
        if count:
            self._accounting.open_tallies(req)
            req.uncounted = time.perf_counter() - t0
            if not defer_count:
                self.count_match(req)
        return req

    def count_match(self, req: Request) -> None:
        """Count a match made with ``defer_count`` (a no-op for any other): the lookup, its L1 hit, the L3
        pages the store reported, the match's latency."""
        self._accounting.count_match(req)

    def peek(self, tokens: Sequence[int] | np.ndarray, ns: Namespace | None = None, *, l3: bool = True,
             keys: bool = True) -> Request:
        """How much of ``tokens`` is cached now, per tier, without opening a request: :meth:`match` and
        :meth:`release` at once (a router's or scheduler's query). Nothing is served, so none of it is
        counted as a lookup or a hit (nor on L2 or L3): it counts in ``hicache_peeks_total`` only. The
        returned request is released (its hit lengths and keys are for reading).

        Nor is it an access: recency, hit counts and the eviction policy's view of the request stream are
        left as they were (a router asking many times must not make a prefix look hot), and nothing is
        locked or pinned (the walk and the reading happen under one hold of the tree lock)."""
        ns, tb, pkeys = self._lookup(tokens, ns, keys, l3)
        with self._lock:
            self._tiers.reap()
            m = self.tree.match(ns.digest, tb, touch=False)
        req = Request(ns, tb, pkeys, m.l1_pages, m.l2_pages, 0, m.device_indices, released=True)
        self._ask_store(req, l3)
        self.metrics.peeks.inc()
        return req

    def prefetch(self, req: Request) -> int:
        """Start L3 -> L2 for the request's L3 run when it is worth it; returns pages being fetched.

        At most once per request: a second call (the run is in the tree by then, or was given up) starts
        nothing. The run is cut to the request's tokens as they are now (a commit of fewer tokens than
        were matched shortens it)."""
        return self._prefetch.start(req)

    def load_back(self, req: Request, layer_wise: bool = True) -> LoadResult:
        """Bring the L2 run (and whatever L3 prefetch landed, per policy) onto L1.

        Returns the L1 pages of the whole usable prefix and a handle with per-layer readiness; compute
        for layer i may start after ``wait_layer(i)``. ``layer_wise=False`` tells the transfer engine the
        caller will wait for the whole load (``wait()``), so it may take the fastest order instead of
        making early layers ready first (:meth:`hicache.transfer.base.TransferEngine.load`).
        """
        t0 = time.perf_counter()
        self._check_open(req)
        finishing = req.prefetch is not None
        kept = self._prefetch.finish(req)
        if finishing and req.l3 is not None:
            req.l3.kept = kept
        with self._lock:
            # Re-match: the tree may have changed (prefetched pages inserted, other commits).
            m = self.tree.match(req.ns.digest, req.token_bytes, touch=False)
            if len(m.device_indices) < len(req.device_indices):  # cannot happen: our prefix is locked
                raise AssertionError("locked L1 prefix shrank")
            nodes = m.host_nodes
            n = sum(x.n_pages for x in nodes)
            handle = None
            new_lock: TreeNode | None = m.l1_node
            dev_all = m.device_indices
            if n:
                try:
                    dev, handle = self._tiers.load(m.l1_node, nodes, n, layer_wise)
                except CacheFullError:
                    if req.l2 is not None:  # counted no_room unless a later load back lands it
                        req.l2.no_room = True
                    raise
                self.metrics.loadback_tokens.inc(n * self.page_size)
                self.metrics.loadback_bytes.inc(n * self.layout.bytes_per_page)
                new_lock = nodes[-1]
                dev_all = np.concatenate([m.device_indices, dev])
            self.tree.lock(new_lock)
            self.tree.unlock(req.lock_node)
            self.tree.unpin_host(req.pin_node)
            req.pin_node = None
            req.lock_node = new_lock
            req.device_indices = dev_all
            # the prefetched pages in the prefix now: a page evicted since it entered the tree ends it
            l3_done = min(kept, max(0, len(dev_all) - req.prefetch_start))
            # its prefetch has ended (here, or at a load back that failed after it): its L3 run is settled
            if req.prefetched and req.prefetch is None:
                self._accounting.count_l3(req, len(dev_all))
            self._accounting.count_l2(req, len(dev_all))  # on L1 now (or already, loaded by another request)
            self._update_gauges()
        # loads the prefix depends on: those seen at match time, those another request started since on
        # pages this request matched on L2 (the re-match found them on L1, still loading), and ours
        pending = [p for p in dict.fromkeys([*req.pending, *m.pending]) if not p.done()]
        if handle is not None:
            pending.append(handle)
        req.pending = pending
        result = LoadResult(MultiHandle(pending) if pending else None, dev_all, n, l3_done)
        self.metrics.loadback_seconds.inc(time.perf_counter() - t0)
        return result

    def device_headroom(self, wait_backups: bool = False) -> tuple[int, int]:
        """(free, evictable) L1 pages now: an allocation of up to their sum can succeed.

        Pages of an L1 -> L2 backup in flight stay locked until it ends. Finished backups are folded in
        first; with ``wait_backups``, the call also waits for those still in flight (as :meth:`alloc`
        does before it gives up), so their pages count as evictable.
        """
        with self._lock:
            self._tiers.reap(wait=wait_backups)
            return self.device_pool.allocator.free_pages, self.tree.device_pages - self.tree.locked_device_pages

    def alloc(self, req: Request, n_pages: int) -> np.ndarray:
        """L1 pages for ``n_pages`` new pages of this request; evicts under pressure.

        Raises :class:`CacheFullError` when everything evictable is locked.
        """
        self._check_open(req)
        with self._lock:
            pages = self._tiers.alloc_device(n_pages)
            req.owned_device.append(pages)
            self._update_gauges()
            return pages

    def commit(self, req: Request, tokens: Sequence[int] | np.ndarray, device_pages: np.ndarray,
               priority: int | None = None) -> CommitResult:
        """Insert the request's pages: ``tokens`` is the whole sequence (prefix included) and
        ``device_pages`` the L1 pages of every full page of it, in order (the prefix's pages from
        ``req.device_indices`` followed by pages from :meth:`alloc`).

        ``priority`` (with ``eviction_policy: priority``; lower priorities are evicted first) is set on
        the path's last node, the latest commit deciding, and raised on every node above it, where the
        highest value wins.

        The request's lock moves to the end of the inserted run. Pages the tree already held are freed
        if the request owned them; when a page the tree hands back instead (``req.device_indices``) is
        still being loaded from L2 by another request, commit returns once that load has landed. Write
        policy: write_through backs up now every node of the path that has no L2 copy yet (the prefix's
        included; ``backed_up_pages`` counts them all).
        """
        self._check_open(req)
        self._check_ns(req.ns)
        tb = self._full_pages(tokens)
        dev = np.asarray(device_pages, dtype=np.int64)
        n = len(tb) // (self.page_size * 4)
        if len(dev) != n:
            raise ValueError(f"commit: {n} full pages of tokens but {len(dev)} device pages")
        if tb[: len(req.token_bytes)] != req.token_bytes[: len(tb)]:
            raise ValueError("commit: tokens do not extend the matched request")
        known = len(req.keys)
        keys = req.keys[:n] if n <= known else req.keys + page_keys_from_bytes(
            req.ns.digest, tb, self.page_size, req.keys[-1] if req.keys else None, known)
        with self._lock:
            self._note_tenant(req.ns)  # it may have been forgotten since its match, while it had no pages
            owned = np.concatenate(req.owned_device) if req.owned_device else EMPTY
            prefix = len(req.device_indices)
            if prefix > n or not np.array_equal(dev[:prefix], req.device_indices[:prefix]):
                raise ValueError("commit: device pages must start with the request's matched prefix pages")
            new = dev[prefix:]
            if not np.isin(new, owned).all():
                raise ValueError("commit: device pages not allocated to this request")
            # an L2 run not loaded back by now is not served: the pages after the L1 prefix are the caller's
            self._accounting.count_l2(req, 0)
            res = self.tree.insert(req.ns.digest, tb, keys, device=dev)
            assert res is not None  # L1 inserts start at page 0, so they always attach
            if priority is not None:
                x: TreeNode | None = res.node
                while x is not None and x.parent is not None:
                    x.priority = max(x.priority, priority) if x is not res.node else priority
                    x = x.parent
            dup = new[res.reused[prefix:]]
            if len(dup):
                self.device_pool.allocator.free(dup)
            remaining = owned[~np.isin(owned, new)]
            req.owned_device = [remaining] if len(remaining) else []
            self.tree.lock(res.node)
            self.tree.unlock(req.lock_node)
            req.lock_node = res.node
            req.token_bytes = tb
            req.keys = keys
            req.device_indices = self._tiers.path_device(res.node)
            loading = self._tiers.loads_on_path(res.node)
            backed = self._tiers.back_up_path(res.node) if self.write_policy == "write_through" else 0
            self._update_gauges()
        for h in loading:  # pages reused from the tree that another request's load is still writing
            h.wait()
        return CommitResult(res.new_pages, int(res.reused[prefix:].sum()), backed)

    def release(self, req: Request) -> None:
        """End the request: unlock, unpin, cancel its prefetch, free pages it still owns. Not idempotent:
        a second release raises ``ValueError``."""
        if req.released:
            raise ValueError("release: request already released")
        if req.uncounted is not None:  # a deferred match never counted: nor are its L2 / L3 runs
            req.l2 = req.l3 = None
            req.uncounted = None
        self._prefetch.cancel(req)
        with self._lock:
            if req.l3 is not None:  # never loaded its prefetch back: nothing of the run was served
                self._accounting.count_l3(req, 0)
            self._accounting.count_l2(req, 0)  # nor its L2 run, if it never loaded it back
            self.tree.unlock(req.lock_node)
            self.tree.unpin_host(req.pin_node)
            for pages in req.owned_device:
                self.device_pool.allocator.free(pages)
            req.owned_device, req.pin_node, req.lock_node = [], None, None
            req.released = True
            self._update_gauges()
