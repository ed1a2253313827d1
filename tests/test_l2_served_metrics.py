"""``hicache_hit_tokens_total{tier="l2"}`` counts tokens served from L2, not tokens Match found there; a peek
serves nothing and counts in no lookup or hit figure.

A request's L2 run (pinned at match) is only served when its load back lands it on L1. A load back with
no room on L1 (every L1 page locked or owned by requests in flight), a request released before it loads
back, or one that commits pages it computed itself leaves those tokens recomputed: they are counted in
``hicache_l2_unserved_tokens_total{reason}``, never as hits. Each case runs an in-process cache (CPU pools)
and checks, token for token, every counter that moved; the bench's in-process target reports the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from metricskit import Ledger, hits, key, l2_unserved, l3_run, loadback, lookups, merge, samples

from hicache.accounting import L2_UNSERVED_REASONS as UNSERVED_REASONS
from hicache.bench.replay import replay
from hicache.bench.run import replay_config
from hicache.bench.targets import InProcessTarget
from hicache.bench.workloads import TraceRequest
from hicache.cache import CacheFullError, HiCache, Request
from kvhelpers import commit_fresh, kv_equal, read_kv, small_config, write_kv

P = 4  # tokens per page (small_config)
L1 = 16  # small_config's L1 pages


@pytest.fixture
def cache() -> Iterator[HiCache]:
    c = HiCache(small_config(cache={"write_policy": "write_through"}, storage={"url": "memory://"}))
    yield c
    c.close()


def prompt(tag: int, pages: int) -> list[int]:
    return [tag * 1000 + i for i in range(pages * P)]


def on_l2(cache: HiCache, tokens: list[int], seed: int = 1) -> list[list[object]]:
    """``tokens`` committed (backed up to L2 and L3), then dropped from L1: on L2 only."""
    kv = commit_fresh(cache, tokens, seed=seed)
    cache.flush()
    cache.evict(l1_pages=L1)
    return kv  # type: ignore[return-value]


def fill_l1(cache: HiCache) -> Request:
    """A request owning every L1 page (computing a long prompt): no L1 page is free or evictable."""
    hog = cache.match(prompt(99, 1), l3=False)
    cache.alloc(hog, cache.device_pool.allocator.free_pages + cache.tree.device_pages)
    return hog


def storage_io(cache: HiCache, before: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict:
    """The L3 store's counters that moved since ``before`` (backups written at commit time, and so on)."""
    now = samples(cache.metrics.registry)
    return {k: v - before.get(k, 0.0) for k, v in now.items() if k[0].startswith("hicache_storage_")
            and not k[0].startswith("hicache_storage_op") and k[0] != "hicache_storage_up"
            and v != before.get(k, 0.0)}


def land(cache: HiCache, led: Ledger, req: Request, kv: Any) -> None:
    """Load the request's 6-page L2 run back (a hit of 24 tokens, the KV written), then release it."""
    load = cache.load_back(req)
    load.wait()
    assert kv_equal(read_kv(cache, load.device_indices), kv)
    led.step("loaded back", merge(hits(l2=24), loadback(24, 6 * cache.layout.bytes_per_page)),
             {key("hicache_pool_used_pages", tier="l1"): 6})
    cache.release(req)
    led.step("released")


def test_loaded_back_is_a_hit(cache: HiCache) -> None:
    doc = prompt(1, 6)
    kv = on_l2(cache, doc)
    led = Ledger(cache)
    req = cache.match(doc)
    assert (req.l1_pages, req.l2_pages) == (0, 6)
    led.step("matched", lookups(1, 24))  # not a hit yet: nothing is on L1 for it
    land(cache, led, req, kv)


def test_no_room_on_l1_is_not_a_hit(cache: HiCache) -> None:
    """The load back finds every L1 page taken: the run is recomputed, counted unserved (no_room) at release."""
    doc = prompt(2, 6)
    on_l2(cache, doc)
    hog = fill_l1(cache)
    led = Ledger(cache)
    req = cache.match(doc)
    with pytest.raises(CacheFullError):
        cache.load_back(req)
    led.step("load back refused", lookups(1, 24))
    cache.release(req)
    led.step("released", l2_unserved(no_room=24))
    cache.release(hog)
    cache.check_integrity()


def test_no_room_then_room_is_a_hit(cache: HiCache) -> None:
    """A load back refused for lack of room, retried once room is free, lands the run: a hit, counted once."""
    doc = prompt(3, 6)
    kv = on_l2(cache, doc)
    hog = fill_l1(cache)
    led = Ledger(cache)
    req = cache.match(doc)
    with pytest.raises(CacheFullError):
        cache.load_back(req)
    cache.release(hog)
    led.step("refused, then room", lookups(1, 24), {key("hicache_pool_used_pages", tier="l1"): 0})
    land(cache, led, req, kv)


