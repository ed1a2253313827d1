"""The cache orchestrator: tier round trips, isolation, write policies, integrity, release."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hicache.cache import CacheFullError, HiCache
from hicache.keys import Namespace
from hicache.layout import KVLayout
from hicache.storage.memory import MemoryBackend
from kvhelpers import commit_fresh, kv_equal, read_kv, serve, small_config


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first", "block_first"])
def test_round_trip_l1_l2_l3_bytes_identical(make_cache, host_layout: str) -> None:
    cache = make_cache(cache={"write_policy": "write_through", "host_layout": host_layout, "host_block_pages": 4},
                       storage={"url": "memory://"})
    assert cache.host_pool.host_layout == host_layout
    tokens = list(range(1, 33))  # 8 pages
    kv = commit_fresh(cache, tokens, seed=1)
    cache.flush()

    req = cache.match(tokens)
    assert (req.l1_pages, req.l2_pages) == (8, 0)
    assert kv_equal(read_kv(cache, req.device_indices), kv)
    cache.release(req)

    cache.evict(l1_pages=8)  # backed up: downgraded to host-only
    req = cache.match(tokens)
    assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 8, 0)
    load = cache.load_back(req)
    load.wait()
    assert load.l2_pages == 8
    assert kv_equal(read_kv(cache, load.device_indices), kv)
    cache.release(req)
    cache.check_integrity()

    cache.evict(l1_pages=8, l2_pages=8)  # gone from L1 and L2; L3 (memory://) still has every page
    req = cache.match(tokens)
    assert (req.l1_pages, req.l2_pages, req.l3_pages) == (0, 0, 8)
    assert cache.prefetch(req) == 8
    load = cache.load_back(req)
    load.wait()
    assert (load.l2_pages, load.l3_pages) == (8, 8)
    assert kv_equal(read_kv(cache, load.device_indices), kv)
    cache.check_integrity([req])
    cache.release(req)
    cache.check_integrity()


def test_partial_hit_then_extension(make_cache) -> None:
    cache = make_cache(cache={"write_policy": "write_through"})
    doc = list(range(100, 116))  # 4 pages
    commit_fresh(cache, doc, seed=2)
    q = [*doc, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # 2 new full pages + 1 partial token
    req, _ = serve(cache, q, seed=3)
    assert req.l1_pages == 4
    assert req.cached_tokens == 24
    cache.release(req)
    again = cache.match(q)
    assert again.l1_pages == 6
    cache.release(again)
    cache.check_integrity()


def test_namespaces_and_tenants_never_hit_each_other(make_cache) -> None:
    cache = make_cache()
    tokens = list(range(16))
    commit_fresh(cache, tokens, seed=4)
    for tenant in ("acme", "globex"):
        req = cache.match(tokens, cache.namespace(tenant))
        assert req.hit_pages == 0
        cache.release(req)
    other_model = Namespace("other", cache.layout)
    req = cache.match(tokens, other_model)
    assert req.hit_pages == 0
    cache.release(req)
    other_rev = Namespace(cache.ns.model, cache.layout, revision="v2")
    req = cache.match(tokens, other_rev)
    assert req.hit_pages == 0
    cache.release(req)
    req = cache.match(tokens)
    assert req.l1_pages == 4
    cache.release(req)


def test_another_page_size_or_layout_never_matches(make_cache) -> None:
    cache = make_cache()
    commit_fresh(cache, list(range(16)), seed=5)
    other = Namespace(cache.ns.model, KVLayout(3, 2, 4, "float32", 8))
    with pytest.raises(ValueError, match="layout"):
        cache.match(list(range(16)), other)


def test_l3_shared_between_caches_isolates_tenants() -> None:
    cfg = small_config(cache={"write_policy": "write_through"})
    a = HiCache(cfg, storage=MemoryBackend("memory://", _ctx(cfg)))
    shared = a.storage
    b = HiCache(small_config(model={"tenant": "other"}), storage=shared)
    try:
        tokens = list(range(32))
        commit_fresh(a, tokens, seed=6)
        a.flush()
        assert len(shared) == 8
        req = b.match(tokens)
        assert req.hit_pages == 0  # same store, other tenant: no key in common
        b.release(req)
    finally:
        a.close()


def _ctx(cfg):
    from hicache.storage.base import StorageContext

    ns = cfg.namespace()
    return StorageContext(ns.digest, ns.layout)


def test_foreign_or_damaged_l3_page_is_a_counted_miss(make_cache) -> None:
    cache = make_cache(cache={"write_policy": "write_through"}, storage={"url": "memory://"})
    tokens = list(range(32))
    kv = commit_fresh(cache, tokens, seed=7)
    cache.flush()
    cache.evict(l1_pages=100, l2_pages=100)
    store = cache.storage
    assert isinstance(store, MemoryBackend)
    keys = cache.match(tokens, l3=False).keys
    blob = bytearray(store.raw(keys[2]) or b"")
    blob[-1] ^= 0xFF
    store.put_raw(keys[2], bytes(blob))
    req = cache.match(tokens)
    assert req.l3_pages == 8  # exists, but will fail verification
    cache.prefetch(req)
    load = cache.load_back(req)
    load.wait()
    assert load.l3_pages == 2  # pages 0 and 1 only: the damaged page 2 is a miss, nothing after it is used
    assert kv_equal(read_kv(cache, load.device_indices), [[t[:2] for t in row] for row in kv])
    cache.release(req)
    cache.stats()
    assert cache.metrics.registry.get_sample_value("hicache_storage_corrupt_pages_total") == 1


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_write_policies_behave_as_named(make_cache, policy: str) -> None:
    cache = make_cache(cache={"write_policy": policy})
    tokens = list(range(16))
    commit_fresh(cache, tokens, seed=8)
    cache.flush()
    after_commit = cache.tree.host_pages
    req = cache.match(tokens)  # second hit
    cache.release(req)
    cache.flush()
    after_second_hit = cache.tree.host_pages
    cache.evict(l1_pages=4)
    after_evict = cache.match(tokens)
    cache.release(after_evict)
    if policy == "write_through":
        assert (after_commit, after_second_hit) == (4, 4)
        assert after_evict.l2_pages == 4
    elif policy == "write_through_selective":
        assert (after_commit, after_second_hit) == (0, 4)
        assert after_evict.l2_pages == 4
    else:
        assert (after_commit, after_second_hit) == (0, 0)
        assert after_evict.l2_pages == 4  # backed up at eviction
    cache.check_integrity()


def test_a_backup_with_no_room_on_l2_is_counted(make_cache) -> None:
    """write_through backs every commit up to L2; when no L2 page is free or evictable (here all of L2 holds
    a prefix a request is using) the backup is skipped, and counted: those pages are lost once L1 evicts
    them."""
    cache = make_cache(cache={"write_policy": "write_through", "l1_tokens": 64, "l2_tokens": 16})
    skipped = "hicache_backup_skipped_tokens_total"
    a = list(range(16))
    commit_fresh(cache, a, seed=20)
    cache.flush()
    cache.evict(l1_pages=4)
    held = cache.match(a)  # pins A's 4 pages: all of L2
    assert held.l2_pages == 4
    assert cache.metrics.registry.get_sample_value(skipped) == 0
    commit_fresh(cache, list(range(100, 116)), seed=21)
    cache.flush()
    assert cache.metrics.registry.get_sample_value(skipped) == 16
    cache.release(held)
    commit_fresh(cache, list(range(200, 216)), seed=22)  # room again: A's pages are evictable
    cache.flush()
    assert cache.metrics.registry.get_sample_value(skipped) == 16
    cache.check_integrity()


def test_selective_drops_cold_pages_on_eviction(make_cache) -> None:
    cache = make_cache(cache={"write_policy": "write_through_selective"})
    commit_fresh(cache, list(range(16)), seed=9)
    cache.evict(l1_pages=4)
    req = cache.match(list(range(16)))
    assert req.hit_pages == 0  # seen once, never backed up, so evicting dropped it
    cache.release(req)
    cache.check_integrity()


def test_locked_prefix_survives_pressure_and_full_cache_raises(make_cache) -> None:
    cache = make_cache(cache={"l1_tokens": 32, "l2_tokens": 0})
    doc = list(range(16))
    commit_fresh(cache, doc, seed=10)
    holder = cache.match(doc)  # locks 4 pages
    other = cache.match(list(range(500, 516)))
    pages = cache.alloc(other, 4)  # evicts nothing locked: 4 free pages remain
    with pytest.raises(CacheFullError):
        cache.alloc(other, 1)
    cache.commit(other, list(range(500, 516)), pages)
    cache.release(other)
    again = cache.match(doc)
    assert again.l1_pages == 4
    cache.release(again)
    cache.release(holder)
    cache.check_integrity()


def test_double_release_is_an_error(make_cache) -> None:
    cache = make_cache()
    req = cache.match(list(range(8)))
    cache.release(req)
    with pytest.raises(ValueError, match="released"):
        cache.release(req)


def test_commit_rejects_pages_it_does_not_own(make_cache) -> None:
    cache = make_cache()
    req = cache.match(list(range(8)))
    with pytest.raises(ValueError, match="not allocated"):
        cache.commit(req, list(range(8)), np.array([0, 1]))
    cache.release(req)
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_integrity_after_random_workload_and_nothing_leaks(make_cache, policy: str) -> None:
    cache = make_cache(cache={"write_policy": policy, "l1_tokens": 96, "l2_tokens": 160},
                       storage={"url": "memory://"})
    rng = random.Random(policy)
    docs = [[rng.randrange(1000) for _ in range(rng.choice([8, 16, 24]))] for _ in range(6)]
    truth: dict[tuple[int, ...], list[list[torch.Tensor]]] = {}
    for i in range(120):
        tokens = rng.choice(docs) + [rng.randrange(1000) for _ in range(rng.choice([0, 4, 5, 8]))]
        req, load = serve(cache, tokens, seed=i)
        # every page the cache brought back holds the bytes first written for that prefix
        n_pages = len(tokens) // cache.page_size
        cur = read_kv(cache, req.device_indices)
        for p in range(n_pages):
            key = tuple(tokens[: (p + 1) * cache.page_size])
            page_kv = [[t[p] for t in row] for row in cur]
            if p < len(load.device_indices):  # served from the cache: must be what was computed before
                assert kv_equal(page_kv, truth[key]), f"page {p} of request {i} changed"
            else:  # computed now (first time, or recomputed after it was dropped)
                truth[key] = page_kv
        cache.check_integrity([req])
        cache.release(req)
        if rng.random() < 0.2:
            cache.evict(l1_pages=rng.randrange(1, 8), l2_pages=rng.randrange(0, 8))
        cache.check_integrity()
    cache.evict(l1_pages=10**6)  # under write_back this backs everything up to L2 (and queues L3 writes)
    cache.flush()  # L2 pages stay pinned until their L3 write is done
    cache.evict(l2_pages=10**6)
    assert cache.device_pool.allocator.used_pages == 0
    assert cache.host_pool.allocator.used_pages == 0
    assert cache.tree.locked_device_pages == 0


def test_metrics_count_hits_per_tier(make_cache) -> None:
    cache = make_cache(cache={"write_policy": "write_through"})
    tokens = list(range(16))
    commit_fresh(cache, tokens[:8], seed=11)  # lookup 1: miss
    req, _ = serve(cache, tokens, seed=12)  # lookup 2: 8 tokens on L1
    cache.release(req)
    cache.flush()
    cache.evict(l1_pages=2)  # the leaf (last 2 pages) goes to host-only
    req = cache.match(tokens)  # lookup 3: 8 on L1, 8 on L2
    cache.load_back(req).wait()
    cache.release(req)
    r = cache.metrics.registry
    assert r.get_sample_value("hicache_hit_tokens_total", {"tier": "l1"}) == 16
    assert r.get_sample_value("hicache_hit_tokens_total", {"tier": "l2"}) == 8
    assert r.get_sample_value("hicache_loadback_tokens_total") == 8
    assert r.get_sample_value("hicache_lookups_total") == 3
    assert r.get_sample_value("hicache_evicted_tokens_total", {"tier": "l1"}) == 8
    assert r.get_sample_value("hicache_pool_total_pages", {"tier": "l1"}) == 16
    # one submission timed per transfer: the load-back, and a backup per committed node (write-through)
    assert r.get_sample_value("hicache_transfer_submit_seconds_count", {"direction": "load"}) == 1
    assert r.get_sample_value("hicache_transfer_submit_seconds_count", {"direction": "backup"}) == 2
    assert r.get_sample_value("hicache_transfer_submit_seconds_sum", {"direction": "load"}) > 0


def test_priority_policy_evicts_low_priority_first(make_cache) -> None:
    cache = make_cache(cache={"eviction_policy": "priority", "l2_tokens": 0})
    keep, drop = list(range(16)), list(range(100, 116))
    for toks, prio in ((keep, 10), (drop, 0)):
        req = cache.match(toks)
        pages = cache.alloc(req, 4)
        cache.commit(req, toks, pages, priority=prio)
        cache.release(req)
    cache.evict(l1_pages=4)
    a, b = cache.match(keep), cache.match(drop)
    assert (a.l1_pages, b.l1_pages) == (4, 0)  # the later-used but low-priority run went first
    cache.release(a)
    cache.release(b)


def test_release_frees_a_finished_prefetch_that_was_never_loaded(make_cache) -> None:
    cache = make_cache(cache={"write_policy": "write_through"}, storage={"url": "memory://"})
    tokens = list(range(32))
    commit_fresh(cache, tokens, seed=13)
    cache.flush()
    cache.evict(l1_pages=100)
    cache.flush()
    cache.evict(l2_pages=100)
    req = cache.match(tokens)
    assert cache.prefetch(req) == 8
    assert req.prefetch is not None and req.prefetch.finish(None) == 8  # e.g. a caller cut off by its deadline
    cache.release(req)
    cache.check_integrity()
    assert cache.host_pool.allocator.used_pages == 0


def test_pages_of_backups_in_flight_count_as_headroom_once_waited_for(make_cache) -> None:
    """Write-through pages stay locked while their L1 -> L2 backup is in flight: ``device_headroom``
    counts them only after the backups end, and with ``wait_backups`` it waits for that."""
    import threading

    cache = make_cache(cache={"write_policy": "write_through", "l1_tokens": 32})  # 8 pages
    gate = threading.Event()
    cache.transfer._queue.put(gate.wait)  # hold the CPU engine's worker: backups queue behind it
    try:
        commit_fresh(cache, list(range(1, 17)), seed=1)  # 4 pages, backup queued
        commit_fresh(cache, list(range(101, 117)), seed=2)
        assert cache.device_headroom() == (0, 0)  # all 8 pages locked by backups in flight
        threading.Timer(0.2, gate.set).start()
        free, evictable = cache.device_headroom(wait_backups=True)
        assert (free, evictable) == (0, 8)
        req = cache.match(list(range(201, 217)))
        assert len(cache.alloc(req, 4)) == 4  # evicts backed-up pages
        cache.release(req)
    finally:
        gate.set()
    cache.check_integrity()


@pytest.mark.parametrize(("host_layout", "block_pages"), [("page_first", 0), ("layer_first", 0), ("block_first", 8)])
def test_l2_too_large_suggests_a_size_that_fits(host_layout: str, block_pages: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal of an L2 larger than the host can spare names a cache.l2_tokens that then starts, a
    block-first pool's whole last block included."""
    import re

    import hicache.pool as pool_mod
    from hicache.config import ConfigError

    cfg = small_config(cache={"l2_tokens": 4 * 40, "host_layout": host_layout, "host_block_pages": block_pages})
    page_bytes = cfg.layout.to_layout().bytes_per_page
    monkeypatch.setattr(pool_mod, "available_host_memory", lambda: 20 * page_bytes)
    with pytest.raises(ConfigError) as e:
        HiCache(cfg)
    m = re.search(r"holds at most (\d+)", str(e.value))
    assert m is not None, str(e.value)
    fit = int(m.group(1))
    assert fit == (16 if host_layout == "block_first" else 20) * 4
    HiCache(small_config(cache={"l2_tokens": fit, "host_layout": host_layout,
                                "host_block_pages": block_pages})).close()
