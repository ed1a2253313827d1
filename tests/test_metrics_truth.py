"""Every hicache_* metric tells the truth.

In-process caches (CPU, small pools, an L3 store: ``memory://`` or a file store) are driven through
scripted scenarios whose outcome is worked out here page by page, and after each step every counter must
have moved by exactly that much (no other counter at all) and every gauge must read exactly that value:
hits per tier, evictions per tier, loads, backups under each write policy, L3 writes, prefetches under each
prefetch policy (whole, cut short, cancelled by a release, refused), damaged L3 pages, a full writeback
queue, pins, clear and flush. A property test then runs random operation sequences and checks the
conservation laws the metrics obey against the cache's own state (tree, allocators, store,
``check_integrity``). Last, one real ``hicache serve``: its RPC counters and histograms, open requests and
rejections at ``serve.max_concurrency``, scraped over HTTP, against the calls made.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from metricskit import (
    Ledger,
    backed,
    diff,
    evicted,
    hits,
    key,
    l2_unserved,
    l3_run,
    loadback,
    lookups,
    merge,
    pools,
    samples,
    stalling_cache,
    storage,
)

from hicache.accounting import L2_UNSERVED_REASONS
from hicache.accounting import L3_UNSERVED_REASONS as UNSERVED_REASONS
from hicache.cache import HiCache, Request
from hicache.keys import page_keys_from_bytes, tokens_to_bytes
from hicache.storage.memory import MemoryBackend
from kvhelpers import commit_fresh, small_config, write_kv

P = 4  # tokens per page (small_config)
PAGES_L1, PAGES_L2 = 16, 32  # small_config's pools


@pytest.fixture
def caches() -> Iterator[list[HiCache]]:
    made: list[HiCache] = []
    yield made
    for c in made:
        c.close()


def new_cache(made: list[HiCache], store: str, tmp: Path, **sections: dict[str, Any]) -> HiCache:
    url = "memory://" if store == "memory" else f"file://{tmp / 'l3'}"
    storage_section = {"url": url, **sections.pop("storage", {})}
    c = HiCache(small_config(storage=storage_section, **sections))
    made.append(c)
    return c


def prompt(tag: int, pages: int) -> list[int]:
    return [tag * 1000 + i for i in range(pages * P)]


def run(cache: HiCache, tokens: list[int], seed: int = 0) -> Request:
    """One request as an engine makes it: match, prefetch, load back, compute the rest, commit, release."""
    req = cache.match(tokens)
    cache.prefetch(req)
    load = cache.load_back(req)
    load.wait()
    new = cache.alloc(req, len(tokens) // P - len(load.device_indices))
    write_kv(cache, new, seed)
    cache.commit(req, tokens, np.concatenate([load.device_indices, new]))
    cache.release(req)
    return req


# --------------------------------------------------------------------------------------------------------
# Tiers: hits, evictions, loads and backups under each write policy
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["memory", "file"])
@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_tier_round_trip(caches: list[HiCache], tmp_path: Path, policy: str, store: str) -> None:
    """8 pages committed, extended by 2, evicted from L1, then from L2, then served from L3."""
    cache = new_cache(caches, store, tmp_path, cache={"write_policy": policy})
    bpp = cache.layout.bytes_per_page
    led = Ledger(cache)
    led.step("a fresh cache", gauges={key("hicache_pool_total_pages", tier="l1"): PAGES_L1,
                                      key("hicache_pool_total_pages", tier="l2"): PAGES_L2})
    doc, longer = prompt(1, 8), prompt(1, 10)

    commit_fresh(cache, doc, seed=1)
    cache.flush()
    through = policy == "write_through"
    led.step("8 pages committed", merge(lookups(1, 32), backed(32, 32) if through else {},
                                        storage(written=8, page_bytes=bpp) if through else {}),
             pools(8, 8 if through else 0))

    run(cache, longer, seed=2)
    cache.flush()
    # write_through backs up the 2 new pages; write_through_selective backs up the 8 matched pages at
    # their second use (the insert was the first); write_back waits for eviction
    b = {"write_through": 2, "write_back": 0, "write_through_selective": 8}[policy]
    on_l2 = {"write_through": 10, "write_back": 0, "write_through_selective": 8}[policy]
    led.step("extended by 2 pages", merge(lookups(1, 40), hits(l1=32), backed(b * P, b * P),
                                          storage(written=b, page_bytes=bpp)), pools(10, on_l2))

    assert cache.evict(l1_pages=PAGES_L1) == (10, 0)
    cache.flush()
    if policy == "write_back":  # backed up on their way out
        led.step("L1 evicted", merge(evicted(l1=40), backed(40, 40), storage(written=10, page_bytes=bpp)),
                 pools(0, 10))
        on_l2 = 10
    else:  # pages without an L2 copy are dropped
        led.step("L1 evicted", evicted(l1=40), pools(0, on_l2))

    assert cache.evict(l2_pages=PAGES_L2) == (0, on_l2)
    led.step("L2 evicted", evicted(l2=on_l2 * P), pools(0, 0))

    in_l3 = on_l2  # what was ever written to L3
    req = run(cache, longer, seed=2)
    assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, in_l3)
    cache.flush()
    led.step("served from L3", merge(lookups(1, 40), hits(l3=in_l3 * P), l3_run(in_l3 * P),
                                     loadback(in_l3 * P, in_l3 * bpp),
                                     {key("hicache_prefetch_tokens_total"): in_l3 * P},
                                     storage(read=in_l3, page_bytes=bpp)),
             pools(10, in_l3))
    # the whole path is on L2 again (prefetched, or backed up at this commit): nothing left to back up
    cache.check_integrity()


def test_l2_hits_load_back_and_backup_skipped(caches: list[HiCache], tmp_path: Path) -> None:
    """L2 hits, a backup with no L2 page to take, and L1 eviction under a load's allocation."""
    cache = new_cache(caches, "memory", tmp_path, cache={"write_policy": "write_through", "l2_tokens": 8 * P})
    bpp = cache.layout.bytes_per_page
    led = Ledger(cache)
    a, b = prompt(1, 8), prompt(2, 12)
    commit_fresh(cache, a, seed=1)
    cache.flush()
    led.step("8 pages", merge(lookups(1, 32), backed(32, 32), storage(written=8, page_bytes=bpp)),
             merge(pools(8, 8), {key("hicache_pool_total_pages", tier="l2"): 8}))
    assert cache.evict(l1_pages=8) == (8, 0)
    led.step("to L2", evicted(l1=32), pools(0, 8))
    held = cache.match(a)  # pins its L2 run: all of L2
    led.step("match", lookups(1, 32))  # the L2 run is a hit once its load back lands it
    commit_fresh(cache, b, seed=2)  # 12 pages on L1; their backup finds no L2 page free or evictable
    led.step("backup skipped", merge(lookups(1, 48), {key("hicache_backup_skipped_tokens_total"): 48}),
             pools(12, 8))
    load = cache.load_back(held)  # 8 pages to L1, 4 free: b's node (12 pages, no L2 copy) is dropped
    load.wait()
    assert load.l2_pages == 8
    led.step("load back under pressure", merge(hits(l2=32), loadback(32, 8 * bpp), evicted(l1=48)), pools(8, 8))
    cache.release(held)
    cache.check_integrity()