def test_released_before_load_back(cache: HiCache) -> None:
    doc = prompt(4, 5)
    on_l2(cache, doc)
    led = Ledger(cache)
    req = cache.match(doc)
    cache.release(req)
    led.step("released unloaded", merge(lookups(1, 20), l2_unserved(not_loaded=20)))


def test_computed_instead_of_loaded(cache: HiCache) -> None:
    """A request that computes and commits the run's tokens itself was not served them; a load back after
    that commit does not count them again."""
    doc = prompt(5, 4)
    on_l2(cache, doc)
    led = Ledger(cache)
    req = cache.match(doc)
    assert (req.l1_pages, req.l2_pages) == (0, 4)
    pages = cache.alloc(req, 4)
    write_kv(cache, pages, seed=5)
    io = samples(cache.metrics.registry)
    cache.commit(req, doc, pages)
    led.step("committed its own pages", merge(lookups(1, 16), l2_unserved(not_loaded=16), storage_io(cache, io)),
             {key("hicache_pool_used_pages", tier="l1"): 4})
    cache.load_back(req).wait()
    cache.release(req)
    led.step("then loaded back and released")


def test_peek_counts_nothing_but_the_peek(cache: HiCache) -> None:
    """A peek over a prefix cached on every tier: the hit lengths come back, and only hicache_peeks_total
    moves (no lookup, no L1/L2 hit, no L3 match or unserved tokens, no Match latency sample)."""
    l1, l2, l3 = prompt(6, 2), prompt(6, 5), prompt(6, 8)  # one document: 2 pages on L1, 3 more on L2, 3 on L3
    commit_fresh(cache, l3, seed=6)
    cache.flush()
    cache.clear()  # all 8 pages on L3 only
    for tokens in (l2, l1):  # bring back 5 pages to L2 (then off L1), then 2 pages to L1
        req = cache.match(tokens)
        cache.prefetch(req)
        cache.load_back(req).wait()
        cache.release(req)
        if tokens is l2:
            cache.flush()
            cache.evict(l1_pages=L1)
    led = Ledger(cache)
    timed = cache.metrics.registry.get_sample_value("hicache_match_seconds_count")
    got = cache.peek(l3)
    assert (got.l1_pages, got.l2_pages, got.l3_pages) == (2, 3, 3) and got.released
    led.step("peek", {key("hicache_peeks_total"): 1})
    assert cache.metrics.registry.get_sample_value("hicache_match_seconds_count") == timed
    # the same lookup as a request: counted, L1 at once, L2 and L3 when their fate is known
    req = cache.match(l3)
    led.step("match", merge(lookups(1, 32), hits(l1=8), l3_run(12)))
    cache.release(req)
    led.step("released", merge(l2_unserved(not_loaded=12), l3_run(not_fetched=12)))


def test_every_l2_token_matched_is_counted_once(cache: HiCache) -> None:
    """Served + unserved == what the matches found on L2, over the cases above mixed."""
    docs = [prompt(10 + i, 3 + i) for i in range(3)]
    for i, d in enumerate(docs):
        on_l2(cache, d, seed=i)
    found = 0
    for i, d in enumerate(docs * 2):
        req = cache.match(d)
        found += req.l2_pages * P
        if i % 3 == 0:
            cache.load_back(req).wait()
        elif i % 3 == 1:
            hog = fill_l1(cache)
            with pytest.raises(CacheFullError):
                cache.load_back(req)
            cache.release(hog)
        cache.release(req)
        cache.evict(l1_pages=L1)
    s = samples(cache.metrics.registry)
    served = s[key("hicache_hit_tokens_total", tier="l2")]
    unserved = {r: s[key("hicache_l2_unserved_tokens_total", reason=r)] for r in UNSERVED_REASONS}
    assert found > 0 and served > 0 and all(unserved.values())
    assert served + sum(unserved.values()) == found


def test_bench_in_process_l2_is_what_was_loaded_back() -> None:
    """The bench's in-process target reports an L2 run that found no room on L1 as recomputed, not a hit."""
    page = 8
    doc = np.arange(1, 6 * page + 1, dtype=np.uint32)
    cfg = replay_config(page, 16 * page, 64 * page, write_policy="write_through")
    with InProcessTarget(cfg) as t:
        replay([TraceRequest(doc)], t, settle=True)
        t.cache.evict(l1_pages=16)  # on L2 only
        hog = t.cache.match(np.arange(10_000, 10_000 + page, dtype=np.uint32), l3=False)
        t.cache.alloc(hog, t.cache.device_pool.allocator.free_pages + t.cache.tree.device_pages)
        full = replay([TraceRequest(doc)], t)
        t.cache.release(hog)
        roomy = replay([TraceRequest(doc)], t)
    assert (full.l2.tolist(), full.reused.tolist()) == ([0], [0])
    assert full.hit_rate == 0
    assert (roomy.l2.tolist(), roomy.reused.tolist()) == ([6 * page], [6 * page])
