"""``cache.tenant_shares`` under concurrency: engine threads of several tenants (named, ``"*"``, ``""``)
match, prefetch, load, commit, pin and release against one small cache whose L1 and L2 are always
full, while a scraper collects ``/metrics`` (``hicache_tenant_pages`` walks the tree under the tree
lock), a maintenance thread evicts and clears, and passers-by (tenants that only look up) churn the
cache's memory of tenants (TENANT_MEMORY made tiny).

No thread raises, every page handed to an engine holds the K/V its prefix computes (bit for bit, as the
soak of tests/test_soak_inproc.py checks), and when it is over the tree and pools are whole, nothing is
locked or pinned, and the tenant gauges equal the pages each tenant holds.
"""

from __future__ import annotations

import contextlib
import random
import threading
import traceback
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import generate_latest
from soakkit import PageModel, run_threads

import hicache.tenants as tenants_mod
from hicache.cache import CacheFullError, HiCache, Request
from hicache.config import config_from_dict

PS = 4
LAYERS, HEADS, DIM = 2, 2, 4
L1_PAGES, L2_PAGES = 24, 48
SHARES = {"t0": 0.25, "t1": 0.5, "": 0.2, "*": 0.3}
TENANTS = ("", "t0", "t1", "t2", "t3")  # t2, t3: "*"
ENGINES = 4
RUN_S = 3.0
MODEL = PageModel((LAYERS, 2, PS, HEADS, DIM), np.float32)