# --------------------------------------------------------------------------------------------------------
# Prefetch: each policy, cut short, cancelled, refused, raced
# --------------------------------------------------------------------------------------------------------
def cold_l3(cache: HiCache, tokens: list[int]) -> None:
    """``tokens`` committed, written to L3, then dropped from L1 and L2."""
    commit_fresh(cache, tokens, seed=7)
    cache.flush()
    cache.clear()


@pytest.mark.parametrize("policy", ["best_effort", "timeout", "wait_complete"])
def test_prefetch_policies(caches: list[HiCache], policy: str) -> None:
    """3 of 8 pages land, then the store stalls: best_effort and timeout take the 3 (the stalled read
    times out), wait_complete waits for all 8."""
    cfg = small_config(cache={"write_policy": "write_through"},
                       storage={"prefetch_policy": policy, "io_batch_pages": 1, "prefetch_timeout_base_s": 0.2,
                                "prefetch_timeout_per_1k_tokens_s": 0.0})
    cache, store = stalling_cache(cfg)
    caches.append(cache)
    bpp = cache.layout.bytes_per_page
    doc = prompt(3, 8)
    cold_l3(cache, doc)
    led = Ledger(cache)
    complete = policy == "wait_complete"
    store.stall_reads_after(3, fail=not complete)
    req = cache.match(doc)
    assert cache.prefetch(req) == 8
    assert store.stalled.wait(10)
    # the store had all 8 pages at the match; hit{l3} counts what the load back gets
    led.step("prefetch in flight", merge(lookups(1, 32), l3_run(32), storage(read=3, page_bytes=bpp)),
             {key("hicache_prefetch_inflight_bytes"): 8 * bpp, **pools(0, 8)})
    threading.Timer(0.3, store.go).start()
    load = cache.load_back(req)
    load.wait()
    got = 8 if complete else 3
    assert (load.l2_pages, load.l3_pages) == (got, got)
    # cut short by the policy's wait, the stalled read then fails: the store did not return page 4
    led.step("loaded", merge(hits(l3=got * P), l3_run(missing=(8 - got) * P),
                             loadback(got * P, got * bpp), {key("hicache_prefetch_tokens_total"): got * P},
                             {key("hicache_prefetch_aborted_total"): 0 if complete else 1},
                             storage(read=5, page_bytes=bpp) if complete else storage(misses=1, errors=1)),
             {key("hicache_prefetch_inflight_bytes"): 0, **pools(got, got)})
    cache.release(req)
    cache.check_integrity()
    led.step("released")


