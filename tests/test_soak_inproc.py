"""Concurrency soak test of the in-process cache: a cache hit never changes what the model computes.

Several engine threads share one :class:`hicache.cache.HiCache` whose L1 and L2 hold only tens of pages
and whose L3 is a real store, so pages move between the tiers all the time: evicted from L1 (dropped, or
downgraded to their L2 copy), backed up L1 -> L2 by the write policy, written L2 -> L3 in the background,
fetched L3 -> L2 and loaded L2 -> L1 again. Prompts are a few shared prefixes (two tenants) followed by
suffixes that are sometimes shared and sometimes new, so requests contend for the same pages. Some
requests commit twice (decoding filled more pages), and a few are abandoned: released right after they
started their L3 prefetch or their L2 -> L1 load, as when a client goes away or a batch fails.

The "model" is a pure function: the K/V bytes of page ``p`` of a prompt depend only on the tenant and on
the tokens of pages ``0..p`` (a seeded RNG on a hash of them), as a real model's K/V depend only on the
prefix they attend to. The engine writes exactly those bytes into the pages it computes, and on every hit
(L1, L2 -> L1 load, L3 prefetch) reads the pages it was handed -- only once the cache says they are
readable: layer ``i`` after ``wait_layer(i)`` -- and checks them against the function. A maintenance
thread meanwhile evicts, clears and checks every stable page of the tree under the tree lock.

At the end: the tree's and the pools' invariants hold (``check_integrity``), nothing is locked or pinned,
the hit counters equal what the engines observed, every page left on L1, L2 and L3 holds its prefix's
bytes, and a minimum number of hits per tier was verified, so the test cannot pass vacuously.
"""

from __future__ import annotations

import random
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from soakkit import Counters, PageModel, run_threads

from hicache.accounting import L2_UNSERVED_REASONS
from hicache.accounting import L3_UNSERVED_REASONS as UNSERVED_REASONS
from hicache.cache import CacheFullError, HiCache, Request
from hicache.config import config_from_dict
from hicache.pool import HostPool
from hicache.radix_types import TreeNode
from hicache.storage.redis_local import LocalRedis, redis_server_binary

PS = 4  # tokens per page
LAYERS, HEADS, DIM = 2, 2, 4  # K and V of one page of one layer: [PS, HEADS, DIM] float32 = 128 bytes
L1_PAGES, L2_PAGES = 40, 64
THREADS = 5
SOAK_S = 2.5  # seconds each variant drives the cache
TENANTS = ("", "acme")  # "" is the config's default namespace
SEED = 20240611


# ---------------------------------------------------------------------------------------------- the model
MODEL = PageModel((LAYERS, 2, PS, HEADS, DIM), np.float32)
expected_page, expected_pages, page_prefix = MODEL.page, MODEL.pages, MODEL.prefix


def write_pages(cache: HiCache, pages: np.ndarray, tenant: str, tokens: np.ndarray, first: int) -> None:
    """What the engine's forward pass does: fill the L1 pages it was allocated with the pages' K/V."""
    MODEL.write(cache.device_pool.kv, pages, tenant, tokens, first)


def check_l1(cache: HiCache, pages: np.ndarray, tenant: str, tokens: np.ndarray, what: str,
             layers: range = range(LAYERS)) -> None:
    """Assert L1 pages ``pages`` (pages ``0..`` of ``tokens``) hold the model's K/V in ``layers``."""
    MODEL.check(cache.device_pool.kv, pages, tenant, tokens, what, layers)


def host_page_array(pool: HostPool, page: int) -> np.ndarray:
    return np.frombuffer(pool.page_bytes(page), dtype=np.float32).reshape(LAYERS, 2, PS, HEADS, DIM)