class Run:
    def __init__(self, cache: HiCache, seed: int) -> None:
        self.cache = cache
        self.ns = {t: cache.namespace(t) for t in TENANTS}
        rng = random.Random(seed)
        self.prefixes = [[rng.randrange(1, 50_000) for _ in range(rng.choice([2, 3, 4]) * PS)] for _ in range(6)]
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.done = {"requests": 0, "verified": 0, "full": 0, "scrapes": 0, "passers": 0}

    def count(self, **d: int) -> None:
        with self.lock:
            for k, v in d.items():
                self.done[k] += v

    def guarded(self, name: str, body: Callable[[], None]) -> Callable[[], None]:
        """``body`` in a loop until the run stops; an exception is recorded and stops the run."""

        def run() -> None:
            try:
                while not self.stop.is_set():
                    body()
            except BaseException:
                self.errors.append(f"{name}:\n{traceback.format_exc()}")
                self.stop.set()
        return run

    # ------------------------------------------------------------------ engines
    def request(self, rng: random.Random, pins: list[int]) -> None:
        cache = self.cache
        tenant = rng.choice(TENANTS)
        toks = list(rng.choice(self.prefixes))
        toks += [rng.randrange(1, 50_000) for _ in range(rng.choice([0, 1, 2, 3]) * PS)]
        tokens = np.asarray(toks, dtype=np.uint32)
        req = cache.match(tokens, self.ns[tenant])
        try:
            self.compute(rng, req, tenant, tokens)
        except CacheFullError:
            self.count(full=1)
        finally:
            cache.release(req)
        if rng.random() < 0.05:
            if pins and (len(pins) >= 2 or rng.random() < 0.5):
                cache.unpin(pins.pop(0))
            else:
                with contextlib.suppress(ValueError, CacheFullError):  # nothing cached, or pins hold enough
                    pins.append(cache.pin(rng.choice(self.prefixes), self.ns[rng.choice(TENANTS)]).pin_id)

    def compute(self, rng: random.Random, req: Request, tenant: str, tokens: np.ndarray) -> None:
        cache = self.cache
        cache.prefetch(req)
        load = cache.load_back(req)
        load.wait()
        dev = load.device_indices
        MODEL.check(cache.device_pool.kv, dev, tenant, tokens, "hit")
        new = cache.alloc(req, len(tokens) // PS - len(dev))
        MODEL.write(cache.device_pool.kv, new, tenant, tokens, len(dev))
        cache.commit(req, tokens, np.concatenate([dev, new]))
        MODEL.check(cache.device_pool.kv, req.device_indices, tenant, tokens, "after commit")
        self.count(requests=1, verified=len(dev))

    def engine(self, tid: int) -> Callable[[], None]:
        rng = random.Random(tid)
        pins: list[int] = []

        def body() -> None:
            try:
                self.request(rng, pins)
            finally:
                if self.stop.is_set():
                    while pins:
                        self.cache.unpin(pins.pop())
        return self.guarded(f"engine {tid}", body)

    # ------------------------------------------------------------------ the others
    def scraper(self) -> None:
        generate_latest(self.cache.metrics.registry)  # runs _refresh_metrics: the tree walk of tenant_pages
        pages = self.cache.tenant_pages()
        assert set(pages) == {"t0", "t1", ""}
        assert all(0 <= l1 <= L1_PAGES and 0 <= l2 <= L2_PAGES for l1, l2 in pages.values()), pages
        self.count(scrapes=1)

    def passer_by(self) -> None:
        n = self.done["passers"]
        req = self.cache.match(self.prefixes[n % len(self.prefixes)], self.cache.namespace(f"p{n}"), l3=False)
        self.cache.release(req)
        self.count(passers=1)
        self.stop.wait(0.002)

    def maintenance(self, rng: random.Random) -> Callable[[], None]:
        def body() -> None:
            if self.stop.wait(0.03):
                return
            r = rng.random()
            if r < 0.1:
                self.cache.clear()
            elif r < 0.5:
                self.cache.evict(l1_pages=rng.randrange(1, 8), l2_pages=rng.randrange(0, 8))
            if rng.random() < 0.3:
                with self.cache._lock:
                    self.cache.tree.check_invariants()
        return body


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_tenant_shares_under_concurrent_requests_scrapes_and_evictions(write_policy: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenants_mod, "TENANT_MEMORY", 2)
    cache = HiCache(config_from_dict({
        "layout": {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM, "dtype": "float32",
                   "page_size": PS},
        "cache": {"l1_tokens": L1_PAGES * PS, "l2_tokens": L2_PAGES * PS, "write_policy": write_policy,
                  "eviction_policy": "reuse_lru", "tenant_shares": SHARES},
        "storage": {"url": "memory://", "prefetch_threshold_tokens": 0, "prefetch_policy": "wait_complete"},
    }))
    try:
        run = Run(cache, seed=11)
        targets = [(f"engine-{i}", run.engine(i)) for i in range(ENGINES)]
        targets += [("scraper", run.guarded("scraper", run.scraper)),
                    ("passer-by", run.guarded("passer-by", run.passer_by)),
                    ("maintenance", run.guarded("maintenance", run.maintenance(random.Random(5))))]
        run_threads(targets, run.stop, run.errors, RUN_S)
        summary = str(run.done)
        print(summary)
        assert run.done["requests"] >= 100 and run.done["verified"] >= 100, summary
        assert run.done["scrapes"] >= 10 and run.done["passers"] >= 50, summary

        report = cache.flush(timeout_s=10)
        assert report is not None and report.complete, report
        cache.check_integrity()
        assert cache.pins() == [] and cache.tree.locked_device_pages == 0
        for node in cache.tree.nodes():
            assert node.lock_ref == 0 and node.host_pin == 0, node
        # every namespace in the tree with a share is remembered, however many passers-by came since
        roots, known = cache.tree.roots, cache._tenant_of
        forgotten = [t for t, ns in run.ns.items() if ns.digest in roots and ns.digest not in known]
        assert forgotten == [], f"tenants holding pages were forgotten: {forgotten}"
        # the gauges at a scrape are each named tenant's pages, counted node by node
        want = {t: [0, 0] for t in ("t0", "t1", "")}
        for t in want:
            root = cache.tree.roots.get(run.ns[t].digest)
            stack = list(root.children.values()) if root is not None else []
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                want[t][0] += node.n_pages if node.device is not None else 0
                want[t][1] += node.n_pages if node.host is not None else 0
        generate_latest(cache.metrics.registry)
        reg = cache.metrics.registry
        got = {t: [int(reg.get_sample_value("hicache_tenant_pages", {"tenant": t, "tier": tier}) or 0)
                   for tier in ("l1", "l2")] for t in want}
        assert got == want
        assert reg.get_sample_value("hicache_tenant_share", {"tenant": "t1"}) == 0.5

        cache.evict(l1_pages=10**6)
        cache.flush(timeout_s=10)
        cache.evict(l2_pages=10**6)
        assert cache.device_pool.allocator.used_pages == 0 and cache.host_pool.allocator.used_pages == 0
        cache.check_integrity()
    finally:
        cache.close()