@pytest.mark.parametrize("when", ["in flight", "landed", "finished"])
def test_prefetch_cancelled_by_release(caches: list[HiCache], when: str) -> None:
    """A request released before it loads its prefetch: the prefetch counts as aborted once, whether it was
    still reading, had landed, or had been finished (its pages handed over, as the node's Prefetch does
    before loading) -- and its pages and in-flight bytes are given back."""
    cfg = small_config(cache={"write_policy": "write_through"}, storage={"io_batch_pages": 1})
    cache, store = stalling_cache(cfg)
    caches.append(cache)
    bpp = cache.layout.bytes_per_page
    doc = prompt(4, 8)
    cold_l3(cache, doc)
    led = Ledger(cache)
    if when == "in flight":
        store.stall_reads_after(3, fail=True)
    req = cache.match(doc)
    assert cache.prefetch(req) == 8
    task = req.prefetch
    assert task is not None
    if when == "in flight":
        assert store.stalled.wait(10)
        threading.Timer(0.2, store.go).start()
        read = storage(read=3, misses=1, errors=1, page_bytes=bpp)
        fate = l3_run(32, dropped=12, missing=20)  # 3 pages landed for nothing, the 4th read failed
    else:
        if when == "finished":
            assert task.finish(None) == 8  # all 8 land, handed to the request (not inserted yet)
        deadline = time.monotonic() + 10
        while not task.done() and time.monotonic() < deadline:
            time.sleep(0.005)
        read = storage(read=8, page_bytes=bpp)
        fate = l3_run(32, dropped=32)  # all 8 landed, none served
    cache.release(req)
    led.step(f"released with its prefetch {when}",
             merge(lookups(1, 32), fate, read, {key("hicache_prefetch_aborted_total"): 1}),
             {key("hicache_prefetch_inflight_bytes"): 0, **pools(0, 0)})
    cache.check_integrity()


def test_prefetch_refused(caches: list[HiCache], tmp_path: Path) -> None:
    """A prefetch over the in-flight byte cap, and one with no L2 page to take, are aborted and take nothing."""
    cache = new_cache(caches, "memory", tmp_path, cache={"write_policy": "write_through", "l2_tokens": 8 * P},
                      storage={"prefetch_max_inflight_bytes": 4 * 768})
    assert cache.layout.bytes_per_page == 768
    doc = prompt(5, 8)
    cold_l3(cache, doc)
    led = Ledger(cache)
    req = cache.match(doc)
    assert cache.prefetch(req) == 0  # 8 pages > the 4-page cap
    led.step("over the cap", merge(lookups(1, 32), l3_run(32), {key("hicache_prefetch_aborted_total"): 1}))
    cache.release(req)
    led.step("released", l3_run(not_fetched=32))

    small = prompt(6, 3)
    cold_l3(cache, small)  # 3 pages in L3 (the cap allows 4)
    led = Ledger(cache)
    pinned = prompt(7, 8)
    commit_fresh(cache, pinned, seed=1)
    cache.flush()
    cache.evict(l1_pages=8)  # 8 L2-only pages: all of L2
    held = cache.match(pinned)  # pins them
    req = cache.match(small)
    assert cache.prefetch(req) == 0
    led.step("no room on L2", merge(lookups(3, 32 + 32 + 12), backed(32, 32), evicted(l1=32),
                                    l3_run(12), storage(written=8, page_bytes=768),
                                    {key("hicache_prefetch_aborted_total"): 1}),
             pools(0, 8))
    cache.release(req)
    cache.release(held)  # its L2 run was never loaded back: not a hit
    led.step("released", merge(l3_run(not_fetched=12), l2_unserved(not_loaded=32)))
    cache.check_integrity()