# ---------------------------------------------------------------------------------------------- prompts
@dataclass
class Prompts:
    """A small set of shared prefixes (used under every tenant), suffixes from a small shared pool or made up."""

    prefixes: list[list[int]] = field(default_factory=list)
    suffixes: list[list[int]] = field(default_factory=list)

    @classmethod
    def make(cls, seed: int) -> Prompts:
        rng = random.Random(seed)
        p = cls()
        p.prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.choice([2, 3, 4, 5]) * PS)] for _ in range(5)]
        p.suffixes = [[rng.randrange(1, 50_000) for _ in range(rng.choice([1, 2]) * PS)] for _ in range(6)]
        return p

    def draw(self, rng: random.Random) -> np.ndarray:
        toks = list(rng.choice(self.prefixes))
        r = rng.random()
        if r < 0.45:
            toks += rng.choice(self.suffixes)
        elif r < 0.8:
            toks += [rng.randrange(1, 50_000) for _ in range(rng.choice([1, 2, 3]) * PS)]
        toks += [rng.randrange(1, 50_000) for _ in range(rng.randrange(PS))]  # partial page: never cached
        return np.asarray(toks, dtype=np.uint32)


# ---------------------------------------------------------------------------------------------- bookkeeping
@dataclass
class Tally(Counters):
    """What the engines saw (summed over threads under ``lock``)."""

    lookups: int = 0
    lookup_pages: int = 0
    hit_l1: int = 0  # pages per tier as match reported them (for L1, what the hit counter counts)
    hit_l2: int = 0  # L2 pages the matches reported (served or not)
    served_l2: int = 0  # of which in the request's prefix after its load back (what hit{l2} counts)
    hit_l3: int = 0  # L3 pages the matches reported (served or not)
    loaded_l2: int = 0  # load_back's l2_pages (L2 -> L1, including prefetched L3 pages)
    loaded_l3: int = 0  # of which came from L3
    verified_l1: int = 0  # hit pages read back and checked, by the tier they came from
    verified_l2: int = 0
    verified_l3: int = 0
    verified_reused: int = 0  # pages a commit handed back from another request's copy, checked
    computed: int = 0
    full: int = 0  # requests given up on CacheFullError
    full_in_load: int = 0  # of which in load_back
    full_in_load_l3: int = 0  # the L3 runs (at most what they prefetched) of those
    abandoned: int = 0  # requests released without waiting for their prefetch or load
    pins: int = 0
    clears: int = 0
    audits: int = 0
    audited_pages: int = 0
    keys: dict[bytes, tuple[str, bytes]] = field(default_factory=dict)  # L3 page key -> (tenant, prefix)



