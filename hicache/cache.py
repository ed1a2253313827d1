"""The cache orchestrator: one radix tree over L1 / L2 / L3, pools, transfers, write policies, metrics.

A request's life (README, "Using the library")::

    req = cache.match(tokens)          # hit lengths per tier; locks the L1 prefix, pins the L2 run
    cache.prefetch(req)                # optional: start L3 -> L2 for the L3 run (if worth it)
    load = cache.load_back(req)        # L2 (+ prefetched L3) -> L1, layer by layer; load.wait_layer(i)
    pages = cache.alloc(req, n)        # L1 pages for the new tokens (evicts under pressure)
    cache.commit(req, tokens, pages)   # insert; back up per write policy; L2 -> L3 in background
    cache.release(req)                 # unlock / unpin; frees anything the request still owns

Threading model:

* Every public method may be called from any thread; the tree, both allocators' bookkeeping and every
  request's state are protected by one re-entrant lock, ``self._lock`` (the *tree lock*). Calls hold it
  for bookkeeping, never across an L3 round trip; some also wait under it for L1 -> L2 copies already in
  flight (``evict``, ``clear``, ``flush``, an allocation under pressure, a ``write_back`` eviction), for
  an L2 -> L1 load still writing pages an L1 eviction frees (its request was released before the load
  landed) and, with ``writeback_when_full: block``, for room in the L3 writeback queue.
* Background work: the transfer engine's worker/streams copy pages; the prefetcher's threads read L3
  into host pages a :class:`PrefetchTask` owns; one writeback thread writes L2 pages (pinned in the tree
  until written) to L3. Their completions are folded in under the tree lock (``_reap``).
* A :class:`Request` is used by one caller at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from hicache.cache_types import CacheFullError, CommitResult, LoadResult, MultiHandle, PinInfo, Request
from hicache.config import ConfigError, HiCacheConfig
from hicache.keys import Namespace, page_keys_from_bytes, tokens_to_bytes
from hicache.l2_tally import L2Tally
from hicache.l3_tally import L3Tally
from hicache.metrics import Metrics
from hicache.pool import DevicePool, HostMemoryError, HostPool, default_block_pages, format_bytes
from hicache.radix import EMPTY, RadixTree, TreeEvent, TreeNode
from hicache.storage.base import StorageBackend, StorageContext, create_backend
from hicache.storage.prefetch import Prefetcher, PrefetchTask
from hicache.storage.writeback import FlushReport, Writeback
from hicache.transfer import TransferHandle, create_engine

__all__ = ["CacheFullError", "CommitResult", "HiCache", "LoadResult", "PinInfo", "Request"]

TENANT_MEMORY = 1 << 16  # namespaces without pages whose tenant the cache remembers (cache.tenant_shares)
SELECTIVE_THRESHOLD = 2  # write_through_selective backs a node up at its second use (the insert is the first)


def l2_too_large(config: HiCacheConfig, e: HostMemoryError) -> ConfigError:
    """The error for an L2 (``cache.l2_tokens``) that does not fit in host memory: one line with the bytes
    asked for, what is available and a size that would fit. It is the config's to fix, so it is a
    :class:`ConfigError` (``hicache serve`` exits 2 with this line)."""
    layout = config.layout.to_layout()
    page_bytes = layout.bytes_per_page
    page_size = config.layout.page_size
    asked = (f"cache.l2_tokens: {config.cache.l2_tokens} tokens ({config.l2_pages} pages of "
             f"{format_bytes(page_bytes)}) need {format_bytes(e.needed)} ({e.needed} bytes) of host memory for L2")
    if e.available is not None:
        # a block-first pool holds whole blocks: what fits is a whole number of them
        block = 1
        if config.cache.host_layout == "block_first":
            block = config.cache.host_block_pages or default_block_pages(layout.bytes_per_layer_piece)
        fit = e.available // (page_bytes * block) * block * page_size
        return ConfigError(f"{asked}, but only {format_bytes(e.available)} is available; set a smaller "
                           f"cache.l2_tokens (what is available holds at most {fit}; 0 disables L2)",
                           "cache.l2_tokens")
    return ConfigError(f"{asked}, and the allocation failed ({e.detail or 'out of memory'}); set a smaller "
                       f"cache.l2_tokens (0 disables L2)", "cache.l2_tokens")


class HiCache:
    """Three-tier KV cache for one model shard (one KV layout, any number of tenants)."""

    def __init__(self, config: HiCacheConfig, storage: StorageBackend | None = None,
                 metrics: Metrics | None = None, device_pool: DevicePool | None = None) -> None:
        """``storage`` overrides ``config.storage.url``; ``device_pool`` lets a caller supply an L1 pool
        it allocated itself (e.g. in shared memory or CUDA IPC-exportable), of the config's layout."""
        self.config = config
        self.layout = config.layout.to_layout()
        self.page_size = self.layout.page_size
        self.ns = config.namespace()
        c = config.cache
        if device_pool is not None and device_pool.layout != self.layout:
            raise ValueError("device_pool: layout differs from the config's layout")
        self.device_pool = device_pool or DevicePool(self.layout, config.l1_pages, c.device)
        # On a GPU the CUDA transfer engine page-locks the host pool in place (cudaHostRegister) and
        # unregisters it on close, so tens of GB are pinned once, without torch's caching allocator.
        pin = False if (c.device.startswith("cuda") and c.io_backend != "cpu") else None
        try:
            self.host_pool = HostPool(self.layout, max(config.l2_pages, 1), c.host_layout,  # type: ignore[arg-type]
                                      pin_memory=pin, block_pages=c.host_block_pages)
        except HostMemoryError as e:
            raise l2_too_large(config, e) from None
        self.has_l2 = config.l2_pages > 0
        io = c.io_backend
        if io in ("kernel", "copy_engine", "staged"):
            self.transfer = create_engine("cuda", self.device_pool, self.host_pool, io_backend=io,
                                          **c.transfer_options)
        elif io == "auto" and self.device_pool.device.type == "cuda":
            self.transfer = create_engine("cuda", self.device_pool, self.host_pool, **c.transfer_options)
        else:  # the portable engine has nothing to tune
            self.transfer = create_engine("cpu", self.device_pool, self.host_pool)
        self.tree = RadixTree(self.page_size, c.eviction_policy)
        self._shares = dict(c.tenant_shares)
        self._tenant_of: dict[bytes, str] = {}  # namespace digest -> tenant, with shares (see _note_tenant)
        self._share_pages: dict[int, dict[str, int]] = {}  # tier capacity -> tenant -> its cap (see _caps)
        self.metrics = metrics or Metrics()
        self.write_policy = c.write_policy
        self._lock = threading.RLock()
        # L1 -> L2 copies in flight: (handle, node, its page keys, its L2 pages) captured at submission
        self._backups: list[tuple[TransferHandle, TreeNode, list[bytes], np.ndarray]] = []
        self._l3_writing = 0  # pages pinned for L3 writeback
        # pinned prefixes: id -> (locked L1 node, pinned L2 node, what was pinned)
        self._pins: dict[int, tuple[TreeNode | None, TreeNode | None, PinInfo]] = {}
        self._pin_ids = 0
        self._pinned = [0, 0]  # pages pins hold on L1, L2 (overlapping pins count each time)
        s = config.storage
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
        self._prefetch_inflight_bytes = 0
        self._storage_seen: dict[str, int] = {}  # backend counters already folded into metrics (by field)
        self.metrics.on_collect = self._refresh_metrics
        m = self.metrics
        if storage is not None:
            m.export_storage_up()
        m.pool_total.labels("l1").set(self.device_pool.num_pages)
        m.pool_total.labels("l2").set(config.l2_pages)
        self._update_gauges()

    # ------------------------------------------------------------------ helpers
    def namespace(self, tenant: str | None = None) -> Namespace:
        """The cache's namespace (``tenant`` None), or the same model, revision, layout and TP under ``tenant``."""
        return self.ns if tenant is None else self.ns.with_tenant(tenant)

    def _check_ns(self, ns: Namespace) -> None:
        if ns.layout != self.layout:
            raise ValueError(f"namespace layout {ns.layout.describe()} does not match the pool's "
                             f"{self.layout.describe()}")

    def _note_tenant(self, ns: Namespace) -> None:
        """Under the lock, before ``ns`` may gain pages (a match, a commit, a prefetch landing): remember
        whose namespace ``ns.digest`` is (the tree knows digests only) when a share of ``cache.tenant_shares``
        applies to its tenant, most recent last. A namespace with pages in the tree is never forgotten, so its
        tenant's share applies to them as long as they stay; of the others (lookups that left nothing), once
        there are more than TENANT_MEMORY, the oldest are forgotten, down to half of it."""
        shares = self._shares
        if not shares or (ns.tenant not in shares and "*" not in shares):
            return
        known, roots = self._tenant_of, self.tree.roots
        known.pop(ns.digest, None)
        known[ns.digest] = ns.tenant
        if len(known) > TENANT_MEMORY + len(roots):  # so more than TENANT_MEMORY without pages
            idle = [d for d in known if d not in roots and d != ns.digest]
            for d in idle[: len(idle) - TENANT_MEMORY // 2]:
                del known[d]

    def _caps(self, capacity: int) -> dict[bytes, int] | None:
        """Per namespace in the tree, the pages of a tier of ``capacity`` pages beyond which its tenant's
        pages are evicted first (``cache.tenant_shares``); None without shares. The share is taken as the
        decimal the config wrote (0.29 of 100 pages is 29, where ``0.29 * 100`` is 28.999...)."""
        if not self._shares:
            return None
        per_tenant = self._share_pages.get(capacity)
        if per_tenant is None:
            per_tenant = self._share_pages[capacity] = {
                t: int(Fraction(repr(float(s))) * capacity) for t, s in self._shares.items()}
        caps = {}
        default = per_tenant.get("*")
        for digest in self.tree.roots:
            tenant = self._tenant_of.get(digest)
            cap = None if tenant is None else per_tenant.get(tenant, default)
            if cap is not None:
                caps[digest] = cap
        return caps

    def tenant_pages(self) -> dict[str, tuple[int, int]]:
        """Pages (L1, L2) each tenant named in ``cache.tenant_shares`` holds now (``"*"`` is no tenant)."""
        named = [t for t in self._shares if t != "*"]
        out = dict.fromkeys(named, (0, 0))
        with self._lock:
            for digest in self.tree.roots:
                tenant = self._tenant_of.get(digest)
                if tenant in out:
                    l1, l2 = self.tree.namespace_pages(digest)
                    out[tenant] = (out[tenant][0] + l1, out[tenant][1] + l2)
        return out

    def _refresh_metrics(self) -> None:
        """At a scrape: gauges and L3 counters as they are now (the tree lock guards the bookkeeping)."""
        with self._lock:
            self._update_gauges()
        if self._shares:
            m = self.metrics
            for tenant, (l1, l2) in self.tenant_pages().items():
                m.tenant_pages.labels(tenant, "l1").set(l1)
                m.tenant_pages.labels(tenant, "l2").set(l2)
                m.tenant_share.labels(tenant).set(self._shares[tenant])

    def _update_gauges(self) -> None:
        m = self.metrics
        m.used["l1"].set(self.device_pool.allocator.used_pages)
        m.used["l2"].set(self.host_pool.allocator.used_pages if self.has_l2 else 0)
        m.pinned["l1"].set(self._pinned[0])
        m.pinned["l2"].set(self._pinned[1])
        m.prefetch_inflight_bytes.set(self._prefetch_inflight_bytes)
        if self.writeback is not None:
            m.writeback_queue.set(self.writeback.queued_pages)
        if self.storage is not None:
            st = self.storage.stats()
            seen = self._storage_seen
            for f, counter in m.storage.items():
                now = getattr(st, f)
                if now > seen.get(f, 0):
                    counter.inc(now - seen.get(f, 0))
                    seen[f] = now

    def _reap(self, wait: bool = False) -> None:
        """Fold in finished L1 -> L2 backups: unlock the node, then hand its pages to L3 writeback."""
        still = []
        for item in self._backups:
            handle, node, keys, host = item
            if wait:
                handle.wait()
            if handle.done():
                self.tree.unlock(node)
                self._write_l3(node, keys, host)
                self.tree.unpin_host(node)
            else:
                still.append(item)
        self._backups = still

    def _write_l3(self, node: TreeNode, keys: list[bytes], host: np.ndarray) -> None:
        """Queue ``keys``/``host`` (the L2 pages of ``node``, captured before any split) for L3; the
        path stays pinned until written, so a split of ``node`` meanwhile keeps both halves' pages."""
        if self.writeback is None:
            return
        self.tree.pin_host(node)
        n = len(keys)

        def done(written: int) -> None:
            """Writeback completion (its thread): unpin the path, count the ``written`` pages."""
            with self._lock:
                self.tree.unpin_host(node)
                self._l3_writing -= n
                self.metrics.backup_tokens.labels("l3").inc(written * self.page_size)

        self._l3_writing += n
        if not self.writeback.submit(keys, host, done):
            self.tree.unpin_host(node)
            self._l3_writing -= n
            self.metrics.writeback_dropped_pages.inc(n)

    def _alloc_device(self, n: int) -> np.ndarray:
        pages = self.device_pool.allocator.alloc(n)
        if pages is None:
            self._reap()
            self._evict_device(n - self.device_pool.allocator.free_pages)
            pages = self.device_pool.allocator.alloc(n)
        if pages is None and self._backups:
            self._reap(wait=True)
            self._evict_device(n - self.device_pool.allocator.free_pages)
            pages = self.device_pool.allocator.alloc(n)
        if pages is None:
            raise CacheFullError(f"L1: need {n} pages, {self.device_pool.allocator.free_pages} free, "
                                 f"{self.tree.locked_device_pages} locked by requests in flight")
        return pages

    def _alloc_host(self, n: int) -> np.ndarray | None:
        if not self.has_l2:
            return None
        pages = self.host_pool.allocator.alloc(n)
        if pages is None:
            self._evict_host(n - self.host_pool.allocator.free_pages)
            pages = self.host_pool.allocator.alloc(n)
        return pages

    def _evict_device(self, n: int, backup: Callable[[TreeNode], bool] | None = None,
                      only: Collection[bytes] | None = None) -> int:
        freed = self.tree.evict_device(n, self._backup_on_evict if backup is None else backup,
                                       self._caps(self.device_pool.num_pages), only)
        total = sum(len(f) for f in freed)
        for f in freed:
            self.device_pool.allocator.free(f)
        self.metrics.evicted_tokens.labels("l1").inc(total * self.page_size)
        return total

    def _evict_host(self, n: int, only: Collection[bytes] | None = None) -> int:
        freed = self.tree.evict_host(n, self._caps(self.config.l2_pages), only)
        total = sum(len(f) for f in freed)
        for f in freed:
            self.host_pool.allocator.free(f)
        self.metrics.evicted_tokens.labels("l2").inc(total * self.page_size)
        return total

    def _backup_on_evict(self, node: TreeNode) -> bool:
        """Eviction hook: under write_back (or when L2-only children hang below) back up synchronously."""
        if self.write_policy != "write_back" and not node.children:
            return False
        return self._backup(node, wait=True)

    def _backup(self, node: TreeNode, wait: bool) -> bool:
        if node.host is not None or node.device is None or not self.has_l2:
            return False
        host = self._alloc_host(node.n_pages)
        if host is None:
            self.metrics.backup_skipped_tokens.inc(node.n_pages * self.page_size)
            return False
        t0 = time.perf_counter()
        handle = self.transfer.backup(node.device, host)
        self.metrics.transfer_submit["backup"].observe(time.perf_counter() - t0)
        self.tree.set_host(node, host)
        self.metrics.backup_tokens.labels("l2").inc(node.n_pages * self.page_size)
        keys = list(node.page_keys)
        if wait:
            handle.wait()
            self._write_l3(node, keys, host)
        else:
            self.tree.lock(node)  # device pages stay until the copy is done
            self.tree.pin_host(node)  # and the L2 pages are not reused before it is
            self._backups.append((handle, node, keys, host))
        return True

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
        (:mod:`hicache.l3_tally`).
        """
        t0 = time.perf_counter()
        ns = ns or self.ns
        self._check_ns(ns)
        tb = tokens_to_bytes(tokens)
        tb = tb[: len(tb) - len(tb) % (self.page_size * 4)]
        need_keys = keys or (l3 and self.storage is not None)
        pkeys = page_keys_from_bytes(ns.digest, tb, self.page_size) if need_keys else []
        with self._lock:
            self._reap()
            self._note_tenant(ns)
            m = self.tree.match(ns.digest, tb)
            self.tree.lock(m.l1_node)
            pin = m.host_nodes[-1] if m.host_nodes else None
            self.tree.pin_host(pin)
            if self.write_policy == "write_through_selective":
                node = m.l1_node
                while node is not None and node.parent is not None:
                    if node.host is None and node.hit_count >= SELECTIVE_THRESHOLD:
                        self._backup(node, wait=False)
                    node = node.parent
            self._update_gauges()
        req = Request(ns, tb, pkeys, m.l1_pages, m.l2_pages, 0, m.device_indices, m.l1_node, pin,
                      list(m.host_nodes), list(m.pending))
        done = req.l1_pages + req.l2_pages
        if l3 and self.storage is not None and done < len(pkeys):
            t_ex = time.perf_counter()
            req.l3_pages = self.storage.batch_exists(pkeys[done:])
            self.metrics.storage_op["exists"].observe(time.perf_counter() - t_ex)
        if count:
            if req.l2_pages:  # served or not is known at its load back (or commit, release): _count_l2
                req.l2 = L2Tally(req.l1_pages, req.l2_pages)
            if req.l3_pages:  # served or not is known later: hit{l3} counts it then (_count_l3)
                req.l3 = L3Tally(req.l1_pages + req.l2_pages, req.l3_pages)
            req.uncounted = time.perf_counter() - t0
            if not defer_count:
                self.count_match(req)
        return req

    def count_match(self, req: Request) -> None:
        """Count a match made with ``defer_count`` (a no-op for any other): the lookup, its L1 hit, the L3
        pages the store reported, the match's latency."""
        if req.uncounted is None:
            return
        mt = self.metrics
        mt.lookups.inc()
        mt.lookup_tokens.inc(req.num_pages * self.page_size)
        mt.hit["l1"].inc(req.l1_pages * self.page_size)
        if req.l3_pages:
            mt.l3_matched_tokens.inc(req.l3_pages * self.page_size)
        mt.match_seconds.observe(req.uncounted)
        req.uncounted = None

    def peek(self, tokens: Sequence[int] | np.ndarray, ns: Namespace | None = None, *, l3: bool = True,
             keys: bool = True) -> Request:
        """How much of ``tokens`` is cached now, per tier, without opening a request: :meth:`match` and
        :meth:`release` at once (a router's or scheduler's query). Nothing is served, so none of it is
        counted as a lookup or a hit (nor on L2 or L3): it counts in ``hicache_peeks_total`` only. The
        returned request is released (its hit lengths and keys are for reading).

        Nor is it an access: recency, hit counts and the eviction policy's view of the request stream are
        left as they were (a router asking many times must not make a prefix look hot), and nothing is
        locked or pinned (the walk and the reading happen under one hold of the tree lock)."""
        ns = ns or self.ns
        self._check_ns(ns)
        tb = tokens_to_bytes(tokens)
        tb = tb[: len(tb) - len(tb) % (self.page_size * 4)]
        need_keys = keys or (l3 and self.storage is not None)
        pkeys = page_keys_from_bytes(ns.digest, tb, self.page_size) if need_keys else []
        with self._lock:
            self._reap()
            m = self.tree.match(ns.digest, tb, touch=False)
        req = Request(ns, tb, pkeys, m.l1_pages, m.l2_pages, 0, m.device_indices, released=True)
        done = req.l1_pages + req.l2_pages
        if l3 and self.storage is not None and done < len(pkeys):
            t_ex = time.perf_counter()
            req.l3_pages = self.storage.batch_exists(pkeys[done:])
            self.metrics.storage_op["exists"].observe(time.perf_counter() - t_ex)
        self.metrics.peeks.inc()
        return req

    def prefetch(self, req: Request) -> int:
        """Start L3 -> L2 for the request's L3 run when it is worth it; returns pages being fetched.

        At most once per request: a second call (the run is in the tree by then, or was given up) starts
        nothing. The run is cut to the request's tokens as they are now (a commit of fewer tokens than
        were matched shortens it)."""
        s = self.config.storage
        # pages the request holds already: its match's L1 + L2 run, or more once it committed its own
        start = max(req.l1_pages + req.l2_pages, len(req.device_indices))
        n = min(req.l1_pages + req.l2_pages + req.l3_pages, len(req.keys)) - start
        if (self.storage is None or self.prefetcher is None or req.prefetch is not None or req.prefetched
                or n <= 0 or n * self.page_size < s.prefetch_threshold_tokens or not self.has_l2):
            return 0
        nbytes = n * self.layout.bytes_per_page
        with self._lock:
            if self._prefetch_inflight_bytes + nbytes > s.prefetch_max_inflight_bytes:
                self.metrics.prefetch_aborted.inc()
                return 0
            host = self._alloc_host(n)
            if host is None:
                self.metrics.prefetch_aborted.inc()
                return 0
            self._prefetch_inflight_bytes += nbytes
            self.metrics.prefetch_inflight_bytes.set(self._prefetch_inflight_bytes)
        try:
            req.prefetch = self.prefetcher.submit(PrefetchTask(
                self.storage, req.keys[start:start + n], self.host_pool, host, s.io_batch_pages,
                self._free_host_locked, observe=self.metrics.storage_op["get"].observe))
        except BaseException:
            with self._lock:
                self.host_pool.allocator.free(host)
                self._prefetch_inflight_bytes -= nbytes
                self.metrics.prefetch_inflight_bytes.set(self._prefetch_inflight_bytes)
            raise
        req.prefetched = True
        req.prefetch_start = start
        if req.l3 is not None:
            req.l3.fetch_first, req.l3.fetch_pages = start, n
        return n

    def _free_host_locked(self, pages: np.ndarray) -> None:
        with self._lock:
            self.host_pool.allocator.free(pages)

    def _finish_prefetch(self, req: Request) -> int:
        """End the request's prefetch per policy and put the pages that landed in the tree; returns how
        many leading pages of its run (from ``req.prefetch_start``) entered the tree for it."""
        task = req.prefetch
        if task is None:
            return 0
        s = self.config.storage
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
        with self._lock:
            self._prefetch_inflight_bytes -= task.num_pages * self.layout.bytes_per_page
            self.metrics.prefetch_inflight_bytes.set(self._prefetch_inflight_bytes)
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
            self._note_tenant(req.ns)  # as at a commit: the run may be the namespace's first pages
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
        kept = self._finish_prefetch(req)
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
            if n:
                self.tree.lock(m.l1_node)  # keep the prefix while we allocate (may evict)
                self.tree.pin_host(nodes[-1])
                try:
                    dev = self._alloc_device(n)
                except CacheFullError:
                    if req.l2 is not None:  # counted no_room unless a later load back lands it
                        req.l2.no_room = True
                    raise
                finally:
                    self.tree.unpin_host(nodes[-1])
                    self.tree.unlock(m.l1_node)
                host = np.concatenate([x.host for x in nodes if x.host is not None])
                t1 = time.perf_counter()
                handle = self.transfer.load(host, dev, layer_wise=layer_wise)
                self.metrics.transfer_submit["load"].observe(time.perf_counter() - t1)
                off = 0
                for x in nodes:
                    self.tree.set_device(x, dev[off: off + x.n_pages], handle)
                    off += x.n_pages
                self.metrics.loadback_tokens.inc(n * self.page_size)
                self.metrics.loadback_bytes.inc(n * self.layout.bytes_per_page)
                new_lock: TreeNode | None = nodes[-1]
                dev_all = np.concatenate([m.device_indices, dev])
            else:
                new_lock = m.l1_node
                dev_all = m.device_indices
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
                self._count_l3(req, len(dev_all))
            self._count_l2(req, len(dev_all))  # its L2 run is on L1 now (or was already, loaded by another)
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
            self._reap(wait=wait_backups)
            return self.device_pool.allocator.free_pages, self.tree.device_pages - self.tree.locked_device_pages

    def alloc(self, req: Request, n_pages: int) -> np.ndarray:
        """L1 pages for ``n_pages`` new pages of this request; evicts under pressure.

        Raises :class:`CacheFullError` when everything evictable is locked.
        """
        self._check_open(req)
        with self._lock:
            pages = self._alloc_device(n_pages)
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
        tb = tokens_to_bytes(tokens)
        tb = tb[: len(tb) - len(tb) % (self.page_size * 4)]
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
            self._count_l2(req, 0)
            res = self.tree.insert(req.ns.digest, tb, keys, device=dev)
            assert res is not None  # L1 inserts start at page 0, so they always attach
            if priority is not None:
                x: TreeNode | None = res.node
                while x is not None and x.parent is not None:
                    x.priority = max(x.priority, priority) if x is not res.node else priority
                    x = x.parent
            dup = new[res.reused[prefix:]]
            consumed = new
            if len(dup):
                self.device_pool.allocator.free(dup)
            remaining = owned[~np.isin(owned, consumed)]
            req.owned_device = [remaining] if len(remaining) else []
            self.tree.lock(res.node)
            self.tree.unlock(req.lock_node)
            req.lock_node = res.node
            req.token_bytes = tb
            req.keys = keys
            req.device_indices = self._path_device(res.node)
            loading = self._loads_on_path(res.node)
            backed = 0
            if self.write_policy == "write_through":
                node: TreeNode | None = res.node
                while node is not None and node.parent is not None:
                    if node.host is None and self._backup(node, wait=False):
                        backed += node.n_pages
                    node = node.parent
            self._update_gauges()
        for h in loading:  # pages reused from the tree that another request's load is still writing
            h.wait()
        return CommitResult(res.new_pages, int(res.reused[prefix:].sum()), backed)

    def _loads_on_path(self, node: TreeNode) -> list[TransferHandle]:
        """L2 -> L1 loads still writing the device pages of ``node``'s path (under the tree lock)."""
        out: list[TransferHandle] = []
        x: TreeNode | None = node
        while x is not None and x.parent is not None:
            h = x.load_handle
            if h is not None and not h.done() and h not in out:
                out.append(h)
            x = x.parent
        return out

    def _path_device(self, node: TreeNode) -> np.ndarray:
        parts = []
        x: TreeNode | None = node
        while x is not None and x.parent is not None:
            assert x.device is not None
            parts.append(x.device)
            x = x.parent
        return np.concatenate(parts[::-1]) if parts else EMPTY

    def release(self, req: Request) -> None:
        """End the request: unlock, unpin, cancel its prefetch, free pages it still owns. Not idempotent:
        a second release raises ``ValueError``."""
        if req.released:
            raise ValueError("release: request already released")
        if req.uncounted is not None:  # a deferred match never counted: nor are its L2 / L3 runs
            req.l2 = req.l3 = None
            req.uncounted = None
        task = req.prefetch
        if task is not None:
            task.cancel()  # stops it and frees its pages, unless it was already finished ...
            with self._lock:
                self._prefetch_inflight_bytes -= task.num_pages * self.layout.bytes_per_page
                self.metrics.prefetch_inflight_bytes.set(self._prefetch_inflight_bytes)
                # its pages never reach the tree, whether the fetch was still running, had landed, or had
                # been finished (handed over, as a node's Prefetch cut short by its deadline leaves it)
                self.metrics.prefetch_aborted.inc()
                if not task.cancelled and task.handed > 0:  # ... and handed over, but never loaded back
                    self.host_pool.allocator.free(task.host_pages[: task.handed])
                if req.l3 is not None:  # what landed (the worker has stopped) is dropped with the request
                    req.l3.landed, req.l3.missed = task.completed, task.missed
            req.prefetch = None
        with self._lock:
            if req.l3 is not None:  # never loaded its prefetch back: nothing of the run was served
                self._count_l3(req, 0)
            self._count_l2(req, 0)  # nor its L2 run, if it never loaded it back
            self.tree.unlock(req.lock_node)
            self.tree.unpin_host(req.pin_node)
            for pages in req.owned_device:
                self.device_pool.allocator.free(pages)
            req.owned_device, req.pin_node, req.lock_node = [], None, None
            req.released = True
            self._update_gauges()

    def _count_l2(self, req: Request, usable: int) -> None:
        """Count what became of the request's L2 run (under the tree lock, once: at its load back, or at
        its commit or release before one), by :meth:`_count_tier` (:mod:`hicache.l2_tally`)."""
        tally, req.l2 = req.l2, None
        if tally is not None:
            self._count_tier("l2", tally.outcome(usable), self.metrics.l2_unserved)

    def _count_l3(self, req: Request, usable: int) -> None:
        """Count what became of the request's L3 run (under the tree lock, once: at the load back of its
        prefetch, or at its release), by :meth:`_count_tier` (:mod:`hicache.l3_tally`)."""
        tally, req.l3 = req.l3, None
        if tally is not None:
            self._count_tier("l3", tally.outcome(usable), self.metrics.l3_unserved)

    def _count_tier(self, tier: str, outcome: dict[str, int], unserved: Mapping[str, Any]) -> None:
        """``hicache_hit_tokens_total{tier}`` the served pages of ``outcome`` (a tally's split, in pages,
        given the request's prefix on L1 now: 0 when it was not loaded back), the ``unserved`` counters
        the others by reason."""
        self.metrics.hit[tier].inc(outcome.pop("served") * self.page_size)
        for reason, pages in outcome.items():
            if pages:
                unserved[reason].inc(pages * self.page_size)

    def _check_open(self, req: Request) -> None:
        if req.released:
            raise ValueError("request already released")

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
        tb = tokens_to_bytes(tokens)
        tb = tb[: len(tb) - len(tb) % (self.page_size * 4)]
        frac = self.config.cache.max_pinned_fraction
        with self._lock:
            self._reap()
            self._note_tenant(ns)
            m = self.tree.match(ns.digest, tb)
            if m.l1_pages + m.l2_pages == 0:
                raise ValueError("pin: no page of this prefix is cached")
            l1, l2 = self._pinned[0] + m.l1_pages, self._pinned[1] + m.l2_pages
            if l1 > frac * self.device_pool.num_pages or l2 > frac * self.config.l2_pages:
                raise CacheFullError(f"pin: pins would hold {l1} L1 / {l2} L2 pages, over "
                                     f"cache.max_pinned_fraction={frac} of {self.device_pool.num_pages} / "
                                     f"{self.config.l2_pages}")
            host = m.host_nodes[-1] if m.host_nodes else None
            self.tree.lock(m.l1_node)
            self.tree.pin_host(host)
            self._pin_ids += 1
            info = PinInfo(self._pin_ids, m.l1_pages, m.l2_pages, ns.describe())
            self._pins[info.pin_id] = (m.l1_node, host, info)
            self._pinned = [l1, l2]
            self._update_gauges()
            return info

    def unpin(self, pin_id: int) -> PinInfo:
        """Let the pages of pin ``pin_id`` be evicted again (by the eviction policy, in its own time);
        ``KeyError`` for an unknown id."""
        with self._lock:
            if pin_id not in self._pins:
                raise KeyError(f"unpin: no pin {pin_id}")
            node, host, info = self._pins.pop(pin_id)
            self.tree.unlock(node)
            self.tree.unpin_host(host)
            self._pinned = [self._pinned[0] - info.l1_pages, self._pinned[1] - info.l2_pages]
            self._update_gauges()
            return info

    def pins(self) -> list[PinInfo]:
        """The pins held now, oldest first."""
        with self._lock:
            return [info for _, _, info in self._pins.values()]

    # ------------------------------------------------------------------ maintenance
    def evict(self, l1_pages: int = 0, l2_pages: int = 0) -> tuple[int, int]:
        """Evict explicitly (tests, admin); returns pages freed per tier."""
        with self._lock:
            self._reap(wait=True)
            a = self._evict_device(l1_pages) if l1_pages else 0
            b = self._evict_host(l2_pages) if l2_pages else 0
            self._update_gauges()
            return a, b

    def clear(self, namespaces: Collection[Namespace] | None = None) -> tuple[int, int]:
        """Drop every L1 and L2 page that no request holds, no pin keeps and no copy in flight uses (of the
        ``namespaces`` alone, when given: a tenant's pages); returns the pages freed on (L1, L2). The store
        (L3) is not touched. No backup is started, whatever
        the write policy; backups already in flight are finished first (and queued for L3), and so are
        L2 -> L1 loads still writing pages it drops (a request released before its load landed). For a cold
        start between benchmark runs, or after a mistake such as serving different weights under the same
        model revision (fix the revision: L3 still has pages under those keys)."""
        with self._lock:
            self._reap(wait=True)
            only = None if namespaces is None else {ns.digest for ns in namespaces}
            l1 = l2 = 0
            while True:  # dropping L2-only leaves lets their L1 parents go, and the other way round
                a = self._evict_device(self.device_pool.num_pages, backup=lambda node: False, only=only)
                b = self._evict_host(self.config.l2_pages, only) if self.has_l2 else 0
                l1, l2 = l1 + a, l2 + b
                if a == 0 and b == 0:
                    break
            self._update_gauges()
            return l1, l2

    def flush(self, timeout_s: float | None = None) -> FlushReport | None:
        """Wait for in-flight backups and L3 writebacks; report what could not be written."""
        with self._lock:
            self._reap(wait=True)
        return self.writeback.flush(timeout_s) if self.writeback is not None else None

    def check_integrity(self, requests: Sequence[Request] = ()) -> None:
        """free + cached + in flight == capacity on both pools, and the tree's invariants hold.

        ``requests``: live requests, whose owned pages count as in flight.
        """
        with self._lock:
            self.tree.check_invariants()
            self.device_pool.allocator.check_integrity()
            self.host_pool.allocator.check_integrity()
            cached = self.tree.all_device_pages()
            owned = [p for r in requests for p in r.owned_device]
            inflight = np.concatenate(owned) if owned else EMPTY
            held = np.concatenate([cached, inflight])
            assert len(np.unique(held)) == len(held), "an L1 page is held twice"
            alloc = self.device_pool.allocator.allocated()
            assert np.array_equal(np.sort(held), alloc), (
                f"L1: {len(held)} cached+in flight vs {len(alloc)} allocated")
            host_cached = self.tree.all_host_pages()
            assert len(np.unique(host_cached)) == len(host_cached), "an L2 page is held twice"
            prefetching = [r.prefetch.host_pages for r in requests if r.prefetch is not None]
            host_held = np.concatenate([host_cached, *prefetching]) if prefetching else host_cached
            host_alloc = self.host_pool.allocator.allocated()
            if self.has_l2:
                assert np.array_equal(np.sort(host_held), host_alloc), (
                    f"L2: {len(host_held)} cached+in flight vs {len(host_alloc)} allocated")

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
            self._reap()
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
                "pinned_l1_pages": self._pinned[0],
                "pinned_l2_pages": self._pinned[1],
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

    def __enter__(self) -> HiCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