def test_two_requests_prefetch_the_same_run(caches: list[HiCache], tmp_path: Path) -> None:
    """Both fetch the run; it enters L2 once: hicache_prefetch_tokens_total counts it once (the store's
    read counters count both reads)."""
    cache = new_cache(caches, "memory", tmp_path, cache={"write_policy": "write_through"})
    bpp = cache.layout.bytes_per_page
    doc = prompt(8, 8)
    cold_l3(cache, doc)
    led = Ledger(cache)
    a, b = cache.match(doc), cache.match(doc)
    assert cache.prefetch(a) == 8 and cache.prefetch(b) == 8
    la = cache.load_back(a)
    lb = cache.load_back(b)
    la.wait()
    lb.wait()
    assert la.l2_pages == 8 and lb.l2_pages == 0  # b finds the run on L1
    # b's prefetch landed the run too: it is served from L3 to both (L2 holds it once)
    led.step("both loaded", merge(lookups(2, 64), hits(l3=64), l3_run(64), storage(read=16, page_bytes=bpp),
                                  loadback(32, 8 * bpp),
                                  {key("hicache_prefetch_tokens_total"): 32}), pools(8, 8))
    cache.release(a)
    cache.release(b)
    cache.check_integrity()


# --------------------------------------------------------------------------------------------------------
# L3: damaged pages, a full writeback queue
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("store", ["memory", "file"])
def test_damaged_l3_page(caches: list[HiCache], tmp_path: Path, store: str) -> None:
    """Page 3 of 8 damaged in the store: the prefetch stops there, the page counts as corrupt and a miss."""
    cache = new_cache(caches, store, tmp_path, cache={"write_policy": "write_through"})
    bpp = cache.layout.bytes_per_page
    doc = prompt(9, 8)
    cold_l3(cache, doc)
    k = page_keys_from_bytes(cache.ns.digest, tokens_to_bytes(doc), P)[3]
    if isinstance(cache.storage, MemoryBackend):
        blob = bytearray(cache.storage.raw(k) or b"")
        blob[-1] ^= 0xFF
        cache.storage.put_raw(k, bytes(blob))
    else:
        path = Path(cache.storage.path(k))  # type: ignore[union-attr]
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    led = Ledger(cache)
    req = cache.match(doc)
    assert (req.l3_pages, cache.prefetch(req)) == (8, 8)
    load = cache.load_back(req)
    load.wait()
    assert load.l3_pages == 3
    led.step("damaged page", merge(lookups(1, 32), hits(l3=12), l3_run(32, missing=20), loadback(12, 3 * bpp),
                                   {key("hicache_prefetch_tokens_total"): 12, key("hicache_prefetch_aborted_total"): 1},
                                   storage(read=3, misses=5, corrupt=1, page_bytes=bpp)), pools(3, 3))
    cache.release(req)
    cache.check_integrity()


def test_writeback_queue_full(caches: list[HiCache]) -> None:
    """Queue of 4 pages, drop when full, store stalled: 2 pages queued, 4 refused, 2 more queued."""
    cfg = small_config(cache={"write_policy": "write_through"},
                       storage={"writeback_queue_pages": 4, "writeback_when_full": "drop"})
    cache, store = stalling_cache(cfg)
    caches.append(cache)
    bpp = cache.layout.bytes_per_page
    led = Ledger(cache)
    store.stall_writes()
    commit_fresh(cache, prompt(1, 2), seed=1)
    cache.flush(0.0)  # hands the finished backup to the writeback queue
    assert store.stalled.wait(10)
    commit_fresh(cache, prompt(2, 4), seed=2)
    cache.flush(0.0)  # 2 + 4 > 4: refused
    commit_fresh(cache, prompt(3, 2), seed=3)
    cache.flush(0.0)  # 2 + 2 <= 4
    led.step("store stalled", merge(lookups(3, 32), backed(l2=32), {key("hicache_writeback_dropped_pages_total"): 4}),
             {key("hicache_writeback_queue_pages"): 4, **pools(8, 8)})
    store.go()
    report = cache.flush()
    assert report is not None and (report.written_pages, report.dropped_pages) == (4, 4)
    led.step("drained", merge(backed(l3=16), storage(written=4, page_bytes=bpp)),
             {key("hicache_writeback_queue_pages"): 0})


