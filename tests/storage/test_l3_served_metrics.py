"""``hicache_hit_tokens_total{tier="l3"}`` counts tokens served from L3, not tokens the store reported at
match time.

Between a match (``batch_exists``) and the prefetch that follows, a page may leave the store, be damaged or
be replaced by a foreign one; the prefetch may be cut short by its policy's wait or by a release; what
landed may find no room on L1. Each case runs against a real store (a file store in ``tmp_path``, or the
``memory://`` store made to stall on cue) and checks, token for token, that the L3 hit is what reached the
request's prefix, that ``hicache_l3_matched_tokens_total`` keeps what the store reported, and that
``hicache_l3_unserved_tokens_total`` names why the rest was not served.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from metricskit import StallingStore, key, samples, stalling_cache

from hicache.accounting import L3_UNSERVED_REASONS as UNSERVED_REASONS
from hicache.cache import CacheFullError, HiCache
from hicache.keys import page_keys_from_bytes, tokens_to_bytes
from hicache.storage.prefetch import PrefetchTask
from kvhelpers import commit_fresh, kv_equal, read_kv, small_config

P = 4  # tokens per page (small_config)


@pytest.fixture
def caches() -> Iterator[list[HiCache]]:
    made: list[HiCache] = []
    yield made
    for c in made:
        c.close()


def file_cache(caches: list[HiCache], tmp: Path, **storage: object) -> HiCache:
    c = HiCache(small_config(cache={"write_policy": "write_through"},
                             storage={"url": f"file://{tmp / 'l3'}", **storage}))
    caches.append(c)
    return c


def prompt(tag: int, pages: int) -> list[int]:
    return [tag * 1000 + i for i in range(pages * P)]


def cold_l3(cache: HiCache, tokens: list[int], seed: int = 7) -> list[list[object]]:
    """``tokens`` committed, written to L3, then dropped from L1 and L2; returns the KV written."""
    kv = commit_fresh(cache, tokens, seed=seed)
    cache.flush()
    cache.clear()
    return kv  # type: ignore[return-value]


def l3_figures(cache: HiCache) -> dict[str, float]:
    """The L3 accounting in tokens: ``served`` (hit{l3}), ``matched``, and each unserved reason."""
    s = samples(cache.metrics.registry)
    out = {"served": s.get(key("hicache_hit_tokens_total", tier="l3"), 0.0),
           "matched": s.get(key("hicache_l3_matched_tokens_total"), 0.0)}
    for r in UNSERVED_REASONS:
        out[r] = s.get(key("hicache_l3_unserved_tokens_total", reason=r), 0.0)
    return out


def expect(served: int = 0, matched: int = 0, **unserved: int) -> dict[str, float]:
    out = {"served": float(served), "matched": float(matched)}
    out.update({r: float(unserved.get(r, 0)) for r in UNSERVED_REASONS})
    return out


def go_once_stopped(store: StallingStore, task: PrefetchTask) -> threading.Thread:
    """Let the store's stalled read go on once the prefetch has been told to stop (by its policy's wait or
    a release), so exactly the read in flight lands and nothing after it."""
    def run() -> None:
        task._stop.wait(20)
        store.go()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def page_path(cache: HiCache, tokens: list[int], page: int) -> Path:
    k = page_keys_from_bytes(cache.ns.digest, tokens_to_bytes(tokens), P)[page]
    return Path(cache.storage.path(k))  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deleted", "damaged", "foreign"])
def test_a_page_gone_between_match_and_prefetch_is_not_an_l3_hit(caches: list[HiCache], tmp_path: Path,
                                                                  how: str) -> None:
    """The store has all 8 pages at the match; page 5 is then deleted, damaged, or replaced by another
    page's frame before the prefetch reads it. Pages 0-4 are served (byte-identical); 5-7 are missing."""
    cache = file_cache(caches, tmp_path)
    doc = prompt(1, 8)
    kv = cold_l3(cache, doc)
    req = cache.match(doc)
    assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, 8)
    assert l3_figures(cache) == expect(matched=32)  # nothing served yet

    victim = page_path(cache, doc, 5)
    if how == "deleted":
        victim.unlink()
    elif how == "damaged":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:  # a valid frame, of another page
        shutil.copyfile(page_path(cache, doc, 2), victim)

    assert cache.prefetch(req) == 8
    load = cache.load_back(req)
    load.wait()
    assert load.l3_pages == 5 and len(load.device_indices) == 5
    assert kv_equal(read_kv(cache, load.device_indices), [[t[:5] for t in layer] for layer in kv])  # type: ignore[index]
    assert l3_figures(cache) == expect(served=20, matched=32, missing=12)
    cache.release(req)
    assert l3_figures(cache) == expect(served=20, matched=32, missing=12), "a release counts nothing again"
    cache.check_integrity()