class Soak:
    def __init__(self, cache: HiCache, seed: int) -> None:
        self.cache = cache
        self.prompts = Prompts.make(seed)
        self.seed = seed
        self.tally = Tally()
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.ns = {t: cache.namespace(t or None) for t in TENANTS}
        self.tenant_of = {ns.digest: t for t, ns in self.ns.items()}

    # ------------------------------------------------------------------ one engine request
    def request(self, rng: random.Random, pins: list[int]) -> None:
        cache, t = self.cache, self.tally
        tenant = rng.choice(TENANTS)
        tokens = self.prompts.draw(rng)
        # now and then a lookup that skips the store and the page keys (commit hashes them)
        cheap = rng.random() < 0.1
        req = cache.match(tokens, self.ns[tenant], l3=not cheap, keys=not cheap)
        t.add(lookups=1, lookup_pages=req.num_pages, hit_l1=req.l1_pages, hit_l2=req.l2_pages, hit_l3=req.l3_pages)
        for i, k in enumerate(req.keys):
            t.keys.setdefault(k, (tenant, page_prefix(tokens, i)))
        try:
            self.compute(rng, req, tenant, tokens)
        except CacheFullError:
            t.add(full=1)  # every L1 page is locked by requests in flight: a real engine would queue it
        finally:
            cache.release(req)
        if rng.random() < 0.04:
            self.pin(rng, pins)

    def compute(self, rng: random.Random, req: Request, tenant: str, tokens: np.ndarray) -> None:
        cache, t = self.cache, self.tally
        if req.l2_pages == 0 and req.l3_pages == 0 and rng.random() < 0.3:
            # An L1-only hit used without load_back: its pages are readable once the loads they depend
            # on (``req.pending``: another request's L2 -> L1 load of them) have landed.
            for h in req.pending:
                h.wait()
            dev = req.device_indices
            check_l1(cache, dev, tenant, tokens, "L1 hit (no load_back)")
            t.add(verified_l1=len(dev))
        else:
            if rng.random() < 0.9:
                cache.prefetch(req)
                if rng.random() < 0.03:
                    t.add(abandoned=1)  # the client went away while its L3 pages were being fetched
                    return
            try:
                load = cache.load_back(req, layer_wise=rng.random() < 0.7)
            except CacheFullError:
                # the prefetched pages entered the tree (and were counted) before the L1 allocation failed
                t.add(full_in_load=1, full_in_load_l3=req.l3_pages)
                raise
            t.add(loaded_l2=load.l2_pages, loaded_l3=load.l3_pages,
                  served_l2=min(req.l2_pages, max(0, len(load.device_indices) - req.l1_pages)))
            if load.l2_pages and rng.random() < 0.05:
                t.add(abandoned=1)  # the client went away while its L2 -> L1 load was in flight
                return
            dev = load.device_indices
            # layer by layer, as a forward pass reads them: layer i only after wait_layer(i)
            for layer in range(LAYERS):
                load.wait_layer(layer)
                check_l1(cache, dev, tenant, tokens, "hit after load_back", range(layer, layer + 1))
            from_l3 = load.l3_pages
            t.add(verified_l1=min(req.l1_pages, len(dev)), verified_l3=from_l3,
                  verified_l2=max(0, len(dev) - req.l1_pages - from_l3))
        self.extend(rng, req, tenant, tokens, dev)
        if rng.random() < 0.2:
            # decode went on past a page boundary: the same request commits its longer sequence
            more = [rng.randrange(1, 50_000) for _ in range(rng.choice([1, 2]) * PS)]
            tokens = np.concatenate([tokens, np.asarray(more, dtype=np.uint32)])
            self.extend(rng, req, tenant, tokens, req.device_indices)
        if rng.random() < 0.1:
            time.sleep(0.001)  # hold the request (and its locked pages) a little longer

    def extend(self, rng: random.Random, req: Request, tenant: str, tokens: np.ndarray, dev: np.ndarray) -> None:
        """Compute the pages of ``tokens`` after the ``dev`` prefix into new L1 pages and commit."""
        cache, t = self.cache, self.tally
        n_new = len(tokens) // PS - len(dev)
        new = cache.alloc(req, n_new)
        write_pages(cache, new, tenant, tokens, len(dev))
        if rng.random() < 0.3:
            time.sleep(0.0005)  # a slower forward pass: others run meanwhile
        res = cache.commit(req, tokens, np.concatenate([dev, new]))
        # After commit the request holds the tree's pages for its whole prompt: where another request
        # committed the same pages first, those (not ours) -- they must hold the same bytes.
        assert len(req.device_indices) == len(tokens) // PS
        check_l1(cache, req.device_indices, tenant, tokens, "after commit")
        t.add(computed=n_new, verified_reused=res.reused_pages)
        for i, k in enumerate(req.keys):
            t.keys.setdefault(k, (tenant, page_prefix(tokens, i)))

    def pin(self, rng: random.Random, pins: list[int]) -> None:
        if len(pins) >= 2 or (pins and rng.random() < 0.5):
            self.cache.unpin(pins.pop(0))
            return
        tenant = rng.choice(TENANTS)
        try:
            pins.append(self.cache.pin(rng.choice(self.prompts.prefixes), self.ns[tenant]).pin_id)
            self.tally.add(pins=1)
        except (ValueError, CacheFullError):
            pass  # nothing of it cached now, or pins already hold their share of a tier

    # ------------------------------------------------------------------ threads
    def engine(self, tid: int) -> None:
        rng = random.Random(self.seed * 100 + tid)
        pins: list[int] = []
        try:
            while not self.stop.is_set():
                self.request(rng, pins)
        except BaseException:
            self.errors.append(f"engine {tid}:\n{traceback.format_exc()}")
            self.stop.set()
        finally:
            for p in pins:
                self.cache.unpin(p)

    def maintenance(self) -> None:
        rng = random.Random(self.seed)
        try:
            while not self.stop.wait(0.05):
                r = rng.random()
                if r < 0.15:
                    self.cache.clear()
                    self.tally.add(clears=1)
                elif r < 0.35:
                    self.cache.evict(l1_pages=rng.randrange(1, 12), l2_pages=rng.randrange(0, 12))
                elif r < 0.45:
                    self.cache.flush(timeout_s=5)
                if rng.random() < 0.3:
                    self.audit()
        except BaseException:
            self.errors.append(f"maintenance:\n{traceback.format_exc()}")
            self.stop.set()

    def run(self, seconds: float) -> None:
        run_threads([*((f"engine-{i}", lambda i=i: self.engine(i)) for i in range(THREADS)),
                     ("maintenance", self.maintenance)], self.stop, self.errors, seconds)

    # ------------------------------------------------------------------ audits
    def tree_nodes(self) -> Iterator[tuple[str, bytes, TreeNode]]:
        """(tenant, tokens from the root to the node's end, node) for every node, parents first."""
        for digest, root in self.cache.tree.roots.items():
            tenant = self.tenant_of[digest]
            stack: list[tuple[bytes, TreeNode]] = [(b"", c) for c in root.children.values()]
            while stack:
                before, node = stack.pop()
                toks = before + node.key
                yield tenant, toks, node
                stack.extend((toks, c) for c in node.children.values())

    def audit(self) -> None:
        """Under the tree lock (nothing moves): every stable page of the tree, L1 and L2, holds the
        model's K/V for its prefix. Pages still being written by a copy in flight are skipped: L1 pages
        of a node whose L2 -> L1 load has not landed, L2 pages an L1 -> L2 backup is still writing (by page:
        a node split while its backup is in flight leaves part of those pages to the new upper node)."""
        cache = self.cache
        n = 0
        with cache._lock:
            backing_up = {int(h) for _, _, _, host in cache._backups for h in host}
            for tenant, toks, node in self.tree_nodes():
                tokens = np.frombuffer(toks, dtype="<u4")
                first = len(toks) // (4 * PS) - node.n_pages
                want = expected_pages(tenant, tokens, first, node.n_pages)
                loading = node.load_handle is not None and not node.load_handle.done()
                if node.device is not None and not loading:
                    idx = torch.from_numpy(node.device)
                    for layer in range(LAYERS):
                        for c in range(2):
                            got = cache.device_pool.kv[layer][c][idx].numpy()
                            assert np.array_equal(got.view(np.uint32), want[:, layer, c].view(np.uint32)), (
                                f"audit: L1 pages {node.device.tolist()} of {node} (pages {first}..) hold "
                                f"wrong bytes in layer {layer}")
                    n += node.n_pages
                if node.host is not None:
                    for i, h in enumerate(node.host):
                        if int(h) in backing_up:
                            continue
                        assert np.array_equal(host_page_array(cache.host_pool, int(h)).view(np.uint32),
                                              want[i].view(np.uint32)), (
                            f"audit: L2 page {int(h)} (page {first + i}) of {node} holds wrong bytes")
                        n += 1
        self.tally.add(audits=1, audited_pages=n)

    def audit_l3(self) -> int:
        """Every page the store has under a key the engines saw holds the model's K/V for that key's
        prefix (read through the backend, which also verifies the frame). Returns pages checked."""
        store = self.cache.storage
        assert store is not None
        scratch = HostPool(self.cache.layout, 1)
        n = 0
        for key, (tenant, prefix) in self.tally.keys.items():
            if store.batch_get([key], scratch, [0]) == 1:
                want = expected_page(tenant, prefix)
                assert np.array_equal(host_page_array(scratch, 0).view(np.uint32), want.view(np.uint32)), (
                    f"L3 page {key.hex()[:16]} holds wrong bytes")
                n += 1
        return n