# --------------------------------------------------------------------------------------------------------
# Pins, clear, flush
# --------------------------------------------------------------------------------------------------------
def test_pins_clear_flush(caches: list[HiCache], tmp_path: Path) -> None:
    """Pinned pages per tier (overlapping pins count each time); clear drops only what no pin keeps."""
    cache = new_cache(caches, "memory", tmp_path, cache={"write_policy": "write_through"})
    a, b = prompt(1, 6), prompt(2, 4)
    commit_fresh(cache, b, seed=2)
    cache.evict(l1_pages=4)  # b on L2 only
    commit_fresh(cache, a, seed=1)
    report = cache.flush()
    assert report is not None and report.complete
    led = Ledger(cache)
    led.step("start", gauges=pools(6, 10))
    pa, pb = cache.pin(a), cache.pin(b)
    assert (pa.l1_pages, pa.l2_pages, pb.l1_pages, pb.l2_pages) == (6, 0, 0, 4)
    led.step("pinned", gauges={key("hicache_pinned_pages", tier="l1"): 6, key("hicache_pinned_pages", tier="l2"): 4})
    pa2 = cache.pin(a[: 2 * P])
    led.step("pinned again", gauges={key("hicache_pinned_pages", tier="l1"): 8})
    assert cache.clear() == (0, 0)
    led.step("clear keeps pinned pages")
    cache.unpin(pa.pin_id)
    cache.unpin(pb.pin_id)
    led.step("unpinned two", gauges={key("hicache_pinned_pages", tier="l1"): 2,
                                     key("hicache_pinned_pages", tier="l2"): 0})
    # a's last 4 pages leave L1 (to L2), then L2 drops them and b; a's first 2 pages stay (pinned)
    assert cache.clear() == (4, 8)
    report = cache.flush()
    assert report is not None and report.complete and report.written_pages == 10
    led.step("clear", evicted(l1=16, l2=32), pools(2, 2))
    cache.unpin(pa2.pin_id)
    led.step("unpinned all", gauges={key("hicache_pinned_pages", tier="l1"): 0})
    assert cache.clear() == (2, 2)
    led.step("clear all", evicted(l1=8, l2=8), pools(0, 0))
    cache.check_integrity()


def test_storage_up_absent_without_l3(caches: list[HiCache], tmp_path: Path) -> None:
    """A node without L3 has no store to probe: ``hicache_storage_up`` is absent (a 0 would fire
    HicacheL3Down on every L1/L2-only node); with L3 it is exported."""
    plain = HiCache(small_config())
    caches.append(plain)
    assert key("hicache_storage_up") not in samples(plain.metrics.registry)
    with_l3 = new_cache(caches, "memory", tmp_path)
    with_l3.metrics.storage_up.set(1)
    assert samples(with_l3.metrics.registry)[key("hicache_storage_up")] == 1


# --------------------------------------------------------------------------------------------------------
# Random operation sequences: the conservation laws
# --------------------------------------------------------------------------------------------------------
class Truth:
    """What the test saw the cache do, added up from the results of its calls."""

    def __init__(self) -> None:
        self.lookups = self.lookup_tokens = 0
        self.hit = {"l1": 0, "l2": 0, "l3": 0}  # l2, l3: served, as the load backs report them
        self.l2_matched = 0  # tokens the matches found on L2
        self.l3_matched = 0  # tokens the matches found on L3
        self.committed_l1 = 0  # pages commit newly placed on L1
        self.loaded = 0  # pages load_back moved L2 -> L1
        self.aborted = 0  # prefetches refused, cut short, or dropped by a release

    def matched(self, req: Request) -> None:
        self.lookups += 1
        self.lookup_tokens += req.num_pages * P
        self.hit["l1"] += req.l1_pages * P
        self.l2_matched += req.l2_pages * P
        self.l3_matched += req.l3_pages * P


def val(reg: Any, name: str, **labels: str) -> float:
    return samples(reg).get(key(name, **labels), 0.0)