def test_a_prefetch_cut_short_by_its_timeout_serves_only_what_landed(caches: list[HiCache]) -> None:
    """prefetch_policy timeout: 3 pages land, the 4th read stalls past the wait; that read lands as the
    prefetch stops, the last 4 pages are never read: 4 pages served, 4 cut short."""
    cfg = small_config(cache={"write_policy": "write_through"},
                       storage={"prefetch_policy": "timeout", "io_batch_pages": 1, "prefetch_timeout_base_s": 0.2,
                                "prefetch_timeout_per_1k_tokens_s": 0.0})
    cache, store = stalling_cache(cfg)
    caches.append(cache)
    doc = prompt(2, 8)
    kv = cold_l3(cache, doc)
    store.stall_reads_after(3, fail=False)
    req = cache.match(doc)
    assert req.l3_pages == 8 and cache.prefetch(req) == 8
    assert req.prefetch is not None and store.stalled.wait(10)
    waiter = go_once_stopped(store, req.prefetch)
    load = cache.load_back(req)
    load.wait()
    waiter.join(20)
    assert load.l3_pages == 4
    assert kv_equal(read_kv(cache, load.device_indices), [[t[:4] for t in layer] for layer in kv])  # type: ignore[index]
    assert l3_figures(cache) == expect(served=16, matched=32, cut_short=16)
    cache.release(req)
    cache.check_integrity()


@pytest.mark.parametrize("fail", [False, True])
def test_a_prefetch_cancelled_by_release_serves_nothing(caches: list[HiCache], fail: bool) -> None:
    """Released with its prefetch in flight: the 3 pages read and the 4th (when the store returns it) landed
    for nothing (dropped); the pages after it were cut short, or, when the store failed the 4th read,
    are missing."""
    cfg = small_config(cache={"write_policy": "write_through"}, storage={"io_batch_pages": 1})
    cache, store = stalling_cache(cfg)
    caches.append(cache)
    doc = prompt(3, 8)
    cold_l3(cache, doc)
    store.stall_reads_after(3, fail=fail)
    req = cache.match(doc)
    assert cache.prefetch(req) == 8
    assert req.prefetch is not None and store.stalled.wait(10)
    waiter = go_once_stopped(store, req.prefetch)
    cache.release(req)
    waiter.join(20)
    if fail:
        assert l3_figures(cache) == expect(matched=32, dropped=12, missing=20)
    else:
        assert l3_figures(cache) == expect(matched=32, dropped=16, cut_short=16)
    cache.check_integrity()


def test_landed_pages_with_no_room_on_l1_are_dropped(caches: list[HiCache], tmp_path: Path) -> None:
    """The whole run lands on L2, but every L1 page is locked by another request: the load back fails, the
    request is released without them. Not an L3 hit: 8 pages dropped."""
    cache = file_cache(caches, tmp_path)
    doc, big = prompt(4, 8), prompt(5, 16)
    cold_l3(cache, doc)
    commit_fresh(cache, big, seed=1)
    cache.flush()
    held = cache.match(big)  # locks all 16 L1 pages
    assert held.l1_pages == 16
    req = cache.match(doc)
    assert req.l3_pages == 8 and cache.prefetch(req) == 8
    with pytest.raises(CacheFullError):
        cache.load_back(req)
    cache.release(req)
    assert l3_figures(cache) == expect(matched=32, dropped=32)
    cache.release(held)
    cache.check_integrity()


def test_an_l3_run_no_prefetch_reads_is_not_fetched(caches: list[HiCache], tmp_path: Path) -> None:
    """Below storage.prefetch_threshold_tokens no prefetch starts; a request never prefetched (a peek) is
    the same: what the store reported is matched, none of it served."""
    cache = file_cache(caches, tmp_path, prefetch_threshold_tokens=64)
    doc = prompt(6, 8)
    cold_l3(cache, doc)
    req = cache.match(doc)
    assert req.l3_pages == 8 and cache.prefetch(req) == 0
    load = cache.load_back(req)
    assert load.l3_pages == 0 and len(load.device_indices) == 0
    assert l3_figures(cache) == expect(matched=32), "settled at release, not at a load back with no prefetch"
    cache.release(req)
    assert l3_figures(cache) == expect(matched=32, not_fetched=32)
    peek = cache.match(doc)
    cache.release(peek)
    assert l3_figures(cache) == expect(matched=64, not_fetched=64)


def test_the_tally_adds_up_over_many_requests(caches: list[HiCache], tmp_path: Path) -> None:
    """Served plus unserved equals matched once every request is released, with pages of a shared run
    damaged, deleted and intact across requests; served equals what the load backs reported."""
    cache = file_cache(caches, tmp_path, prefetch_policy="wait_complete")
    docs = [prompt(10 + d, 2 + d) for d in range(5)]
    for i, d in enumerate(docs):
        cold_l3(cache, d, seed=i)
    reported = 0
    for i, d in enumerate(docs):
        req = cache.match(d)
        if i % 2:  # the store loses page 1 after the match
            page_path(cache, d, 1).unlink()
        cache.prefetch(req)
        reported += cache.load_back(req).l3_pages * P
        cache.release(req)
        cache.clear()
    f = l3_figures(cache)
    assert f["served"] == reported
    assert f["served"] + sum(f[r] for r in UNSERVED_REASONS) == f["matched"] == sum(len(d) for d in docs)
    lost = sum(len(d) - P for i, d in enumerate(docs) if i % 2)  # all but page 0 of the odd ones
    assert (f["missing"], f["cut_short"], f["dropped"], f["not_fetched"]) == (lost, 0, 0, 0)
