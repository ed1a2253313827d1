"""Pages between the tiers: L1 / L2 allocation under pressure, eviction, L1 -> L2 backups, L2 -> L3 writeback.

Contract:

* :class:`Tiers` moves pages for :class:`hicache.cache.HiCache`; every method is called under the cache's
  tree lock (the one lock it shares), except the writeback completion it registers, which takes it.
* An allocation that finds no free pages evicts (through the eviction policy, within the tenant shares),
  first without waiting, then after waiting for the L1 -> L2 backups in flight; :class:`CacheFullError`
  when everything evictable is locked. Under ``write_back`` (or when L2-only children hang below), an L1
  eviction backs the node up first, synchronously.
* A backup not waited for keeps its node locked on L1 and pinned on L2 until :meth:`Tiers.reap` folds it in;
  then its L2 pages go to the L3 writeback queue, the path pinned until they are written.
* Pages a request holds are never freed here: locked (L1) or pinned (L2) nodes are not evicted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence

import numpy as np

from hicache.cache_types import CacheFullError, Request
from hicache.config import ConfigError, HiCacheConfig
from hicache.metrics import Metrics
from hicache.pool import DevicePool, HostMemoryError, HostPool, default_block_pages, format_bytes
from hicache.radix import EMPTY, RadixTree, TreeNode
from hicache.storage.writeback import Writeback
from hicache.tenants import TenantShares
from hicache.transfer import TransferEngine, TransferHandle, create_engine

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


def make_pools(config: HiCacheConfig, device_pool: DevicePool | None) -> tuple[DevicePool, HostPool, TransferEngine]:
    """The L1 pool (``device_pool`` when given, of the config's layout), the L2 pool and the transfer engine
    between them, per ``cache.device`` / ``cache.io_backend``."""
    layout = config.layout.to_layout()
    c = config.cache
    if device_pool is not None and device_pool.layout != layout:
        raise ValueError("device_pool: layout differs from the config's layout")
    device_pool = device_pool or DevicePool(layout, config.l1_pages, c.device)
    # On a GPU the CUDA transfer engine page-locks the host pool in place (cudaHostRegister) and
    # unregisters it on close, so the whole L2 is pinned once, without torch's caching allocator.
    pin = False if (c.device.startswith("cuda") and c.io_backend != "cpu") else None
    try:
        host_pool = HostPool(layout, max(config.l2_pages, 1), c.host_layout,  # type: ignore[arg-type]
                             pin_memory=pin, block_pages=c.host_block_pages)
    except HostMemoryError as e:
        raise l2_too_large(config, e) from None
    io = c.io_backend
    if io in ("kernel", "copy_engine", "staged"):
        transfer = create_engine("cuda", device_pool, host_pool, io_backend=io, **c.transfer_options)
    elif io == "auto" and device_pool.device.type == "cuda":
        transfer = create_engine("cuda", device_pool, host_pool, **c.transfer_options)
    else:  # the portable engine has nothing to tune
        transfer = create_engine("cpu", device_pool, host_pool)
    return device_pool, host_pool, transfer


class Tiers:
    """Allocation, eviction and copies between the tiers of one cache (under its tree lock)."""

    def __init__(self, config: HiCacheConfig, tree: RadixTree, device_pool: DevicePool, host_pool: HostPool,
                 transfer: TransferEngine, writeback: Writeback | None, metrics: Metrics,
                 tenants: TenantShares, lock: threading.RLock) -> None:
        self.tree = tree
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.transfer = transfer
        self.writeback = writeback
        self.metrics = metrics
        self.tenants = tenants
        self.lock = lock
        self.page_size = config.layout.page_size
        self.l2_pages = config.l2_pages
        self.has_l2 = config.l2_pages > 0
        self.write_policy = config.cache.write_policy
        # L1 -> L2 copies in flight: (handle, node, its page keys, its L2 pages) captured at submission
        self.backups: list[tuple[TransferHandle, TreeNode, list[bytes], np.ndarray]] = []
        self.l3_writing = 0  # pages pinned for L3 writeback

    def reap(self, wait: bool = False) -> None:
        """Fold in finished L1 -> L2 backups (all of them, with ``wait``): unlock the node, then hand its
        pages to L3 writeback."""
        still = []
        for item in self.backups:
            handle, node, keys, host = item
            if wait:
                handle.wait()
            if handle.done():
                self.tree.unlock(node)
                self.write_l3(node, keys, host)
                self.tree.unpin_host(node)
            else:
                still.append(item)
        self.backups = still

    def write_l3(self, node: TreeNode, keys: list[bytes], host: np.ndarray) -> None:
        """Queue ``keys``/``host`` (the L2 pages of ``node``, captured before any split) for L3; the
        path stays pinned until written, so a split of ``node`` meanwhile keeps both halves' pages."""
        if self.writeback is None:
            return
        self.tree.pin_host(node)
        n = len(keys)

        def done(written: int) -> None:
            """Writeback completion (its thread): unpin the path, count the ``written`` pages."""
            with self.lock:
                self.tree.unpin_host(node)
                self.l3_writing -= n
                self.metrics.backup_tokens.labels("l3").inc(written * self.page_size)

        self.l3_writing += n
        if not self.writeback.submit(keys, host, done):
            self.tree.unpin_host(node)
            self.l3_writing -= n
            self.metrics.writeback_dropped_pages.inc(n)

    def alloc_device(self, n: int) -> np.ndarray:
        """``n`` L1 pages, evicting as needed; :class:`CacheFullError` when they cannot be had."""
        pages = self.device_pool.allocator.alloc(n)
        if pages is None:
            self.reap()
            self.evict_device(n - self.device_pool.allocator.free_pages)
            pages = self.device_pool.allocator.alloc(n)
        if pages is None and self.backups:
            self.reap(wait=True)
            self.evict_device(n - self.device_pool.allocator.free_pages)
            pages = self.device_pool.allocator.alloc(n)
        if pages is None:
            raise CacheFullError(f"L1: need {n} pages, {self.device_pool.allocator.free_pages} free, "
                                 f"{self.tree.locked_device_pages} locked by requests in flight")
        return pages

    def alloc_host(self, n: int) -> np.ndarray | None:
        """``n`` L2 pages, evicting as needed; None without L2 or when they cannot be had."""
        if not self.has_l2:
            return None
        pages = self.host_pool.allocator.alloc(n)
        if pages is None:
            self.evict_host(n - self.host_pool.allocator.free_pages)
            pages = self.host_pool.allocator.alloc(n)
        return pages

    def free_host_locked(self, pages: np.ndarray) -> None:
        """Free L2 pages from any thread (a prefetch task's): takes the tree lock."""
        with self.lock:
            self.host_pool.allocator.free(pages)

    def evict_device(self, n: int, backup: Callable[[TreeNode], bool] | None = None,
                     only: Collection[bytes] | None = None) -> int:
        """Evict at least ``n`` L1 pages if it can (of the namespaces ``only``, when given); returns pages
        freed. ``backup(node)``: the eviction hook (default: back up per write policy)."""
        freed = self.tree.evict_device(n, self._backup_on_evict if backup is None else backup,
                                       self.tenants.caps(self.device_pool.num_pages, self.tree.roots), only)
        total = sum(len(f) for f in freed)
        for f in freed:
            self.device_pool.allocator.free(f)
        self.metrics.evicted_tokens.labels("l1").inc(total * self.page_size)
        return total

    def evict_host(self, n: int, only: Collection[bytes] | None = None) -> int:
        """Evict at least ``n`` L2 pages if it can (of the namespaces ``only``, when given); returns pages freed."""
        freed = self.tree.evict_host(n, self.tenants.caps(self.l2_pages, self.tree.roots), only)
        total = sum(len(f) for f in freed)
        for f in freed:
            self.host_pool.allocator.free(f)
        self.metrics.evicted_tokens.labels("l2").inc(total * self.page_size)
        return total

    def clear(self, only: Collection[bytes] | None) -> tuple[int, int]:
        """Drop every L1 and L2 page nothing holds (of the namespaces ``only``, when given), backing nothing
        up; backups in flight are finished first. Returns the pages freed on (L1, L2)."""
        self.reap(wait=True)
        l1 = l2 = 0
        while True:  # dropping L2-only leaves lets their L1 parents go, and the other way round
            a = self.evict_device(self.device_pool.num_pages, backup=lambda node: False, only=only)
            b = self.evict_host(self.l2_pages, only) if self.has_l2 else 0
            l1, l2 = l1 + a, l2 + b
            if a == 0 and b == 0:
                return l1, l2

    def _backup_on_evict(self, node: TreeNode) -> bool:
        if self.write_policy != "write_back" and not node.children:
            return False
        return self.backup(node, wait=True)

    def backup(self, node: TreeNode, wait: bool) -> bool:
        """Copy ``node``'s L1 pages to fresh L2 pages (no-op without L2, or when it has an L2 copy or no L1
        pages); returns whether a copy was started. Without ``wait``, :meth:`reap` finishes it."""
        if node.host is not None or node.device is None or not self.has_l2:
            return False
        host = self.alloc_host(node.n_pages)
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
            self.write_l3(node, keys, host)
        else:
            self.tree.lock(node)  # until the copy is done
            self.tree.pin_host(node)
            self.backups.append((handle, node, keys, host))
        return True

    def back_up_path(self, node: TreeNode | None, min_hits: int = 0) -> int:
        """Start a backup of every node of ``node``'s path without an L2 copy and hit at least ``min_hits``
        times; returns the pages being backed up."""
        backed = 0
        while node is not None and node.parent is not None:
            if node.host is None and node.hit_count >= min_hits and self.backup(node, wait=False):
                backed += node.n_pages
            node = node.parent
        return backed

    def load(self, l1_node: TreeNode | None, nodes: Sequence[TreeNode], n: int,
             layer_wise: bool) -> tuple[np.ndarray, TransferHandle]:
        """Start L2 -> L1 of ``nodes`` (``n`` pages, the L2 run continuing ``l1_node``'s path) into fresh L1
        pages, which become theirs; :class:`CacheFullError` when no room can be made."""
        self.tree.lock(l1_node)  # the prefix stays while the allocation evicts
        self.tree.pin_host(nodes[-1])
        try:
            dev = self.alloc_device(n)
        finally:
            self.tree.unpin_host(nodes[-1])
            self.tree.unlock(l1_node)
        host = np.concatenate([x.host for x in nodes if x.host is not None])
        t1 = time.perf_counter()
        handle = self.transfer.load(host, dev, layer_wise=layer_wise)
        self.metrics.transfer_submit["load"].observe(time.perf_counter() - t1)
        off = 0
        for x in nodes:
            self.tree.set_device(x, dev[off: off + x.n_pages], handle)
            off += x.n_pages
        return dev, handle

    def loads_on_path(self, node: TreeNode) -> list[TransferHandle]:
        """L2 -> L1 loads still writing the device pages of ``node``'s path."""
        out: list[TransferHandle] = []
        x: TreeNode | None = node
        while x is not None and x.parent is not None:
            h = x.load_handle
            if h is not None and not h.done() and h not in out:
                out.append(h)
            x = x.parent
        return out

    def path_device(self, node: TreeNode) -> np.ndarray:
        """The L1 pages of ``node``'s path, root first."""
        parts = []
        x: TreeNode | None = node
        while x is not None and x.parent is not None:
            assert x.device is not None
            parts.append(x.device)
            x = x.parent
        return np.concatenate(parts[::-1]) if parts else EMPTY

    def check_integrity(self, requests: Sequence[Request]) -> None:
        """free + cached + in flight == capacity on both pools, and the tree's invariants hold; the pages
        ``requests`` own (L1) or prefetch into (L2) count as in flight."""
        self.tree.check_invariants()
        self.device_pool.allocator.check_integrity()
        self.host_pool.allocator.check_integrity()
        cached = self.tree.all_device_pages()
        owned = [p for r in requests for p in r.owned_device]
        inflight = np.concatenate(owned) if owned else EMPTY
        held = np.concatenate([cached, inflight])
        assert len(np.unique(held)) == len(held), "an L1 page is held twice"
        alloc = self.device_pool.allocator.allocated()
        assert np.array_equal(np.sort(held), alloc), f"L1: {len(held)} cached+in flight vs {len(alloc)} allocated"
        host_cached = self.tree.all_host_pages()
        assert len(np.unique(host_cached)) == len(host_cached), "an L2 page is held twice"
        prefetching = [r.prefetch.host_pages for r in requests if r.prefetch is not None]
        host_held = np.concatenate([host_cached, *prefetching]) if prefetching else host_cached
        host_alloc = self.host_pool.allocator.allocated()
        if self.has_l2:
            assert np.array_equal(np.sort(host_held), host_alloc), (
                f"L2: {len(host_held)} cached+in flight vs {len(host_alloc)} allocated")