def check_laws(cache: HiCache, truth: Truth, live: list[Request], flushed: bool) -> None:
    cache.check_integrity(live)
    s = samples(cache.metrics.registry)

    def v(name: str, **labels: str) -> float:
        return s.get(key(name, **labels), 0.0)

    bpp = cache.layout.bytes_per_page
    # lookups and hits: exactly what the matches returned; hits never exceed what was looked up
    assert v("hicache_lookups_total") == truth.lookups
    assert v("hicache_lookup_tokens_total") == truth.lookup_tokens
    for t in ("l1", "l2", "l3"):
        assert v("hicache_hit_tokens_total", tier=t) == truth.hit[t], t
    assert sum(truth.hit.values()) <= truth.lookup_tokens
    # every token matched on L3 is served, counted unserved for one reason, or still open (its request has
    # not loaded its prefetch back nor been released)
    assert v("hicache_l3_matched_tokens_total") == truth.l3_matched
    unserved = sum(v("hicache_l3_unserved_tokens_total", reason=x) for x in UNSERVED_REASONS)
    still_open = sum(r.l3.pages for r in live if r.l3 is not None) * P
    assert v("hicache_hit_tokens_total", tier="l3") + unserved + still_open == truth.l3_matched
    # the same for L2: every token matched on L2 is served (loaded back), unserved, or its request still open
    unserved = sum(v("hicache_l2_unserved_tokens_total", reason=x) for x in L2_UNSERVED_REASONS)
    still_open = sum(r.l2.pages for r in live if r.l2 is not None) * P
    assert v("hicache_hit_tokens_total", tier="l2") + unserved + still_open == truth.l2_matched
    # gauges: the allocators, the pins, the prefetches in flight, the writeback queue
    dev, host = cache.device_pool.allocator, cache.host_pool.allocator
    assert v("hicache_pool_used_pages", tier="l1") == dev.used_pages
    assert v("hicache_pool_used_pages", tier="l2") == host.used_pages
    assert v("hicache_pool_total_pages", tier="l1") == cache.device_pool.num_pages
    assert v("hicache_pool_total_pages", tier="l2") == cache.config.l2_pages
    pins = cache.pins()
    assert v("hicache_pinned_pages", tier="l1") == sum(p.l1_pages for p in pins)
    assert v("hicache_pinned_pages", tier="l2") == sum(p.l2_pages for p in pins)
    inflight = sum(r.prefetch.num_pages for r in live if r.prefetch is not None) * bpp
    assert v("hicache_prefetch_inflight_bytes") == inflight
    # pages on each tier = pages that entered it - pages evicted from it
    assert cache.tree.device_pages * P == (truth.committed_l1 + truth.loaded) * P - v("hicache_evicted_tokens_total",
                                                                                        tier="l1")
    assert cache.tree.host_pages * P == (v("hicache_backed_up_tokens_total", tier="l2")
                                         + v("hicache_prefetch_tokens_total")
                                         - v("hicache_evicted_tokens_total", tier="l2"))
    assert v("hicache_loadback_tokens_total") == truth.loaded * P
    assert v("hicache_loadback_bytes_total") == truth.loaded * bpp
    assert v("hicache_prefetch_aborted_total") == truth.aborted
    # the store's own counters, as the store keeps them (a write or read still in flight may land between
    # the two looks at the store, never outside them)
    assert cache.storage is not None
    fields = ("gets", "get_misses", "sets", "corrupt_pages", "bytes_read", "bytes_written", "errors")
    names = ("pages_read", "page_misses", "pages_written", "corrupt_pages", "read_bytes", "written_bytes", "errors")
    before = cache.storage.stats()
    exported = samples(cache.metrics.registry)
    after = cache.storage.stats()
    for f, name in zip(fields, names, strict=True):
        got = exported.get(key(f"hicache_storage_{name}_total"), 0.0)
        assert getattr(before, f) <= got <= getattr(after, f), name
    st = after
    if flushed:  # every L2 backup went to L3 once (this store never fails; the queue never fills)
        assert cache.writeback is not None
        assert v("hicache_writeback_queue_pages") == 0
        assert v("hicache_backed_up_tokens_total", tier="l3") == st.sets * P
        assert v("hicache_backed_up_tokens_total", tier="l2") == (
            v("hicache_backed_up_tokens_total", tier="l3") + v("hicache_writeback_dropped_pages_total") * P)


FAMILIES = 2
MAX_HELD = 2  # requests held open at once (with at most 2 pins of 4 pages, L1 never fills with locks)


def family_prompt(fam: int, variant: int, pages: int) -> list[int]:
    """Prompts of a family share their first 3 pages; variants differ after that."""
    shared = [fam * 10000 + i for i in range(3 * P)]
    own = [fam * 10000 + 1000 * (variant + 1) + i for i in range(max(0, pages - 3) * P)]
    return (shared + own)[: pages * P]


OPS = st.one_of(
    st.tuples(st.just("serve"), st.integers(0, FAMILIES - 1), st.integers(0, 1), st.integers(1, 7)),
    st.tuples(st.just("hold"), st.integers(0, FAMILIES - 1), st.integers(0, 1), st.integers(1, 7), st.integers(1, 2)),
    st.tuples(st.just("finish_held"), st.booleans()),
    st.tuples(st.just("release_held"), st.booleans(), st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 6), st.integers(0, 10)),
    st.tuples(st.just("pin"), st.integers(0, FAMILIES - 1), st.integers(1, 4)),
    st.tuples(st.just("unpin"), st.integers(0, 3)),
    st.tuples(st.just("damage"), st.integers(0, FAMILIES - 1), st.integers(0, 1), st.integers(0, 6)),
    st.tuples(st.just("clear")),
    st.tuples(st.just("flush")),
    st.tuples(st.just("cold")),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
       prefetch=st.sampled_from(["best_effort", "wait_complete"]),
       ops=st.lists(OPS, min_size=1, max_size=24))
@example(policy="write_through", prefetch="wait_complete",  # two requests prefetch the same run
         ops=[("serve", 0, 0, 6), ("cold",), ("hold", 0, 0, 6, 2), ("finish_held", True), ("finish_held", True)])
@example(policy="write_back", prefetch="best_effort",  # a prefetch handed over, then the request released
         ops=[("serve", 1, 1, 5), ("evict", 6, 0), ("cold",), ("hold", 1, 1, 5, 1), ("release_held", True, True)])
