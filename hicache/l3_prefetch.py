"""A request's L3 -> L2 prefetch, the cache's side: when one starts, how it ends, what enters the tree.

Contract:

* At most one prefetch per request (:meth:`L3Prefetch.start`), of its L3 run as its tokens are now, and only
  when it is worth it (``storage.prefetch_threshold_tokens``), L2 has room and the bytes in flight stay within
  ``storage.prefetch_max_inflight_bytes``; anything else is counted in ``hicache_prefetch_aborted_total``.
* Until it ends, its L2 pages belong to its :class:`~hicache.storage.prefetch.PrefetchTask`, not to the tree.
  It ends at the request's load back (:meth:`L3Prefetch.finish`, waiting per ``storage.prefetch_policy``),
  where the leading pages that landed and are still the request's enter the tree, or at its release
  (:meth:`L3Prefetch.cancel`), where they are freed. Either way its :class:`~hicache.accounting.L3Tally`
  learns what landed.
* ``start`` and ``finish`` take the tree lock for bookkeeping only (the store is read by the prefetcher's
  threads, and waited for outside the lock); ``cancel`` likewise.
"""

from __future__ import annotations

import threading
import time

from hicache.cache_types import Request
from hicache.config import HiCacheConfig
from hicache.metrics import Metrics
from hicache.pool import HostPool
from hicache.radix import RadixTree
from hicache.storage.base import StorageBackend
from hicache.storage.prefetch import Prefetcher, PrefetchTask
from hicache.tenants import TenantShares
from hicache.tiers import Tiers


class L3Prefetch:
    """The prefetches of one cache's requests and the bytes they have in flight."""

    def __init__(self, config: HiCacheConfig, storage: StorageBackend | None, prefetcher: Prefetcher | None,
                 tree: RadixTree, host_pool: HostPool, tiers: Tiers, tenants: TenantShares, metrics: Metrics,
                 lock: threading.RLock) -> None:
        self.config = config.storage
        self.storage = storage
        self.prefetcher = prefetcher
        self.tree = tree
        self.host_pool = host_pool
        self.tiers = tiers
        self.tenants = tenants
        self.metrics = metrics
        self.lock = lock
        self.page_size = config.layout.page_size
        self.bytes_per_page = config.layout.to_layout().bytes_per_page
        self.has_l2 = config.l2_pages > 0
        self.inflight_bytes = 0

    def _add_inflight(self, nbytes: int) -> None:
        self.inflight_bytes += nbytes
        self.metrics.prefetch_inflight_bytes.set(self.inflight_bytes)

    def start(self, req: Request) -> int:
        """:meth:`hicache.cache.HiCache.prefetch`: returns the pages being fetched (0: none started)."""
        s = self.config
        # pages the request holds already: its match's L1 + L2 run, or more once it committed its own
        start = max(req.l1_pages + req.l2_pages, len(req.device_indices))
        n = min(req.l1_pages + req.l2_pages + req.l3_pages, len(req.keys)) - start
        if (self.storage is None or self.prefetcher is None or req.prefetch is not None or req.prefetched
                or n <= 0 or n * self.page_size < s.prefetch_threshold_tokens or not self.has_l2):
            return 0
        nbytes = n * self.bytes_per_page
        with self.lock:
            if self.inflight_bytes + nbytes > s.prefetch_max_inflight_bytes:
                self.metrics.prefetch_aborted.inc()
                return 0
            host = self.tiers.alloc_host(n)
            if host is None:
                self.metrics.prefetch_aborted.inc()
                return 0
            self._add_inflight(nbytes)
        try:
            req.prefetch = self.prefetcher.submit(PrefetchTask(
                self.storage, req.keys[start:start + n], self.host_pool, host, s.io_batch_pages,
                self.tiers.free_host_locked, observe=self.metrics.storage_op["get"].observe))
        except BaseException:
            with self.lock:
                self.host_pool.allocator.free(host)
                self._add_inflight(-nbytes)
            raise
        req.prefetched = True
        req.prefetch_start = start
        if req.l3 is not None:
            req.l3.fetch_first, req.l3.fetch_pages = start, n
        return n

    def finish(self, req: Request) -> int:
        """End the request's prefetch per policy and put the pages that landed in the tree; returns how
        many leading pages of its run (from ``req.prefetch_start``) entered the tree for it."""
        task = req.prefetch
        if task is None:
            return 0
        s = self.config
        wait: float | None
        if s.prefetch_policy == "best_effort":
            wait = 0.0
        elif s.prefetch_policy == "wait_complete":
            wait = None
        else:
            wait = s.prefetch_timeout(task.num_pages * self.page_size)
        n = task.finish(wait)
        self.metrics.prefetch_seconds.observe(time.monotonic() - task.created_at)
        if req.l3 is not None:
            req.l3.landed, req.l3.missed = n, task.missed
        with self.lock:
            self._add_inflight(-task.num_pages * self.bytes_per_page)
            req.prefetch = None  # finished: its first n host pages are ours, inserted or freed below
            if n < task.num_pages:
                self.metrics.prefetch_aborted.inc()
            # The task's pages are keys[start:start + n] as they were when it began. The request may have
            # committed other tokens since (fewer than it matched, then others): only the leading pages
            # whose keys are still the request's are its pages.
            start = req.prefetch_start
            same = 0
            while same < n and start + same < len(req.keys) and req.keys[start + same] == task.keys[same]:
                same += 1
            if same < n:
                self.host_pool.allocator.free(task.host_pages[same:n])
                n = same
            if n == 0:
                return 0
            end = start + n
            self.tenants.note(req.ns, self.tree.roots)  # as at a commit: the run may be the namespace's first pages
            try:
                res = self.tree.insert(req.ns.digest, req.token_bytes[: end * self.page_size * 4], req.keys[:end],
                                       host=task.host_pages[:n], start_page=start)
            except BaseException:
                self.host_pool.allocator.free(task.host_pages[:n])
                raise
            if res is None:  # the prefix it hangs from was evicted meanwhile
                self.host_pool.allocator.free(task.host_pages[:n])
                return 0
            dup = task.host_pages[:n][res.reused[start:end]]
            if len(dup):  # pages L2 gained meanwhile (another request's prefetch, a backup): counted there
                self.host_pool.allocator.free(dup)
            self.metrics.prefetch_tokens.inc((n - len(dup)) * self.page_size)
            return n

    def cancel(self, req: Request) -> None:
        """At the request's release: stop its prefetch, if any, and free its pages; none reach the tree."""
        task = req.prefetch
        if task is None:
            return
        task.cancel()  # stops it and frees its pages, unless it was already finished ...
        with self.lock:
            self._add_inflight(-task.num_pages * self.bytes_per_page)
            # whether the fetch was still running, had landed, or had been finished (handed over, as a node's
            # Prefetch cut short by its deadline leaves it)
            self.metrics.prefetch_aborted.inc()
            if not task.cancelled and task.handed > 0:  # ... and handed over, but never loaded back
                self.host_pool.allocator.free(task.host_pages[: task.handed])
            if req.l3 is not None:  # what landed (the worker has stopped) is dropped with the request
                req.l3.landed, req.l3.missed = task.completed, task.missed
        req.prefetch = None