# ---------------------------------------------------------------------------------------------- the test
@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    if redis_server_binary() is None:
        pytest.skip("redis-server is not installed")
    with LocalRedis() as r:
        yield r.url


VARIANTS = [  # (store, write policy, L2 layout, eviction policy, prefetch policy, L3 compression)
    pytest.param("memory", "write_through", "page_first", "reuse_lru", "wait_complete", "none", id="memory"),
    pytest.param("file", "write_through_selective", "layer_first", "lru", "timeout", "none", id="file"),
    pytest.param("file", "write_back", "block_first", "arc", "wait_complete", "zstd", id="file-write_back-zstd"),
    pytest.param("redis", "write_through_selective", "page_first", "reuse_lru", "timeout", "zstd", id="redis-zstd",
                 marks=pytest.mark.redis),
]


@pytest.mark.parametrize(("store", "write_policy", "host_layout", "eviction", "prefetch", "compression"), VARIANTS)
def test_concurrent_hits_never_change_the_kv(store: str, write_policy: str, host_layout: str, eviction: str,
                                             prefetch: str, compression: str, tmp_path: Path,
                                             request: pytest.FixtureRequest) -> None:
    url: str
    options: dict[str, Any] = {}
    if store == "memory":
        url = "memory://"
    elif store == "file":
        url = f"file://{tmp_path / 'l3'}"
    else:
        url = request.getfixturevalue("redis_url")
        options = {"prefix": f"soak{uuid.uuid4().hex[:8]}:"}
    cfg = config_from_dict({
        "layout": {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM, "dtype": "float32",
                   "page_size": PS},
        "cache": {"l1_tokens": L1_PAGES * PS, "l2_tokens": L2_PAGES * PS, "write_policy": write_policy,
                  "host_layout": host_layout, "host_block_pages": 4, "eviction_policy": eviction},
        "storage": {"url": url, "options": options, "prefetch_threshold_tokens": 0, "prefetch_policy": prefetch,
                    "compression": compression,
                    "io_batch_pages": 4},
    })
    cache = HiCache(cfg)
    try:
        soak = Soak(cache, SEED)
        soak.run(SOAK_S)
        t = soak.tally

        # quiescent: nothing is locked, pinned or in flight
        report = cache.flush(timeout_s=10)
        assert report is not None and report.complete, report
        cache.check_integrity()
        assert cache.pins() == [] and cache.tree.locked_device_pages == 0
        for _, _, node in soak.tree_nodes():
            assert node.lock_ref == 0 and node.host_pin == 0, node
        assert cache._prefetch_inflight_bytes == 0 and cache._l3_writing == 0 and not cache._backups
        assert cache.prefetcher is not None and cache.prefetcher.live_tasks == 0
        assert cache.device_pool.allocator.used_pages == cache.tree.device_pages  # no request owns a page
        assert cache.host_pool.allocator.used_pages == cache.tree.host_pages

        # the counters say what the engines saw
        reg = cache.metrics.registry

        def val(name: str, **labels: str) -> int:
            return int(reg.get_sample_value(name, labels or None) or 0)

        assert val("hicache_lookups_total") == t.lookups
        assert val("hicache_lookup_tokens_total") == t.lookup_pages * PS
        hits = {tier: val("hicache_hit_tokens_total", tier=tier) for tier in ("l1", "l2", "l3")}
        # l2, l3: tokens served (as the load backs reported them), of those the matches found there; every
        # request is released, so each matched token is served or counted unserved once
        assert hits == {"l1": t.hit_l1 * PS, "l2": t.served_l2 * PS, "l3": t.loaded_l3 * PS}
        unserved = sum(val("hicache_l2_unserved_tokens_total", reason=r) for r in L2_UNSERVED_REASONS)
        assert t.hit_l2 * PS == hits["l2"] + unserved
        unserved = sum(val("hicache_l3_unserved_tokens_total", reason=r) for r in UNSERVED_REASONS)
        assert val("hicache_l3_matched_tokens_total") == t.hit_l3 * PS == hits["l3"] + unserved
        assert sum(hits.values()) <= t.lookup_pages * PS
        assert val("hicache_loadback_tokens_total") == t.loaded_l2 * PS
        prefetched = val("hicache_prefetch_tokens_total")
        # a prefetched page counts once, when it enters L2 (two requests fetching the same run: once), so
        # L2 holds what backups and prefetches put there less what was evicted
        assert prefetched <= (t.loaded_l3 + t.full_in_load_l3) * PS, (prefetched, t)
        assert cache.tree.host_pages * PS == (val("hicache_backed_up_tokens_total", tier="l2") + prefetched
                                              - val("hicache_evicted_tokens_total", tier="l2"))
        st = cache.storage.stats() if cache.storage is not None else None
        assert st is not None and st.corrupt_pages == 0 and st.errors == 0
        assert st.gets >= t.loaded_l3
        if compression != "none":  # compressed frames were written (and read back, verified, above)
            assert 0 < st.stored_bytes_written < st.bytes_written, st

        # every page left anywhere holds its prefix's bytes
        soak.audit()
        l3_checked = soak.audit_l3()

        # the test really exercised every tier (cannot pass by never hitting)
        summary = (f"{t.lookups} requests, verified hits L1 {t.verified_l1} / L2 {t.verified_l2} / "
                   f"L3 {t.verified_l3} pages, {t.verified_reused} reused at commit, {t.computed} computed, "
                   f"{t.full} full, {t.abandoned} abandoned, {t.pins} pins, {t.clears} clears, {t.audits} audits "
                   f"({t.audited_pages} pages), {l3_checked} L3 pages checked, {st.sets} L3 writes")
        print(summary)
        assert t.lookups >= 200, summary
        assert t.verified_l1 >= 300, summary
        assert t.verified_l2 >= 50, summary
        assert t.verified_l3 >= 20, summary
        assert t.audits >= 3 and l3_checked >= 20, summary

        # everything can still be dropped: nothing leaked
        cache.evict(l1_pages=10**6)  # under write_back this backs pages up and queues their L3 writes
        cache.flush(timeout_s=10)
        cache.evict(l2_pages=10**6)
        assert cache.device_pool.allocator.used_pages == 0
        assert cache.host_pool.allocator.used_pages == 0
        cache.check_integrity()
    finally:
        cache.close()