@example(policy="write_through", prefetch="best_effort",  # an L2 run released before its load back
         ops=[("serve", 0, 0, 6), ("evict", 6, 0), ("hold", 0, 0, 6, 1), ("release_held", True, False)])
def test_metrics_conservation_laws(policy: str, prefetch: str, ops: list[tuple[Any, ...]]) -> None:
    cfg = small_config(cache={"write_policy": policy, "l1_tokens": 32 * P, "l2_tokens": 16 * P},
                       storage={"url": "memory://", "prefetch_policy": prefetch, "io_batch_pages": 2})
    cache = HiCache(cfg)
    truth = Truth()
    held: list[Request] = []
    try:
        for i, op in enumerate(ops):
            flushed = False
            kind = op[0]
            if kind == "serve" or (kind == "hold" and len(held) + op[4] <= MAX_HELD):
                tokens = family_prompt(*op[1:4])
                for _ in range(op[4] if kind == "hold" else 1):
                    req = cache.match(tokens)
                    truth.matched(req)
                    n = cache.prefetch(req)
                    if req.l3_pages and not n:
                        truth.aborted += 1  # refused: no room on L2
                    if kind == "hold":
                        held.append(req)
                if kind == "serve":
                    try:
                        finish(cache, req, tokens, truth, seed=i, prefetching=n)
                    finally:
                        cache.release(req)
            elif kind == "finish_held" and held:
                req = held.pop(0) if op[1] else held.pop()
                tokens = np.frombuffer(req.token_bytes, dtype="<u4").tolist()
                n = req.prefetch.num_pages if req.prefetch is not None else 0
                try:
                    finish(cache, req, tokens, truth, seed=i, prefetching=n)
                finally:
                    cache.release(req)
            elif kind == "release_held" and held:
                req = held.pop(0) if op[1] else held.pop()
                if req.prefetch is not None:
                    truth.aborted += 1
                    if op[2]:  # its pages handed over first, as a node's Prefetch cut short by its deadline does
                        req.prefetch.finish(0.0)
                cache.release(req)
            elif kind == "evict":
                cache.evict(l1_pages=op[1], l2_pages=op[2])
            elif kind == "pin" and len(cache.pins()) < 2:
                with contextlib.suppress(ValueError, RuntimeError):  # nothing cached, or over the pin cap
                    cache.pin(family_prompt(op[1], 0, op[2]))
            elif kind == "unpin":
                pins = cache.pins()
                if pins:
                    cache.unpin(pins[op[1] % len(pins)].pin_id)
            elif kind == "damage":
                damage(cache, family_prompt(op[1], op[2], 7), op[3])
            elif kind == "clear":
                cache.clear()
            elif kind == "flush":
                cache.flush()
                flushed = True
            elif kind == "cold":  # everything to L3, then off L1 and L2
                cache.flush()
                cache.clear()
                cache.flush()
                flushed = True
            check_laws(cache, truth, held, flushed)
        for req in held:
            if req.prefetch is not None:
                truth.aborted += 1
            cache.release(req)
        held = []
        cache.flush()
        check_laws(cache, truth, [], True)
        assert val(cache.metrics.registry, "hicache_prefetch_inflight_bytes") == 0
    finally:
        for req in held:
            cache.release(req)
        cache.close()


def finish(cache: HiCache, req: Request, tokens: list[int], truth: Truth, seed: int, prefetching: int) -> None:
    """Load back, compute the rest, commit; counts what the calls report into ``truth``."""
    load = cache.load_back(req)
    load.wait()
    truth.loaded += load.l2_pages
    truth.hit["l2"] += min(req.l2_pages, max(0, len(load.device_indices) - req.l1_pages)) * P
    truth.hit["l3"] += load.l3_pages * P
    if prefetching and load.l3_pages < prefetching:
        truth.aborted += 1  # cut short (damaged page, best_effort)
    new = cache.alloc(req, len(tokens) // P - len(load.device_indices))
    write_kv(cache, new, seed)
    res = cache.commit(req, tokens, np.concatenate([load.device_indices, new]))
    truth.committed_l1 += res.new_pages


def damage(cache: HiCache, tokens: list[int], page: int) -> None:
    """Flip a byte of one stored page (if the store has it)."""
    store = cache.storage
    assert isinstance(store, MemoryBackend)
    keys = page_keys_from_bytes(cache.ns.digest, tokens_to_bytes(tokens), P)
    blob = store.raw(keys[page])
    if blob is not None:
        b = bytearray(blob)
        b[len(b) // 2] ^= 0x5A
        store.put_raw(keys[page], bytes(b))


# --------------------------------------------------------------------------------------------------------
# The node: RPC counters and histograms, open requests, rejections, scraped over HTTP
# --------------------------------------------------------------------------------------------------------
def test_node_rpc_metrics_over_http(tmp_path: Path) -> None:
    from metricskit import scrape
    from service.service_harness import serve_prompt, start_server

    from hicache.client._common import CallError
    from hicache.client.sync import HiCacheClient

    server = start_server(tmp_path, storage={"url": f"file://{tmp_path / 'l3'}"}, serve={"max_concurrency": 2})
    ps = 16  # the harness's page size
    a, b = list(range(1, 4 * ps + 1)), list(range(500, 500 + 2 * ps))
    client = HiCacheClient(server.target, timeout_s=10)
    streams = []
    try:
        before = scrape(server.metrics_port)
        assert before[key("hicache_storage_up")] == 1  # the store answered the start-up probe
        serve_prompt(client, a, "r1")  # Match, Allocate, Commit, Release
        assert client.match(a, "r2").l1_pages == 4
        refused: dict[str, grpc.StatusCode] = {}
        for name, call in (("Match", lambda: client.match(b, "r2")),  # the id is open
                           ("Allocate", lambda: client.allocate("nope", 1)),
                           ("Commit", lambda: client.commit("nope", a, list(range(4)))),
                           ("Unpin", lambda: client.unpin(999))):
            with pytest.raises((grpc.RpcError, CallError)) as ei:
                call()
            refused[name] = ei.value.code()
        assert client.match(a, peek=True).l1_pages == 4
        client.stats()
        mid = scrape(server.metrics_port)
        assert mid[key("hicache_open_requests")] == 1  # r2
        assert mid[key("hicache_rpc_inflight")] == 0

        s1, s2 = client.match_stream(), client.match_stream()
        streams = [s1, s2]
        assert s1.match(a, peek=True).l1_pages == 4
        assert s1.match(a, peek=True).l1_pages == 4
        assert s2.match(b, peek=True).l1_pages == 0
        full = scrape(server.metrics_port)  # idle streams hold no slot: only their messages count, while handled
        assert full[key("hicache_rpc_inflight")] == 0
        assert client.match(a, peek=True).l1_pages == 4  # serve.max_concurrency (2) is not reached
        client.stats()
        client.release("r2")
        for s in streams:
            s.close()
        deadline = time.monotonic() + 10
        while True:  # the streams' handlers end just after the client sees them closed
            after = scrape(server.metrics_port)
            done = after.get(key("hicache_rpcs_total", method="MatchStream", code="OK"))
            if done == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    finally:
        for s in streams:
            s.close()
        client.close()
        server.terminate()

    assert refused == {"Match": grpc.StatusCode.ALREADY_EXISTS, "Allocate": grpc.StatusCode.NOT_FOUND,
                       "Commit": grpc.StatusCode.NOT_FOUND, "Unpin": grpc.StatusCode.NOT_FOUND}
    calls = {("Match", "OK"): 4, ("Match", "ALREADY_EXISTS"): 1, ("Allocate", "OK"): 1,
             ("Allocate", "NOT_FOUND"): 1, ("Commit", "OK"): 1, ("Commit", "NOT_FOUND"): 1, ("Release", "OK"): 2,
             ("Unpin", "NOT_FOUND"): 1, ("Stats", "OK"): 2, ("MatchStream", "OK"): 2}
    d = {k: v for k, v in diff(before, after).items() if k[0] == "hicache_rpcs_total"}
    assert d == {key("hicache_rpcs_total", method=m, code=c): n for (m, c), n in calls.items()}
    timed: dict[str, int] = {}
    for (m, _), n in calls.items():
        timed[m] = timed.get(m, 0) + n
    timed["Match"] += 3  # each MatchStream message is timed under Match
    d = {k: v for k, v in diff(before, after).items() if k[0] == "hicache_rpc_seconds_count"}
    assert d == {key("hicache_rpc_seconds_count", method=m): n for m, n in timed.items()}
    assert after[key("hicache_rpc_rejected_total")] - before.get(key("hicache_rpc_rejected_total"), 0) == 0
    assert after[key("hicache_rpc_inflight")] == 0
    assert after[key("hicache_open_requests")] == 0
    # the cache's side of the same calls: 2 lookups (the refused Match never reached the cache) and 5 peeks,
    # which serve nothing: neither lookups nor hits
    want = merge(lookups(2, 4 * ps * 2), hits(l1=4 * ps), {key("hicache_peeks_total"): 5})
    got = {k: v for k, v in diff(before, after).items() if k[0] in ("hicache_lookups_total",
                                                                     "hicache_lookup_tokens_total",
                                                                     "hicache_hit_tokens_total",
                                                                     "hicache_peeks_total")}
    assert got == {k: v for k, v in want.items() if v}