def test_pages_still_loading_are_not_reused_after_an_early_release() -> None:
    """The soak's "abandoned" requests, made deterministic.

    A request starts an L2 -> L1 load and is released before the load lands (its client went away,
    or the engine's batch failed between ``load_back`` and the forward pass). Nothing locks the loaded
    pages any more, so eviction may take them; it must not hand them to a new owner while the copy is
    still writing them, or the copy lands on top of what the new owner computed there.
    """
    cfg = config_from_dict({
        "layout": {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM, "dtype": "float32",
                   "page_size": PS},
        "cache": {"l1_tokens": 8 * PS, "l2_tokens": 16 * PS, "write_policy": "write_through"},
    })
    cache = HiCache(cfg)
    gate = threading.Event()
    try:
        a = np.arange(1, 4 * PS + 1, dtype=np.uint32)
        b = np.arange(1001, 1001 + 8 * PS, dtype=np.uint32)
        req = cache.match(a)
        pages = cache.alloc(req, 4)
        write_pages(cache, pages, "", a, 0)
        cache.commit(req, a, pages)
        cache.release(req)
        cache.flush()
        cache.evict(l1_pages=4)  # A is on L2 only now

        cache.transfer._queue.put(gate.wait)  # hold the CPU engine's copies (one worker, in order)
        req = cache.match(a)
        load = cache.load_back(req)  # A's L2 -> L1 load, queued behind the gate
        assert load.l2_pages == 4 and load.handle is not None and not load.handle.done()
        cache.release(req)  # before the load landed

        threading.Timer(0.3, gate.set).start()  # the copy lands a little later
        cache.evict(l1_pages=4)  # A's L1 pages are unlocked: evictable (once the copy is done with them)
        other = cache.match(b)
        new = cache.alloc(other, 8)  # every L1 page, A's former pages included
        write_pages(cache, new, "", b, 0)
        gate.set()
        cache.commit(other, b, new)
        cache.flush()  # every copy queued so far has run
        check_l1(cache, other.device_indices, "", b, "a new request's pages after a stale load")
        cache.release(other)

        again = cache.match(a)
        assert again.l2_pages == 4
        reload = cache.load_back(again)
        reload.wait()
        check_l1(cache, reload.device_indices, "", a, "A reloaded")
        cache.release(again)
        cache.check_integrity()
    finally:
        gate.set()
        cache.close()
